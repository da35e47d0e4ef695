"""``LlmRequest``: one request's tokens, lifecycle state and context progress.

Context progress is two numbers::

    prompt:  [0 .... prepopulated_prompt_len .... context_current_position ........ prompt_len)
              reused from the cache             computed by earlier chunks    not yet computed

A request does not hold its next chunk: how many prompt tokens one forward computes is a
decision of that iteration, carried by the batch (:class:`ContextChunk` in
``scheduled_requests``) from the scheduler through ``prepare_resources`` to the forward.

Ownership: every mutable field has one writer; everyone else only reads it.

=================================================  ==========================================
field                                              written by
=================================================  ==========================================
``state``, ``tokens``, ``prompt_len``,             the executor (``PyExecutor`` and its
                                                   ``iteration`` modules): sampling, completion,
                                                   the in-flight placeholder (overlap),
``is_first_draft``, ``error``, ``is_cancelled``,   errors, cancellation, ``pause()`` (a
``first_token_time``, ``finish_time``              MAX_UTILIZATION preemption),
                                                   ``retry_after_failed_forward()``
``context_current_position``,                      the executor, after a forward: the chunk
``prepopulated_prompt_len``                        that ran, with the reuse its allocation found
``py_budget_deferred``                             the executor, from what ``prepare_resources``
                                                   returned (:meth:`record_budget_deferral`,
                                                   :meth:`record_forward`)
``counters`` (a :class:`RequestCounters`:          the executor, only through the request's
deferrals, pauses, preemptions, forward            methods that count: the two above,
retries, and the marks they are counted from)      :meth:`record_capacity_deferral`, :meth:`pause`,
                                                   :meth:`preempt` (the scheduler's decision),
                                                   :meth:`record_resumption` (what the
                                                   resumption's allocation reused),
                                                   :meth:`retry_after_failed_forward`
``arrival_time``                                   the submitter, or the executor when it is 0
``py_draft_tokens``                                the executor's ``Drafter`` before each schedule
                                                   (speculative decoding), else the submitter
``max_draft_len``, ``is_first_draft``              the submitter, or the ``Drafter`` at admission
                                                   (the executor clears ``is_first_draft`` when
                                                   that step runs, the ``Drafter`` when an
                                                   iteration gets no drafts)
``priority``                                       the submitter (``[0, 1]``, default 0.5)
``py_logprobs``, ``py_prompt_logprobs``            the sampler (one entry per token it samples,
                                                   per prompt position it is given logits for)
``py_beams``                                       the executor, from the sampler's ``BeamStep``
                                                   (beam search; ``tokens`` then ends with beam 0's)
=================================================  ==========================================

The scheduler, the token-budget policy and the KV manager read requests and return
decisions; none of them writes a request field.

Overlap scheduling (``PyExecutor`` with ``disable_overlap_scheduler=False``): when a forward
that samples a request's next token is launched, the executor appends
:data:`IN_FLIGHT_TOKEN_ID` to ``tokens`` in that token's place, so that everyone who reads a
sequence length (the scheduler, the KV manager, ``_prepare_tp_inputs``) charges the request
its next position before the token is known; the engine feeds the token it picked into the
next forward, and the executor writes the token over the placeholder when the forward
completes. At most two placeholders trail a sequence (one per forward in flight); none is
ever sent in a response.
"""

from __future__ import annotations

import enum
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

# A request is a value: it imports value modules only, never an engine, sampler or grammar module.
from tensorrt_llm._torch.pyexecutor.beam_state import BeamConfig, BeamState
from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.sampling_config import (  # re-exported: their home before sampling_config
    GREEDY_BELOW_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    SEED_LIMIT,
    CompiledGrammar,
    SamplingConfig,
    TokenLogprob,
)

# In ``tokens``: a token a forward in flight is sampling (overlap). In ``py_draft_tokens``: a draft
# slot the engine fills when the forward is launched, from the tokens the forward before it produced.
IN_FLIGHT_TOKEN_ID = -1

# ``LlmRequest.tokens``: packed signed 64-bit ids. A prompt of tens of thousands of tokens is
# then one buffer, not a list of int objects: it is copied, range-checked and cut into the KV
# cache's block keys by numpy in one pass each, and freed in one piece. Signed, so that the
# in-flight placeholder fits and a negative id reaches validation, which names it.
TOKEN_TYPECODE = "q"


