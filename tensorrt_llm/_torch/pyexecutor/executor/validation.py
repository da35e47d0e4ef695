"""Submission-time checks: a request the executor could never serve fails alone, with a reason.

Bookkeeping, like the scheduler and the KV manager: it imports no engine module. What it needs
of the engine (three numbers) it is handed, through :class:`EngineLimits`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
    from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager


class EngineLimits(Protocol):
    """What a request asks of the engine that would serve it (``ModelEngine`` answers these)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_beam_width(self) -> int: ...

    @property
    def supports_draft_tokens(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_seq_len: int
    max_num_tokens: int
    enable_chunked_prefill: bool
    vocab_size: int
    max_beam_width: int
    supports_draft_tokens: bool
    num_kv_blocks: int
    chunk_unit_size: int = 1  # smallest context chunk that is not a prompt's last one

    @classmethod
    def of(cls, config: "ExecutorConfig", kv_cache_manager: "KVCacheManager", engine: EngineLimits) -> "RequestLimits":
        """The limits an executor with this config, KV manager and engine enforces at submission."""
        return cls(
            max_seq_len=config.max_seq_len,
            max_num_tokens=config.max_num_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            vocab_size=engine.vocab_size,
            max_beam_width=engine.max_beam_width,
            supports_draft_tokens=engine.supports_draft_tokens,
            num_kv_blocks=kv_cache_manager.num_blocks,
            chunk_unit_size=config.chunk_unit_size,
        )


def first_bad_token(tokens: array, vocab_size: int) -> int | None:
    """The first id of a packed token array (``LlmRequest.tokens``) outside ``[0, vocab_size)``,
    or None: two numpy reductions over the buffer, then a search only to name the offender."""
    ids = np.frombuffer(tokens, dtype=np.int64)
    if not ids.size or (ids.min() >= 0 and ids.max() < vocab_size):
        return None
    return int(ids[np.argmax((ids < 0) | (ids >= vocab_size))])


def validate_request(request: LlmRequest, limits: RequestLimits, kv_cache_manager: "KVCacheManager") -> None:
    """Raise InvalidRequestError naming the problem, if ``request`` could never be served."""
    rid = request.request_id
    prompt_len = request.prompt_len
    if prompt_len == 0:
        raise InvalidRequestError(f"request {rid}: the prompt is empty")
    if request.max_new_tokens < 1:
        raise InvalidRequestError(f"request {rid}: max_tokens must be >= 1, got {request.max_new_tokens}")
    bad = first_bad_token(request.tokens, limits.vocab_size)
    if bad is not None:
        raise InvalidRequestError(f"request {rid}: token id {bad!r} is outside the vocabulary [0, {limits.vocab_size})")
    if prompt_len > limits.max_seq_len:
        raise InvalidRequestError(f"request {rid}: prompt length {prompt_len} exceeds max_seq_len {limits.max_seq_len}")
    if prompt_len + request.max_new_tokens > limits.max_seq_len:
        raise InvalidRequestError(
            f"request {rid}: prompt length {prompt_len} + max_tokens {request.max_new_tokens}"
            f" exceeds max_seq_len {limits.max_seq_len}"
        )
    drafts = max(request.max_draft_len, request.num_draft_tokens)
    if not limits.enable_chunked_prefill and prompt_len + drafts > limits.max_num_tokens:
        raise InvalidRequestError(
            f"request {rid}: prompt length {prompt_len} exceeds max_num_tokens {limits.max_num_tokens}"
            " and chunked prefill is off"
        )
    # With chunked prefill a last chunk carries the drafts and may be a whole unit (nothing
    # smaller may precede it), so it needs up to a unit + drafts positions at once; a request
    # paused and restarted recomputes up to max_total_len - 1 tokens of context.
    longest_chunk = min(request.max_total_len - 1, limits.chunk_unit_size)
    if limits.enable_chunked_prefill and longest_chunk + request.num_draft_tokens > limits.max_num_tokens:
        raise InvalidRequestError(
            f"request {rid}: a context chunk of {longest_chunk} tokens with its {request.num_draft_tokens}"
            f" draft tokens exceeds max_num_tokens {limits.max_num_tokens}"
        )
    if not 1 <= request.beam_width <= limits.max_beam_width:
        raise InvalidRequestError(
            f"request {rid}: beam width {request.beam_width} is not implemented by this engine"
            f" (supported: 1..{limits.max_beam_width})"
        )
    if request.beam_width > 1:
        check_beam_search(request)
    if drafts and not limits.supports_draft_tokens:
        raise InvalidRequestError(f"request {rid}: draft tokens (speculative decoding) are not supported by this engine")
    if max(request.beam_width, 1 + drafts) > limits.max_num_tokens:
        raise InvalidRequestError(f"request {rid}: one generation step needs more than max_num_tokens positions")
    blocks_needed = kv_cache_manager.blocks_needed(request)
    if blocks_needed > limits.num_kv_blocks:
        raise InvalidRequestError(
            f"request {rid}: needs {blocks_needed} KV blocks at completion, the pool has {limits.num_kv_blocks}"
        )


def check_beam_search(request: LlmRequest) -> None:
    """Raise InvalidRequestError naming what a beam-search request asks for that beam search
    cannot honour: it scores the model's own log-probabilities, one token per beam per step."""
    rid, config = request.request_id, request.sampling_config
    if request.max_draft_len or request.py_draft_tokens:
        # upstream refuses the combination too: a beam proposes no drafts, and a step is one token per beam
        raise InvalidRequestError(f"request {rid}: beam search with draft tokens (speculative decoding) is not supported")
    if not config.is_greedy or config.top_p < 1.0 or config.top_k > 1 or config.min_p > 0.0:
        raise InvalidRequestError(
            f"request {rid}: beam search ranks beams by the model's log-probabilities; temperature, top_k, top_p and min_p"
            " do not apply (leave them at their defaults)"
        )
    unsupported = [name for name, on in (
        ("guided decoding", request.guided_grammar is not None),
        ("logprobs", config.logprobs is not None),
        ("penalties", config.has_penalties),
        ("min_tokens", config.min_tokens > 0),
    ) if on]
    if unsupported:
        raise InvalidRequestError(f"request {rid}: beam search does not support {', '.join(unsupported)}")
    returned = config.num_return_sequences
    if returned is not None and returned > request.beam_width:
        raise InvalidRequestError(
            f"request {rid}: num_return_sequences {returned} exceeds the beam width {request.beam_width}"
        )
