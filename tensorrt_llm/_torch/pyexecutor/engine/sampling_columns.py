"""A step's sampling parameters, one entry per sampling row, as host columns built once per step.

The device sampling pass (:mod:`.sampling_pass`) samples every sampling row of a forward in one
batched pass. What it needs per row travels as a few numpy columns, built here from the requests
once per step and shipped to the device like the forward's ids and positions (through the pinned
staging buffers on CUDA, into a decode graph's static buffers when it replays one)::

    row (a sampling request, logit-row order)    0      1      2      3
        greedy                                   1      0      0      1
        temperature, top_p, min_p  (floats)      1,1,0  .7,.9,0 1,1,.05 1,1,0
        top_k, block key, token key, logprobs    0,0,0,-1  40,k,k,-1  0,k,k,5  0,0,0,2
    top_p_rows                                   [1]
    penalties: rows [2]; (row, id) per output token, per prompt token; in-flight input slots
    forbidden (min_tokens): (row, id) of each end id the row may not draw yet
    masks (a grammar's bitmask): rows [..], (rows, words) int32

A step whose every row is *plain greedy* (the argmax of the raw row, nothing read from it)
gets no columns at all (:func:`sampling_columns` returns None) and no pass: the engine's argmax
is its answer, as it was before the pass existed.

**Noise.** A drawing row's randomness is a counter-based hash keyed by (seed, output position):
the row keys are :func:`mix32` chains of the seed's two 32-bit halves and the position, made here
on the host; the pass hashes each key with a block or token index on the device (the same
:func:`mix32`, in torch integer ops). Nothing is carried from step to step, so the same seed
gives the same tokens whatever shares the batch, with overlap on or off, on any rank, inside a
CUDA graph. An unseeded request is seeded by its request id (as before the pass).

Nothing here imports torch: the columns are values, built where the forward's inputs are.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import MAX_TOP_LOGPROBS, SEED_LIMIT

__all__ = ["MASK32", "PassPlan", "PenaltyColumns", "SamplingColumns", "mix32", "row_keys", "sampling_columns"]

MASK32 = 0xFFFFFFFF
#: Odd multipliers below 2**31 (a lowbias32-style finaliser): a 32-bit value times one of them is
#: below 2**63, so the mix runs in int64 torch ops without relying on signed overflow.
_MUL_1, _MUL_2 = 0x21F0AAAD, 0x735A2D97
#: Salts that separate the two noise streams of a row (the block race, the token race).
BLOCK_STREAM, TOKEN_STREAM = 0x2545F491, 0x6C8E9CF5


def mix32(x):
    """A 32-bit integer hash (bijective on [0, 2**32)). Takes a Python int or an int64 tensor or
    array of values in [0, 2**32); every intermediate is below 2**63, so the same bits come out of
    Python, numpy and torch on any device."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & MASK32
    return x ^ (x >> 15)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """The (block, token) stream keys of the row that draws output token ``position`` of a
    request seeded with ``seed`` (in [0, 2**64))."""
    return split_row_keys(seed & MASK32, seed >> 32, position)


def split_row_keys(seed_low, seed_high, position):
    """:func:`row_keys` from the seed's two 32-bit halves: Python ints, or int64 arrays (one entry
    a row, the same bits)."""
    key = mix32(seed_low ^ 0x3C6EF372)
    key = mix32(key ^ seed_high)
    key = mix32(key ^ (position & MASK32))
    return mix32(key ^ BLOCK_STREAM), mix32(key ^ TOKEN_STREAM)


class PassPlan(NamedTuple):
    """What one step's pass computes. Each field is a fact about the step's rows; a decode graph
    is captured per ``(batch size, plan.bucketed())``."""

    sample: bool  # some row draws (it is not greedy)
    greedy: bool  # some row is greedy (its answer is the argmax of its processed row)
    top_k: int  # the largest top-k of a drawing row (0: none filters by top-k)
    top_p_rows: int  # drawing rows with top-p < 1
    min_p: bool  # some drawing row has min-p > 0
    logprobs: int  # the most alternatives a row asks for; -1: no row asks for logprobs
    processed: bool  # penalties, min_tokens or a grammar mask on some row
    # every top-p row has a top-k too: its nucleus lies among its top_k largest (no full sort)
    top_p_within_top_k: bool = False
    top_p_all: bool = False  # every row is a top-p row (no gather of them)

    def bucketed(self, vocab_size: int, num_rows: int) -> "PassPlan":
        """The plan a CUDA graph of ``num_rows`` rows is captured for: counts rounded up to powers
        of two (at least 16 for top-k; at most the vocabulary, the rows), logprobs to
        :data:`MAX_TOP_LOGPROBS`; a row's answer does not depend on it."""
        top_k = min(max(16, _pow2(self.top_k)), vocab_size) if self.top_k else 0
        top_p = min(_pow2(self.top_p_rows), num_rows) if self.top_p_rows else 0
        logprobs = MAX_TOP_LOGPROBS if self.logprobs > 0 else self.logprobs
        return self._replace(top_k=top_k, top_p_rows=top_p, logprobs=logprobs)