def token_array(token_ids: Iterable[int]) -> array:
    """``token_ids`` as a new packed token array (:data:`TOKEN_TYPECODE`).

    Takes a list or tuple of ints, another token array (copied with one memcpy) or an integer
    numpy array. Raises :class:`InvalidRequestError` naming the first id that is not an
    integer of at most 64 bits: no vocabulary holds it, and no token array can.
    """
    if isinstance(token_ids, array) and token_ids.typecode == TOKEN_TYPECODE:
        return token_ids[:]
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu" or token_ids.ndim != 1:
            raise InvalidRequestError(f"token ids must be a 1-D integer array, got {token_ids.dtype} of shape {token_ids.shape}")
        if token_ids.dtype == np.uint64 and token_ids.size and int(token_ids.max()) >= 1 << 63:
            raise InvalidRequestError(f"token id {int(token_ids.max())} is outside every vocabulary")
        return array(TOKEN_TYPECODE, token_ids.astype(np.int64, copy=False).tobytes())
    try:
        return array(TOKEN_TYPECODE, token_ids)
    except (TypeError, OverflowError) as error:
        bad = next((t for t in token_ids if not _is_int64(t)), None) if hasattr(token_ids, "__len__") else None
        what = f"token id {bad!r} is not an integer of at most 64 bits" if bad is not None else str(error)
        raise InvalidRequestError(f"token ids must be integers: {what}") from None


def check_priority(value: object, name: str = "priority") -> float:
    """``value`` as a priority (a number in [0, 1]); InvalidRequestError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not 0 <= value <= 1:
        raise InvalidRequestError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _is_int64(value: object) -> bool:
    try:
        array(TOKEN_TYPECODE, (value,))
    except (TypeError, OverflowError):
        return False
    return True


def num_in_flight_tokens(tokens: array) -> int:
    """Trailing placeholders of tokens still being sampled by forwards in flight."""
    count = 0
    for token in reversed(tokens):
        if token != IN_FLIGHT_TOKEN_ID:
            break
        count += 1
    return count


class LlmRequestState(enum.Enum):
    """Lifecycle of a request. ``ERROR`` is terminal like ``GENERATION_COMPLETE``."""

    CONTEXT_INIT = enum.auto()
    GENERATION_IN_PROGRESS = enum.auto()
    GENERATION_TO_COMPLETE = enum.auto()
    GENERATION_COMPLETE = enum.auto()
    ERROR = enum.auto()


class DeferReason(enum.Enum):
    """Why a scheduled request left an iteration's batch before its forward."""

    BUDGET = "budget"  # the remaining_budget re-check could not fit its full forward cost
    CAPACITY = "capacity"  # its KV blocks could not be had at allocation time


@dataclass(slots=True)
class RequestCounters:
    """What happened to one request, counted: deferrals, pauses, priority preemptions, forward
    retries, and the marks they are counted from. One value per request (``LlmRequest.counters``),
    written only through the request's counting methods; the replay and the tests read it, and
    the preemption cooldown reads ``resumed_iteration``.
    """

    # Budget deferrals: in all, in a row now (the re-check never makes it 2), the most in a row.
    budget_deferrals: int = 0
    consecutive_budget_deferrals: int = 0
    max_consecutive_budget_deferrals: int = 0
    capacity_deferrals: int = 0  # its KV blocks could not be had at allocation time
    pauses: int = 0  # restarts as context to free KV memory (MAX_UTILIZATION), preemptions included
    # Priority preemption (SchedulerConfig.enable_preemption): times it was paused for a request of
    # higher priority; prompt positions it computed again after one, and those it got back from
    # the host tier. Marks: the KV positions it had computed when last paused (0 once it resumed),
    # whether it waits for its blocks again, the iteration they were allocated again after the
    # last one (-1: never preempted).
    preemptions: int = 0
    recomputed_tokens: int = 0
    onboarded_tokens: int = 0
    preempted_computed_tokens: int = 0
    awaiting_resumption: bool = False
    resumed_iteration: int = -1
    # Forwards that failed under it and were retried; those since it last generated a token, and
    # its length then (mark): a forward that keeps failing under it (a poison request, a broken
    # device) is not retried forever.
    forward_retries: int = 0
    retries_without_progress: int = 0
    retried_at_len: int = 0


_request_ids = itertools.count()


