"""Request traces for the replay benchmark: one in-memory type, three file formats.

A :class:`Trace` is an ordered tuple of :class:`TraceRequest` (arrival time, prompt length,
output length) plus ``notes``: facts about how the file was turned into requests that the
replay must print next to its results (synthetic content added, rows clamped, arrivals
retimed...).

Prompt tokens are never stored for synthetic content. A request keeps a short description
of its prompt (hash ids, or *segments*) and :meth:`TraceRequest.prompt_token_ids` expands it
on demand: a replay holds thousands of requests of ~15k tokens and only materialises the
active ones.

Token content
-------------
Every synthetic prompt is a concatenation of *segments* ``(key, length)``. A segment's tokens
are the splitmix64 stream seeded by its 64-bit ``key``::

    token[i] = 1 + range_reduce(mix64(key + (i + 1) * GOLDEN), vocab_size - 1)     # in [1, vocab_size)

so equal keys give equal tokens at equal offsets, wherever the segment sits in whichever
prompt, and different keys give unrelated content (a collision needs two 64-bit streams to
overlap). Token 0 is never produced: it is reserved for padding.

- mooncake: each hash id is one 512-token segment keyed by the id alone; the last id may be
  cut short (``input_length`` is the truth). Two prompts sharing their first ``k`` ids share
  their first ``512 k`` tokens, so the reuse is real at token level for any
  ``tokens_per_block``.
- azure: no prefix information, so each prompt is one segment keyed by ``(seed, row)``;
  with ``system_prompt_len = S > 0`` a segment keyed by ``seed`` alone is put first. Rule:
  the prompt length stays ``ContextTokens``; a prompt longer than ``S`` is the whole system
  prompt plus ``ContextTokens - S`` unique tokens, a prompt of at most ``S`` tokens is the
  system prompt's first ``ContextTokens - 1`` tokens plus one unique token (no two Azure
  prompts become identical: the trace does not say that any are).
- trtllm: ``input_ids`` are kept as given (ids outside ``[1, vocab_size)`` are folded in
  with ``1 + id % (vocab_size - 1)`` and counted in notes); ``prompt`` strings are tokenized
  byte-level (UTF-8 byte + 1).

Line numbers in :class:`TraceFormatError` are 1-based lines of the file.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tensorrt_llm._torch.pyexecutor.llm_request import token_array

__all__ = [
    "check_vocab_size",
    "FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "MooncakeRequest",
    "SyntheticRequest",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "TrtllmRequest",
    "load_trace",
    "poisson_arrivals",
    "segment_key",
]

FORMATS = ("mooncake", "azure", "trtllm", "scenario")
MOONCAKE_BLOCK_TOKENS = 512  # one Mooncake hash id covers this many prompt tokens
MIN_VOCAB_SIZE = 64
DEFAULT_VOCAB_SIZE = 32000

# ---------------------------------------------------------------------------------------
# Token streams (splitmix64, vectorised)
# ---------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_U = np.uint64
# (i + 1) * GOLDEN for i in [0, 512): the per-offset increments of one Mooncake block.
_BLOCK_STEPS = np.arange(1, MOONCAKE_BLOCK_TOKENS + 1, dtype=np.uint64) * _U(_GOLDEN)

# Domain tags keep keys of different kinds of content apart.
_TAG_MOONCAKE = 0x6D6F6F6E63616B65
_TAG_DEFAULT = 0x64656661756C7421


def _mix64_scalar(x: int) -> int:
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def segment_key(*parts: int) -> int:
    """A 64-bit content key from integer parts (order matters). Equal parts, equal key."""
    h = 0
    for part in parts:
        h = _mix64_scalar(h ^ (int(part) & _MASK64))
    return h


def _mix64_inplace(z: np.ndarray) -> None:
    z ^= z >> _U(30)
    z *= _U(_MIX1)
    z ^= z >> _U(27)
    z *= _U(_MIX2)
    z ^= z >> _U(31)


def _stream_to_tokens(z: np.ndarray, vocab_size: int) -> array:
    """Mix the stream states ``z`` (uint64, modified in place) into ids in [1, vocab_size), packed
    as ``LlmRequest.tokens`` holds them: a prompt never exists as a list of Python ints."""
    _mix64_inplace(z)
    # Multiply-shift range reduction on the top 32 bits: no 64-bit division, bias < 2**-17.
    z >>= _U(32)
    z *= _U(vocab_size - 1)
    z >>= _U(32)
    z += _U(1)
    return token_array(z.view(np.int64))  # the ids are below 2**32: the same bits as int64


def _expand_segments(segments: Sequence[tuple[int, int]], vocab_size: int) -> array:
    keys = np.fromiter((k for k, _ in segments), dtype=np.uint64, count=len(segments))
    lengths = np.fromiter((n for _, n in segments), dtype=np.int64, count=len(segments))
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    steps = np.arange(1, total + 1, dtype=np.uint64) - np.repeat(starts, lengths).astype(np.uint64)
    z = np.repeat(keys, lengths)
    z += steps * _U(_GOLDEN)
    return _stream_to_tokens(z, vocab_size)


def _expand_mooncake(hash_ids: Sequence[int], input_len: int, vocab_size: int) -> array:
    keys = np.array(hash_ids, dtype=np.uint64)
    keys ^= _U(_TAG_MOONCAKE)
    _mix64_inplace(keys)
    z = (keys[:, None] + _BLOCK_STEPS[None, :]).ravel()[:input_len]  # (num_ids * 512,) -> (input_len,)
    return _stream_to_tokens(z, vocab_size)


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless ``vocab_size`` is an int in [64, 2**32] (token 0 is padding)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size must be <= 2**32, got {vocab_size}")


def poisson_arrivals(n: int, qps: float, rng: np.random.Generator) -> list[float]:
    """``n`` sorted arrival times of a Poisson process at ``qps``, conditioned on the first
    arrival at 0.0 and the last at ``(n - 1) / qps``: the points in between are independent
    uniform draws, sorted (that is the law of a Poisson process given its count). Bursts and
    lulls are Poisson, but the mean rate is exactly ``qps``, whatever the seed."""
    if not (math.isfinite(qps) and qps > 0):
        raise ValueError(f"qps must be finite and > 0, got {qps}")
    if n <= 1:
        return [0.0] * n
    span = (n - 1) / qps
    inner = np.sort(rng.uniform(0.0, span, size=n - 2))
    return [0.0, *inner.tolist(), span]


# ---------------------------------------------------------------------------------------
# Requests and traces
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Tokens come only from :meth:`prompt_token_ids`.

    ``request_index`` is the request's 0-based data row (after ``num_requests`` filtering);
    it is unique within a trace and equals the position in ``Trace.requests`` unless the
    source file was out of time order (Azure only; the loader says so in notes).
    """

    request_index: int
    arrival_s: float  # seconds since the first request of the trace
    input_len: int
    output_len: int  # >= 1

    def __post_init__(self) -> None:
        if self.request_index < 0:
            raise ValueError(f"request_index must be >= 0, got {self.request_index}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    def prompt_token_ids(self) -> array:
        """The prompt, materialised now as a packed token array (what ``LlmRequest`` holds;
        ``.tolist()`` gives a list). The base class has no content of its own: it yields
        ``input_len`` tokens unique to ``request_index`` (vocab 32000). Loaders return
        subclasses that carry the trace's real structure."""
        key = segment_key(_TAG_DEFAULT, self.request_index)
        return _expand_segments(((key, self.input_len),), DEFAULT_VOCAB_SIZE)


@dataclass(frozen=True, slots=True)
class SyntheticRequest(TraceRequest):
    """A prompt made of segments ``(key, length)``; see the module docstring."""

    segments: tuple[tuple[int, int], ...]
    vocab_size: int

    def __post_init__(self) -> None:
        TraceRequest.__post_init__(self)
        if sum(n for _, n in self.segments) != self.input_len:
            raise ValueError("segment lengths must add up to input_len")
        if any(n < 1 for _, n in self.segments):
            raise ValueError("segment lengths must be >= 1")
        check_vocab_size(self.vocab_size)

    def prompt_token_ids(self) -> array:
        return _expand_segments(self.segments, self.vocab_size)


@dataclass(frozen=True, slots=True)
class MooncakeRequest(TraceRequest):
    """A Mooncake row: one 512-token block per hash id, the last one possibly partial."""

    hash_ids: tuple[int, ...]
    vocab_size: int

    def __post_init__(self) -> None:
        TraceRequest.__post_init__(self)
        n = len(self.hash_ids)
        if not (MOONCAKE_BLOCK_TOKENS * (n - 1) < self.input_len <= MOONCAKE_BLOCK_TOKENS * n):
            raise ValueError(f"input_len {self.input_len} does not fit {n} hash ids of 512 tokens")
        check_vocab_size(self.vocab_size)

    def prompt_token_ids(self) -> array:
        return _expand_mooncake(self.hash_ids, self.input_len, self.vocab_size)


@dataclass(frozen=True, slots=True)
class TrtllmRequest(TraceRequest):
    """A row of upstream's benchmark dataset; the ids are the data, so they are kept."""

    task_id: int | str
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        TraceRequest.__post_init__(self)
        if len(self.token_ids) != self.input_len:
            raise ValueError("len(token_ids) must equal input_len")

    def prompt_token_ids(self) -> array:
        return token_array(self.token_ids)


@dataclass(frozen=True, slots=True)
class Trace:
    """An arrival-ordered list of requests plus the notes a replay must print with it."""

    name: str
    format: str  # "mooncake" | "azure" | "trtllm" | "scenario"
    requests: tuple[TraceRequest, ...]  # sorted by arrival_s (stable)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        object.__setattr__(self, "requests", tuple(self.requests))  # accept any sequence, store immutably
        object.__setattr__(self, "notes", tuple(self.notes))
        arrivals = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise ValueError("requests must be sorted by arrival_s")
        if len({r.request_index for r in self.requests}) != len(self.requests):
            raise ValueError("request_index values must be unique")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def retimed(self, qps: float, seed: int) -> Trace:
        """Same requests in the same order, arrivals replaced by :func:`poisson_arrivals` at
        ``qps`` requests/s drawn from ``numpy.random.default_rng(seed)``."""
        if not (math.isfinite(qps) and qps > 0):
            raise ValueError(f"qps must be finite and > 0, got {qps}")
        arrivals = poisson_arrivals(len(self.requests), qps, np.random.default_rng(seed))
        requests = tuple(dataclasses.replace(r, arrival_s=t) for r, t in zip(self.requests, arrivals))
        note = f"arrivals replaced by Poisson arrivals at {qps:g} req/s (seed {seed})"
        return Trace(self.name, self.format, requests, self.notes + (note,))

    def scaled(self, time_scale: float) -> Trace:
        """Arrival times multiplied by ``time_scale`` (< 1 compresses the trace, i.e. more load)."""
        if not (math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"time_scale must be finite and >= 0, got {time_scale}")
        requests = tuple(dataclasses.replace(r, arrival_s=r.arrival_s * time_scale) for r in self.requests)
        note = f"arrival times scaled by {time_scale:g}"
        return Trace(self.name, self.format, requests, self.notes + (note,))

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (all of them if there are fewer)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n >= len(self.requests):
            return self
        note = f"kept the first {n} of {len(self.requests)} requests"
        return Trace(self.name, self.format, self.requests[:n], self.notes + (note,))


class TraceFormatError(ValueError):
    """A trace file that cannot be loaded. Message: ``"<file>:<line>: <what is wrong>"``."""

    def __init__(self, path: str | Path, line: int, what: str) -> None:
        self.path = str(path)
        self.line = line
        self.what = what
        super().__init__(f"{self.path}:{line}: {what}")

    def __reduce__(self):  # keep it picklable despite the custom signature
        return (type(self), (self.path, self.line, self.what))


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def load_trace(
    path: str | Path,
    format: str = "auto",
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    system_prompt_len: int = 0,
    seed: int = 0,
    num_requests: int | None = None,
) -> Trace:
    """Load a trace file whole, or raise :class:`TraceFormatError` (nothing half-loaded).

    ``format``: ``"auto"`` (``.csv`` is azure; ``.jsonl``/``.json`` is mooncake or trtllm by
    the first record's keys), ``"mooncake"``, ``"azure"`` or ``"trtllm"``.
    ``system_prompt_len`` and ``seed`` shape Azure's synthetic content only.
    ``num_requests`` keeps the first N data rows of the file (rows after them are not read).
    Arrivals are made relative to the earliest request, which arrives at 0.0.
    """
    check_vocab_size(vocab_size)
    if isinstance(system_prompt_len, bool) or not isinstance(system_prompt_len, int) or system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be an int >= 0, got {system_prompt_len!r}")
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1):
        raise ValueError(f"num_requests must be None or an int >= 1, got {num_requests!r}")
    path = Path(path)
    text = _read_text(path)
    if format == "auto":
        format = _detect_format(path, text)
    loaders: dict[str, Callable[..., Trace]] = {"mooncake": _load_mooncake, "azure": _load_azure, "trtllm": _load_trtllm}
    if format not in loaders:
        raise TraceFormatError(path, 1, f"unknown format {format!r} (expected auto, mooncake, azure or trtllm)")
    trace = loaders[format](path, text, vocab_size=vocab_size, system_prompt_len=system_prompt_len, seed=seed, limit=num_requests)
    if system_prompt_len and format != "azure":
        trace = dataclasses.replace(
            trace, notes=trace.notes + (f"system_prompt_len={system_prompt_len} ignored: only azure traces get a synthetic system prompt",)
        )
    return trace


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TraceFormatError(path, line, f"not UTF-8 text ({e.reason})") from None
    if not text.strip():
        raise TraceFormatError(path, 1, "empty file")
    return text