class PenaltyColumns(NamedTuple):
    """The rows with repetition, frequency or presence penalties and the ids they count.

    ``rows`` are sampling rows; every other index here is into ``rows``. The tokens a forward in
    flight is still sampling are not on the host (overlap): ``in_flight`` holds, per such row, the
    flat input slot that carries it into this forward, and the pass counts the id found there."""

    rows: np.ndarray  # (P,) int64
    values: np.ndarray  # (3, P) float64: repetition, frequency, presence
    output: tuple[np.ndarray, np.ndarray]  # (index into rows, id) per generated token known on the host
    prompt: tuple[np.ndarray, np.ndarray]  # (index into rows, id) per prompt token (repetition rows only)
    in_flight: tuple[np.ndarray, np.ndarray]  # (index into rows, flat input slot)


class SamplingColumns(NamedTuple):
    """One step's sampling parameters, one entry per sampling row in logit-row order (or, after
    :meth:`at_rows`, per flat row of a decode graph). ``errors``: rows whose settings could not be
    encoded (request id -> why); they are sampled as greedy and their requests fail alone."""

    plan: PassPlan
    floats: np.ndarray  # (3, n) float64: temperature (1 for greedy rows), top_p, min_p
    longs: np.ndarray  # (5, n) int64: greedy (0/1), top_k (0: off), block key, token key, logprobs (-1: none)
    top_p_rows: np.ndarray  # (P,) int64: the drawing rows with top-p < 1
    penalties: PenaltyColumns | None
    forbidden: tuple[np.ndarray, np.ndarray] | None  # (row, id): end ids a row may not draw yet (min_tokens)
    masks: tuple[np.ndarray, np.ndarray] | None  # (rows (G,), bitmask words (G, W) int32): a grammar's
    errors: dict[int, str]

    @property
    def num_rows(self) -> int:
        return self.floats.shape[1]

    def at_rows(self, rows: Sequence[int], size: int) -> "SamplingColumns":
        """The same columns laid out over ``size`` rows, sampling row ``i`` at ``rows[i]`` and
        greedy defaults elsewhere (a decode graph's flat rows: draft and padding rows are greedy)."""
        rows = np.asarray(rows, dtype=np.int64)
        floats = np.empty((3, size), dtype=np.float64)
        floats[:] = _FLOAT_DEFAULTS
        floats[:, rows] = self.floats
        longs = np.zeros((5, size), dtype=np.int64)
        longs[0] = 1
        longs[4] = -1
        longs[:, rows] = self.longs
        penalties = self.penalties
        if penalties is not None:
            penalties = penalties._replace(rows=rows[penalties.rows])
        forbidden = None if self.forbidden is None else (rows[self.forbidden[0]], self.forbidden[1])
        masks = None if self.masks is None else (rows[self.masks[0]], self.masks[1])
        every = self.plan.top_p_all and size == len(rows) and bool((rows == np.arange(size)).all())
        return self._replace(plan=self.plan._replace(top_p_all=every), floats=floats, longs=longs,
                             top_p_rows=rows[self.top_p_rows], penalties=penalties, forbidden=forbidden, masks=masks)


_FLOAT_DEFAULTS = np.array([[1.0], [1.0], [0.0]])  # temperature, top_p, min_p of a greedy row