@dataclass(eq=False, slots=True)
class LlmRequest:
    """One request as the executor sees it.

    ``tokens`` holds the prompt followed by generated tokens. ``prompt_len`` is the
    part that is processed as context; it grows only when a paused request is
    restarted (its generated tokens become context to recompute).
    """

    input_token_ids: Iterable[int]  # the submitter's prompt; ``tokens`` starts as a packed copy
    max_new_tokens: int
    request_id: int = field(default_factory=lambda: next(_request_ids))
    beam_width: int = 1
    end_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    # Speculative decoding: drafts proposed for the next step (IN_FLIGHT_TOKEN_ID slots: the engine
    # proposes them at launch); a first-draft request (the first generation step of a speculative
    # request) always runs 1 + max_draft_len positions.
    py_draft_tokens: list[int] = field(default_factory=list)
    max_draft_len: int = 0
    is_first_draft: bool = False
    arrival_time: float = 0.0
    # Upstream's priority in [0, 1] (0.5 default): who waits under waiting_queue_policy="priority".
    priority: float = 0.5
    # Structured output: the compiled grammar its tokens must follow (the submitter compiles it;
    # the sampler starts and keeps the matcher: see CompiledGrammar).
    guided_grammar: CompiledGrammar | None = None

    # Mutable bookkeeping (not constructor arguments in practice).
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    tokens: array = field(init=False)  # packed (TOKEN_TYPECODE): prompt, then generated tokens
    prompt_len: int = field(init=False)
    orig_prompt_len: int = field(init=False)
    context_current_position: int = 0
    prepopulated_prompt_len: int = 0
    # Budget deferral: a deferred request owes its full cost. The scheduler charges it that
    # and the re-check takes it first, so it is never deferred twice in a row.
    py_budget_deferred: bool = False
    counters: RequestCounters = field(default_factory=RequestCounters)
    error: str | None = None
    is_cancelled: bool = False
    first_token_time: float | None = None
    finish_time: float | None = None
    # One per generated token when ``sampling_config.logprobs`` is set, in order (the sampler's).
    py_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With ``sampling_config.prompt_logprobs``: one per prompt position, None for the first (the sampler's).
    py_prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Beam search (beam_width > 1): the beams after the last step (None before the first one).
    py_beams: BeamState | None = None

    def __post_init__(self) -> None:
        self.priority = check_priority(self.priority, f"request {self.request_id}: priority")
        try:
            self.tokens = token_array(self.input_token_ids)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"request {self.request_id}: {error}") from None
        self.prompt_len = len(self.tokens)
        self.orig_prompt_len = self.prompt_len

    # ---- context progress -----------------------------------------------------------
    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def is_first_context_chunk(self) -> bool:
        """No chunk has been computed yet (reused KV does not count as computed)."""
        return self.context_current_position == self.prepopulated_prompt_len

    def reuse_prefix(self, length: int) -> None:
        """The first ``length`` prompt tokens come from the KV cache (a first chunk's claim):
        they count as computed, and the next chunk starts after them."""
        if self.context_current_position or not 0 <= length < self.prompt_len:
            raise ValueError(f"request {self.request_id}: cannot reuse a prefix of {length} tokens ({self!r})")
        self.prepopulated_prompt_len = self.context_current_position = length

    def complete_context_chunk(self, end: int) -> None:
        """The chunk of the prompt up to position ``end`` was computed."""
        if not self.context_current_position <= end <= self.prompt_len:
            raise ValueError(
                f"request {self.request_id}: a chunk cannot end at {end}"
                f" (position {self.context_current_position}, prompt {self.prompt_len})"
            )
        self.context_current_position = end

    # ---- deferrals (the executor records what prepare_resources returned) -------------
    def record_budget_deferral(self) -> None:
        self.py_budget_deferred = True
        counters = self.counters
        counters.budget_deferrals += 1
        counters.consecutive_budget_deferrals += 1
        if counters.consecutive_budget_deferrals > counters.max_consecutive_budget_deferrals:
            counters.max_consecutive_budget_deferrals = counters.consecutive_budget_deferrals

    def record_capacity_deferral(self) -> None:
        self.counters.capacity_deferrals += 1

    def record_forward(self) -> None:
        """It ran in a forward: a budget deferral it owed is paid."""
        self.py_budget_deferred = False
        self.counters.consecutive_budget_deferrals = 0

    # ---- state ----------------------------------------------------------------------
    @property
    def is_context_init_state(self) -> bool:
        return self.state is LlmRequestState.CONTEXT_INIT

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state in (LlmRequestState.GENERATION_IN_PROGRESS, LlmRequestState.GENERATION_TO_COMPLETE)

    @property
    def is_finished(self) -> bool:
        return self.state in (LlmRequestState.GENERATION_COMPLETE, LlmRequestState.ERROR)

    @property
    def needs_host_logits(self) -> bool:
        """Whether its token is more than the argmax of its raw logits row: something changes the
        pick (penalties, ``min_tokens``, a grammar's mask) or reads the row (logprobs). The name is
        from when such rows went to the host; the engine's device sampling pass serves them now,
        but a pick that verifies drafts (the argmax at each draft row) still cannot, nor can an
        engine that does not sample on its device (``ModelEngine.can_pick``)."""
        config = self.sampling_config
        return (self.guided_grammar is not None or config.logprobs is not None or config.min_tokens > 0
                or config.has_penalties)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.py_draft_tokens)

    @property
    def beam_config(self) -> BeamConfig:
        """What its beam search asks for (``beam_width`` > 1), from its sampling config."""
        config = self.sampling_config
        returned = config.num_return_sequences if config.num_return_sequences is not None else self.beam_width
        return BeamConfig(self.beam_width, config.length_penalty, config.early_stopping, returned)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.orig_prompt_len :].tolist()

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens) - self.orig_prompt_len

    @property
    def max_total_len(self) -> int:
        """Length the sequence reaches if it generates every allowed token."""
        return self.orig_prompt_len + self.max_new_tokens

    def add_new_token(self, token: int) -> None:
        self.tokens.append(token)

    def set_error(self, message: str) -> None:
        self.error = message
        self.state = LlmRequestState.ERROR

    def pause(self) -> None:
        """Give up the KV and start over as context (MAX_UTILIZATION preemption).

        Generated tokens are kept and become part of the context to recompute, so
        the output continues where it stopped.
        """
        self._start_over()
        self.counters.pauses += 1

    def preempt(self) -> None:
        """Paused for a request of higher priority (the scheduler's preemption): as :meth:`pause`,
        remembering how many positions had KV, so that the resumption can count what it recomputes."""
        computed = self.context_current_position if self.is_context_init_state else len(self.tokens) - 1
        self.pause()
        counters = self.counters
        counters.preemptions += 1
        counters.preempted_computed_tokens = computed
        counters.awaiting_resumption = True

    def record_resumption(self, iteration: int, reused_tokens: int, onboarded_tokens: int) -> None:
        """Its first chunk after a preemption was allocated at ``iteration``, reusing
        ``reused_tokens`` prompt positions (``onboarded_tokens`` of them from the host tier)."""
        counters = self.counters
        counters.resumed_iteration = iteration
        counters.recomputed_tokens += max(0, counters.preempted_computed_tokens - reused_tokens)
        counters.onboarded_tokens += onboarded_tokens
        counters.preempted_computed_tokens = 0
        counters.awaiting_resumption = False

    def can_retry_forward(self, max_retries: int) -> bool:
        """Whether a failed forward may retry this request: fewer than ``max_retries`` retries
        since it last generated a token (failures far apart are independent; failures in a row
        are not)."""
        if max_retries < 1:
            return False
        progressed = len(self.tokens) - num_in_flight_tokens(self.tokens) > self.counters.retried_at_len
        return progressed or self.counters.retries_without_progress < max_retries

    def retry_after_failed_forward(self) -> None:
        """Start over as context, as :meth:`pause` does, after a forward it was in failed:
        the KV that forward should have written cannot be trusted, so it is recomputed. Call it
        once the failed forward's placeholders are dropped."""
        counters = self.counters
        if len(self.tokens) > counters.retried_at_len:
            counters.retries_without_progress = 0
        self._start_over()
        counters.forward_retries += 1
        counters.retries_without_progress += 1
        counters.retried_at_len = len(self.tokens)

    def _start_over(self) -> None:
        if self.beam_width > 1 and self.py_beams is not None:
            # A beam search starts again from its prompt: its tokens are beam 0's so far, not a
            # sequence to continue, and recomputing every beam's KV is a fresh search anyway.
            # Deterministic, and nothing was sent yet (beams answer once, at the end).
            del self.tokens[self.orig_prompt_len :]
            self.py_beams = None
        self.state = LlmRequestState.CONTEXT_INIT
        self.prompt_len = len(self.tokens)
        self.context_current_position = 0
        self.prepopulated_prompt_len = 0

    def __repr__(self) -> str:  # short: property-test counter-examples print lists of these
        if self.is_context_init_state:
            drafts = f" drafts={self.num_draft_tokens}" if self.py_draft_tokens else ""
            return f"Ctx(id={self.request_id} prompt={self.prompt_len} pos={self.context_current_position}{drafts})"
        extra = f" beam={self.beam_width}" if self.beam_width > 1 else ""
        if self.is_first_draft:
            extra += f" first_draft(max_draft_len={self.max_draft_len})"
        elif self.py_draft_tokens:
            extra += f" drafts={self.num_draft_tokens}"
        return f"Gen(id={self.request_id} len={len(self.tokens)}{extra} state={self.state.name})"
