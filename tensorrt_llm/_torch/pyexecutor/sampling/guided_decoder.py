"""Structured output: a grammar matcher per request, whose token bitmask constrains sampling.

The grammar library is ``llguidance`` (a 3 MB wheel with no dependencies). Upstream
TRT-LLM uses ``xgrammar``, whose wheel also pulls ``transformers`` and ``triton`` (about
200 MB beside the pinned torch).

Life of a guided request::

    GuidedDecodingParams --compile (at submission; a bad schema is refused there)--> Grammar
    Grammar.matcher() --> GrammarMatcher (one per sample; the sampler owns it)
        each step:  bitmask()      -- at launch: the ids the grammar allows next, 32 a word
                    the engine's sampling pass sets every other id's logit to -inf and draws
                    accept(token)  -- when the token is back: the matcher advances (a token it
                                      refuses fails the request)

The vocabulary the matcher reasons about is the project's own tokenizer's: each id's bytes
(byte-level BPE tokens decoded to raw bytes, control tokens marked special), handed to
``llguidance`` through :class:`_TokenizerBytes`. When the grammar is complete the mask allows
only the end-of-generation ids, so a guided request ends by EOS (or by ``max_tokens``: output
cut by length is a prefix of a valid document, as with every engine).

The mask is applied on the engine's device: at launch the sampler computes each guided row's
bitmask (:meth:`GrammarMatcher.bitmask`, ``TorchSampler.token_masks``) and the engine's sampling
pass sets the forbidden ids of that row to -inf before drawing (``engine.sampling_pass``); when
the token comes back the sampler's matcher accepts it.

Overlap scheduling: the mask of step n+1 depends on the token of step n, which the matcher must
accept on the host first, so a guided request is never given an in-flight placeholder
(``ModelEngine.can_pick`` is False for it). The forward that samples it completes, its token
reaches the matcher, and only then is the next iteration scheduled and its mask made: a guided
request makes the iteration wait for its token and its mask (about 0.5 ms a token on the CPU,
next to tens of ms of forward; see ``benchmarks.serving.structured_output``). Computing the mask
of step n+1 while forward n+1 runs would need the token of step n first, i.e. the same wait, so
nothing would be hidden. Other requests of the same batch are sampled in the same pass.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: JSON compiled without free whitespace: a model left to choose whitespace inside a JSON
#: document can emit newlines until ``max_tokens`` (vLLM and SGLang default the same way).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Compiled grammars a compiler keeps (least recently used dropped first).
CACHED_GRAMMARS = 128
#: ``response_format: json_object``: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class GuidedDecodingParams:
    """Upstream's guided-decoding settings; exactly one may be set.

    * ``json``: a JSON schema (a dict, or its text); the output is a document that validates.
    * ``json_object``: any JSON object (OpenAI's ``response_format: {type: json_object}``).
    * ``regex``: the output matches the regular expression (whole output).
    * ``grammar``: a Lark grammar (llguidance's dialect; ``start`` is the start rule).

    ``structural_tag`` (upstream's tool-call tags) is not supported and has no field here.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"guided_decoding needs exactly one of json, json_object, regex, grammar; got {given or 'none'}")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(n for n in ("json", "regex", "grammar") if getattr(self, n) is not None)


class _TokenizerBytes:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: every id's bytes, the special ids,
    and an encoder (llguidance re-tokenizes forced text with it). Wrapped in llguidance's
    ``TokenizerWrapper``, the type its constructor insists on.

    ``tokens`` has one entry per model id (``vocab_size``): the ids past the tokenizer's (a padded
    vocabulary) have no bytes, so no grammar ever allows them; llguidance sizes its vocabulary,
    and the mask it writes, by this list, whatever ``n_vocab`` says."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        tokens = tokenizer.token_bytes()
        self.tokens: list[bytes] = tokens + [b""] * (vocab_size - len(tokens))
        self.special_token_ids: list[int] = tokenizer.special_token_ids()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):  # llguidance probes with bytes; text that is not UTF-8 has no encoding here
            raise TypeError("encode takes str")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles :class:`GuidedDecodingParams` for one tokenizer (built once per LLM: reading the
    vocabulary into ``llguidance`` takes a fraction of a second).

    ``vocab_size`` is the model's (its logits rows), which may exceed the tokenizer's: ids past
    the tokenizer are never allowed. ``end_ids``: the ids that end a generation, the only ones
    allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, *, vocab_size: int, end_ids: tuple[int, ...]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_TokenizerBytes(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=list(end_ids) or None
        )
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()

    def compile(self, params: GuidedDecodingParams) -> "Grammar":
        """Raises InvalidRequestError naming what is wrong (a schema or regex the library refuses).
        The last :data:`CACHED_GRAMMARS` grammars are kept: services send the same schema again and
        again, and the server compiles on a worker thread first so that the event loop finds it here."""
        key = (params.kind, json.dumps(params.json, sort_keys=True) if params.kind == "json" else
               params.regex or params.grammar)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: GuidedDecodingParams) -> "Grammar":
        llg = self._llg.LLMatcher
        try:
            if params.kind == "json":
                schema = json.loads(params.json) if isinstance(params.json, str) else params.json
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is a JSON object")
                source = llg.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            elif params.kind == "json_object":
                source = llg.grammar_from_json_schema(ANY_JSON_OBJECT, overrides=JSON_OPTIONS)
            elif params.kind == "regex":
                source = llg.grammar_from_regex(params.regex)
            else:
                source = llg.grammar_from_lark(params.grammar)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"guided_decoding.{params.kind}: {error}") from None
        failed, messages = llg.validate_grammar_with_warnings(source, self._tokenizer)
        if failed:
            raise InvalidRequestError(f"guided_decoding.{params.kind}: {messages[0]}")
        return Grammar(self, source, params.kind)

    def _matcher(self, source: str):
        return self._llg.LLMatcher(self._tokenizer, source, log_level=0)


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar; :meth:`matcher` starts a fresh matcher (one per sample)."""

    compiler: GrammarCompiler
    source: str
    kind: str

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.compiler._matcher(self.source), self.compiler.vocab_size)


class GrammarError(ValueError):
    """The matcher cannot go on (a token it refuses, or no token allowed)."""


class GrammarMatcher:
    """One sample's position in its grammar. Not thread-safe: the sampler alone calls it, on the
    executor thread, once per accepted token."""

    __slots__ = ("_matcher", "_bitmask", "_bits", "vocab_size")

    def __init__(self, matcher, vocab_size: int) -> None:
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self._matcher = matcher
        self.vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        self._bitmask = torch.empty(words, dtype=torch.int32)  # reused every step
        self._bits = _bit_positions()

    def bitmask(self) -> np.ndarray:
        """``(ceil(vocab / 32),)`` int32, a new array: bit ``i`` of word ``w`` allows id ``32 w + i``
        next (what the engine's sampling pass masks a row with, on its device)."""
        return self._compute_mask().numpy().copy()

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the ids the grammar allows next."""
        mask = self._compute_mask()
        # (words, 1) & (32,) -> (words, 32) -> (words * 32,): bit i of word w is id 32 * w + i
        return ((mask.unsqueeze(1) & self._bits) != 0).reshape(-1)[: self.vocab_size]

    def _compute_mask(self) -> torch.Tensor:
        """The next token's bitmask, into the matcher's reused buffer."""
        mask = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        return mask

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Set every forbidden id's logit to -inf, in place (``logits``: (vocab,), on the CPU)."""
        allowed = self.allowed()
        if not bool(allowed.any()):
            raise GrammarError("the grammar allows no token here")
        logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar does not accept token {token}: {self._matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_accepting()


@functools.lru_cache(maxsize=1)
def _bit_positions() -> torch.Tensor:
    """(32,) int32: 1 << i (bit 31 is the sign bit: -2**31)."""
    return torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)], dtype=torch.int32)