def sampling_columns(
    requests: Sequence[LlmRequest],
    vocab_size: int,
    *,
    in_flight: Callable[[], Mapping[int, int]] | None = None,
    token_masks: Mapping[int, np.ndarray] | None = None,
) -> SamplingColumns | None:
    """The columns of a step whose sampling requests are ``requests`` (logit-row order); None when
    every one of them is plain greedy (``SamplingConfig.plain_greedy``, no grammar): no pass.

    ``in_flight``: gives row -> flat input slot, for rows whose newest token a forward in flight is
    still sampling (overlap); called only when some row is penalized. ``token_masks``: request id -> the grammar's
    bitmask for its next token (``sampling.guided_decoder``), for every guided request. A beam
    search's row is left greedy: the host's beam step reads its logits."""
    configs = [request.sampling_config for request in requests]
    special = [i for i, (r, c) in enumerate(zip(requests, configs))
               if (not c.plain_greedy or r.guided_grammar is not None) and r.beam_width == 1]
    if not special:
        return None
    n = len(requests)
    floats = np.empty((3, n), dtype=np.float64)
    floats[:] = _FLOAT_DEFAULTS
    longs = np.zeros((5, n), dtype=np.int64)
    longs[0] = 1
    longs[4] = -1
    errors: dict[int, str] = {}
    penalized: list[int] = []
    forbidden_rows: list[int] = []
    forbidden_ids: list[int] = []
    masked: list[int] = []
    words: list[np.ndarray] = []
    drawing: list[int] = []  # rows that draw, and what their keys and filters are made of
    draws: list[tuple] = []  # (temperature, top_p, min_p, top_k, seed low, seed high, position)
    for i in special:
        request = requests[i]
        config = configs[i]
        generated = len(request.tokens) - request.orig_prompt_len  # placeholders count: their tokens will exist
        if config.logprobs is not None:
            longs[4, i] = config.logprobs
        if config.has_penalties:
            penalized.append(i)
        if config.min_tokens and generated < config.min_tokens:
            ends = [t for t in (request.end_id, *request.stop_token_ids) if t is not None and 0 <= t < vocab_size]
            forbidden_rows += [i] * len(ends)
            forbidden_ids += ends
        if request.guided_grammar is not None:
            mask = token_masks.get(request.request_id) if token_masks else None
            if mask is None:
                errors[request.request_id] = f"request {request.request_id}: no grammar mask reached the engine"
            else:
                masked.append(i)
                words.append(mask)
        if config.is_greedy:
            continue
        seed = config.seed if config.seed is not None else request.request_id
        if not 0 <= seed < SEED_LIMIT:  # SamplingConfig refuses it: only a bug gets one here
            errors[request.request_id] = f"request {request.request_id}: OverflowError: seed {seed} is not in [0, 2**64)"
            continue
        drawing.append(i)
        draws.append((config.temperature, config.top_p, config.min_p, config.top_k if config.top_k < vocab_size else 0,
                      seed & MASK32, seed >> 32, generated))
    if drawing:  # one numpy pass over the drawing rows: a Python loop of hashes cost microseconds a row
        rows = np.asarray(drawing, dtype=np.int64)
        values = np.asarray(draws, dtype=np.float64)[:, :3]  # temperature, top_p, min_p
        ints = np.asarray([d[3:] for d in draws], dtype=np.int64)  # top_k, seed halves, position
        floats[:, rows] = values.T
        longs[0, rows] = 0
        longs[1, rows] = ints[:, 0]
        longs[2, rows], longs[3, rows] = split_row_keys(ints[:, 1], ints[:, 2], ints[:, 3])
    drawing_mask = longs[0] == 0
    top_p_rows = np.flatnonzero(drawing_mask & (floats[1] < 1.0))
    penalties = _penalty_columns(requests, penalized, vocab_size, in_flight() if in_flight else {}) if penalized else None
    forbidden = (np.asarray(forbidden_rows, dtype=np.int64), np.asarray(forbidden_ids, dtype=np.int64)) \
        if forbidden_rows else None
    masks = (np.asarray(masked, dtype=np.int64), np.stack(words).astype(np.int32, copy=False)) if masked else None
    plan = PassPlan(
        sample=bool(drawing),
        greedy=not bool(drawing_mask.all()),
        top_k=int(longs[1].max()),
        top_p_rows=len(top_p_rows),
        min_p=bool((floats[2][drawing_mask] > 0).any()),
        logprobs=int(longs[4].max()),
        processed=penalties is not None or forbidden is not None or masks is not None,
        top_p_within_top_k=bool(len(top_p_rows)) and bool((longs[1][top_p_rows] > 0).all()),
        top_p_all=len(top_p_rows) == n,
    )
    return SamplingColumns(plan, floats, longs, top_p_rows, penalties, forbidden, masks, errors)


def _penalty_columns(
    requests: Sequence[LlmRequest], rows: list[int], vocab_size: int, in_flight: Mapping[int, int]
) -> PenaltyColumns:
    """What the penalized ``rows`` count: every generated id known on the host (placeholders of
    forwards in flight are negative and left out; the pass counts their ids from the input slot),
    and, for a repetition penalty, every prompt id. Shipped whole every step: a penalized row
    costs host-to-device bytes in proportion to its sequence (8 per id)."""
    values = np.empty((3, len(rows)), dtype=np.float64)
    out_index: list[np.ndarray] = []
    out_ids: list[np.ndarray] = []
    prompt_index: list[np.ndarray] = []
    prompt_ids: list[np.ndarray] = []
    flight_index: list[int] = []
    flight_slots: list[int] = []
    for p, row in enumerate(rows):
        request = requests[row]
        config = request.sampling_config
        values[:, p] = (config.repetition_penalty, config.frequency_penalty, config.presence_penalty)
        ids = np.frombuffer(request.tokens, dtype=np.int64)  # the packed token array, not copied
        generated = ids[request.orig_prompt_len :]
        generated = generated[(generated >= 0) & (generated < vocab_size)]
        out_index.append(np.full(len(generated), p, dtype=np.int64))
        out_ids.append(generated)
        if config.repetition_penalty != 1.0:
            prompt = ids[: request.orig_prompt_len]  # repeats are harmless: the pass marks ids seen
            prompt = prompt[(prompt >= 0) & (prompt < vocab_size)]  # a copy: no view of the growing array escapes
            prompt_index.append(np.full(len(prompt), p, dtype=np.int64))
            prompt_ids.append(prompt)
        slot = in_flight.get(row)
        if slot is not None:
            flight_index.append(p)
            flight_slots.append(slot)
    return PenaltyColumns(
        np.asarray(rows, dtype=np.int64),
        values,
        (_concat(out_index), _concat(out_ids)),
        (_concat(prompt_index), _concat(prompt_ids)),
        (np.asarray(flight_index, dtype=np.int64), np.asarray(flight_slots, dtype=np.int64)),
    )


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