def _detect_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if suffix not in (".jsonl", ".json") and not line.lstrip().startswith("{"):
            if "TIMESTAMP" in line and "ContextTokens" in line:
                return "azure"
            raise TraceFormatError(path, line_no, f"cannot detect the format of a {suffix or 'suffix-less'} file; pass format=")
        record = _parse_json_object(path, line_no, line)
        if "hash_ids" in record or "input_length" in record:
            return "mooncake"
        if "input_ids" in record or "prompt" in record or "output_tokens" in record:
            return "trtllm"
        raise TraceFormatError(
            path, line_no, f"cannot detect the format from keys {sorted(record)}: expected mooncake (hash_ids, input_length) or trtllm (input_ids or prompt, output_tokens)"
        )
    raise TraceFormatError(path, 1, "empty file")  # unreachable: _read_text rejects blank files


def _parse_json_object(path: Path, line_no: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, line_no, f"bad JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, line_no, f"expected one JSON object per line, got {type(record).__name__}")
    return record


def _json_records(path: Path, text: str, limit: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, object) for each non-blank line, at most ``limit`` of them."""
    count = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if limit is not None and count >= limit:
            return
        if not line.strip():
            continue
        count += 1
        yield line_no, _parse_json_object(path, line_no, line)


def _field(path: Path, line_no: int, record: dict[str, Any], name: str, check: Callable[[Any], bool], expected: str) -> Any:
    if name not in record:
        raise TraceFormatError(path, line_no, f"missing field {name!r}")
    value = record[name]
    if not check(value):
        raise TraceFormatError(path, line_no, f"field {name!r} must be {expected}, got {value!r:.80}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _clamp_note(count: int, field: str) -> tuple[str, ...]:
    return (f"{count} rows had {field}=0, clamped to 1",) if count else ()


def _load_mooncake(path: Path, text: str, *, vocab_size: int, limit: int | None, **_: Any) -> Trace:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    clamped = 0
    previous_ts: float | None = None
    for line_no, record in _json_records(path, text, limit):
        ts = _field(path, line_no, record, "timestamp", _is_number, "a finite number (ms)")
        input_len = _field(path, line_no, record, "input_length", _is_int, "an int")
        output_len = _field(path, line_no, record, "output_length", _is_int, "an int")
        hash_ids = _field(path, line_no, record, "hash_ids", lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list")
        if not all(_is_int(h) and 0 <= h <= _MASK64 for h in hash_ids):
            raise TraceFormatError(path, line_no, "field 'hash_ids' must hold non-negative ints")
        if input_len <= 0:
            raise TraceFormatError(path, line_no, f"input_length must be > 0, got {input_len}")
        if output_len < 0:
            raise TraceFormatError(path, line_no, f"output_length must be >= 0, got {output_len}")
        n = len(hash_ids)
        if not (MOONCAKE_BLOCK_TOKENS * (n - 1) < input_len <= MOONCAKE_BLOCK_TOKENS * n):
            raise TraceFormatError(
                path, line_no, f"input_length {input_len} does not match {n} hash ids of {MOONCAKE_BLOCK_TOKENS} tokens (needs {MOONCAKE_BLOCK_TOKENS * (n - 1) + 1}..{MOONCAKE_BLOCK_TOKENS * n})"
            )
        if previous_ts is not None and ts < previous_ts:
            raise TraceFormatError(path, line_no, f"timestamp goes backwards ({ts} after {previous_ts})")
        previous_ts = ts
        if output_len == 0:
            clamped += 1
        rows.append((float(ts), input_len, max(1, output_len), tuple(hash_ids)))
    if not rows:
        raise TraceFormatError(path, 1, "no requests")
    t0 = rows[0][0]
    requests = tuple(
        MooncakeRequest(i, (ts - t0) / 1000.0, input_len, output_len, hash_ids, vocab_size)
        for i, (ts, input_len, output_len, hash_ids) in enumerate(rows)
    )
    notes = (
        f"mooncake hash ids expanded to {MOONCAKE_BLOCK_TOKENS} synthetic tokens each (equal ids give equal tokens; last block may be partial)",
    ) + _clamp_note(clamped, "output_length")
    return Trace(path.stem, "mooncake", requests, notes)


_EPOCH = datetime.datetime(1, 1, 1, tzinfo=datetime.timezone.utc)


def _parse_wall_clock(value: str) -> tuple[int, int, int]:
    """(whole seconds since 0001-01-01 UTC, fraction numerator, fraction denominator).

    ISO 8601 as ``datetime.fromisoformat`` reads it ("2023-11-16 18:17:03.9799600", "T" or a
    space, an optional "Z" or offset; naive times are UTC). Fractions keep microseconds: the
    Azure traces' seventh digit is always 0.
    """
    try:
        moment = datetime.datetime.fromisoformat(value.strip())
    except ValueError as e:
        raise ValueError(f"TIMESTAMP {value!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]': {e}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    since = moment - _EPOCH
    return since.days * 86400 + since.seconds, since.microseconds, 1_000_000


def _load_azure(path: Path, text: str, *, vocab_size: int, system_prompt_len: int, seed: int, limit: int | None, **_: Any) -> Trace:
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    for header in reader:
        if any(cell.strip() for cell in header):
            break
    header_line = reader.line_num
    columns = [c.strip() for c in header or ()]
    wanted = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise TraceFormatError(path, header_line, f"CSV header lacks column(s) {', '.join(missing)} (expected TIMESTAMP,ContextTokens,GeneratedTokens)")
    i_ts, i_ctx, i_gen = (columns.index(c) for c in wanted)

    rows: list[tuple[int, int, int, int, int, int]] = []  # whole s, frac num, frac den, ctx, gen, line
    clamped = 0
    for cells in reader:
        if limit is not None and len(rows) >= limit:
            break
        line_no = reader.line_num
        if not any(cell.strip() for cell in cells):
            continue
        if len(cells) < len(columns):
            raise TraceFormatError(path, line_no, f"expected {len(columns)} columns, got {len(cells)}")
        try:
            whole, num, den = _parse_wall_clock(cells[i_ts])
        except ValueError as e:
            raise TraceFormatError(path, line_no, str(e)) from None
        ctx = _csv_int(path, line_no, "ContextTokens", cells[i_ctx])
        gen = _csv_int(path, line_no, "GeneratedTokens", cells[i_gen])
        if ctx <= 0:
            raise TraceFormatError(path, line_no, f"ContextTokens must be > 0, got {ctx}")
        if gen < 0:
            raise TraceFormatError(path, line_no, f"GeneratedTokens must be >= 0, got {gen}")
        if gen == 0:
            clamped += 1
        rows.append((whole, num, den, ctx, max(1, gen), line_no))
    if not rows:
        raise TraceFormatError(path, reader.line_num + 1, "no requests after the CSV header")

    # Exact arithmetic on the whole seconds, floats only for the (small) differences.
    t0_whole = min(r[0] for r in rows)
    arrivals = [(whole - t0_whole) + num / den for whole, num, den, *_ in rows]
    t_min = min(arrivals)
    arrivals = [t - t_min for t in arrivals]
    order = sorted(range(len(rows)), key=arrivals.__getitem__)  # stable
    out_of_order = sum(1 for a, b in zip(arrivals, arrivals[1:]) if b < a)

    sys_key = segment_key(0xA2, seed)
    truncated = 0
    requests = []
    for row in order:
        ctx, gen = rows[row][3], rows[row][4]
        unique_key = segment_key(0xA1, seed, row)
        if system_prompt_len == 0:
            segments = ((unique_key, ctx),)
        elif ctx > system_prompt_len:
            segments = ((sys_key, system_prompt_len), (unique_key, ctx - system_prompt_len))
        else:
            truncated += 1
            segments = ((sys_key, ctx - 1), (unique_key, 1)) if ctx > 1 else ((unique_key, 1),)
        requests.append(SyntheticRequest(row, arrivals[row], ctx, gen, segments, vocab_size))

    notes = ["azure trace has no prefix information: each prompt is unique synthetic tokens seeded by (seed, row)"]
    if system_prompt_len:
        notes.append(
            f"synthetic shared system prompt of {system_prompt_len} tokens added to every Azure request "
            f"(prompt length stays ContextTokens; {truncated} prompts of <= {system_prompt_len} tokens "
            f"get only its first ContextTokens-1 tokens plus 1 unique token)"
        )
    notes.extend(_clamp_note(clamped, "GeneratedTokens"))
    if out_of_order:
        notes.append(f"{out_of_order} rows were out of timestamp order; requests sorted by arrival (request_index keeps the file row)")
    return Trace(path.stem, "azure", tuple(requests), tuple(notes))


def _csv_int(path: Path, line_no: int, name: str, cell: str) -> int:
    try:
        return int(cell.strip())
    except ValueError:
        raise TraceFormatError(path, line_no, f"{name} must be an int, got {cell!r}") from None


def _load_trtllm(path: Path, text: str, *, vocab_size: int, limit: int | None, **_: Any) -> Trace:
    requests: list[TrtllmRequest] = []
    clamped = folded = from_text = 0
    for line_no, record in _json_records(path, text, limit):
        task_id = _field(path, line_no, record, "task_id", lambda v: _is_int(v) or isinstance(v, str), "an int or a string")
        output_len = _field(path, line_no, record, "output_tokens", _is_int, "an int")
        if output_len < 0:
            raise TraceFormatError(path, line_no, f"output_tokens must be >= 0, got {output_len}")
        if "input_ids" in record:
            ids = _field(path, line_no, record, "input_ids", lambda v: isinstance(v, list), "a list of ints")
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise TraceFormatError(path, line_no, "field 'input_ids' must hold non-negative ints")
        elif "prompt" in record:
            prompt = _field(path, line_no, record, "prompt", lambda v: isinstance(v, str), "a string")
            ids = [b + 1 for b in prompt.encode("utf-8")]
            from_text += 1
        else:
            raise TraceFormatError(path, line_no, "missing field 'input_ids' or 'prompt'")
        if not ids:
            raise TraceFormatError(path, line_no, "empty prompt (input length must be > 0)")
        out_of_range = sum(1 for t in ids if not 1 <= t < vocab_size)
        if out_of_range:
            folded += out_of_range
            ids = [t if 1 <= t < vocab_size else 1 + t % (vocab_size - 1) for t in ids]
        if output_len == 0:
            clamped += 1
        requests.append(TrtllmRequest(len(requests), 0.0, len(ids), max(1, output_len), task_id, tuple(ids)))
    if not requests:
        raise TraceFormatError(path, 1, "no requests")
    notes = ["trtllm dataset has no timestamps: every request arrives at 0.0 unless retimed"]
    if from_text:
        notes.append(f"{from_text} 'prompt' strings tokenized byte-level (token = UTF-8 byte + 1)")
    if folded:
        notes.append(f"{folded} token ids outside [1, {vocab_size}) folded in as 1 + id % {vocab_size - 1}")
    notes.extend(_clamp_note(clamped, "output_tokens"))
    return Trace(path.stem, "trtllm", tuple(requests), tuple(notes))
