"""The engine interface: ``ModelEngine`` launches a forward and returns a ``PendingForward``.

``forward_async`` builds the inputs (:func:`.inputs.prepare_tp_inputs`, which raises
``TokenBudgetExceeded`` past the budget before anything runs) and launches them. What comes
back is a :class:`PendingForward`: one of a few small classes, each one way a forward can be
in flight —

=================  ===========================================================================
ReadyForward       it has run (a host engine that runs at launch)
DeferredForward    it runs when its result is first asked for, after the forward launched
                   before it (a host engine built ``asynchronous=True``: the simulated engine,
                   so that the CPU tests run the overlap scheduler)
CudaForward        enqueued on the GPU (``model_engine``); ``result()`` waits for its picks
=================  ===========================================================================

Under the overlap scheduler a generation request can be in the next forward before its
newest token is known: its ``tokens`` end with ``IN_FLIGHT_TOKEN_ID`` (see ``llm_request``),
and the engine puts in that slot the token it picked for the request in the previous forward
(:meth:`ModelEngine.can_pick` says for which requests an engine picks the token the sampler
will return).

A speculative request in flight is laid out as if its forward accepted every draft it verifies
(one placeholder per draft slot, one for the token after them) and the next forward is built on
that. The engine, which accepts drafts as the sampler will (``accept_greedy``), then puts the
token after the accepted drafts in its first input and moves its positions back by the slots
that were not accepted (:class:`Picks`). The next forward's own drafts are slots too (the host
cannot draft from tokens it does not have): an engine given a ``draft_proposer`` fills them when
the forward is launched, from the tokens the previous forward produced, and hands the drafts it
verified back with its output (``ForwardOutput.verified_drafts``). All of it on a GPU on the
device (``torch_engine``), here on the host (``ForwardInputs.resolve``). Nothing here imports
torch: the simulated engine runs on it alone.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs, prepare_tp_inputs
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import TokenLogprob
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.speculative.proposer import DraftProposer
from tensorrt_llm._torch.speculative.verification import accept_greedy


@dataclass(slots=True)
class ForwardOutput:
    """Per request that samples: the logits row of its sampling row (its last position before any
    draft; a device tensor; None for simulated engines), and, from engines that pick on the
    device, the token picked (``greedy_tokens``, named when every pick was the argmax of that row).

    ``device_sampled``: the engine's pick is each sampling request's answer: it ran the device
    sampling pass over its rows (``engine.sampling_pass``: greedy rows' argmax, drawing rows'
    draw), or every request was plain greedy; ``logprobs`` then holds the pass's log-probabilities
    for the requests that ask, and ``sampling_errors`` the requests whose settings it could not
    encode (they fail alone). Without it, a sampler draws on the host from ``logits``.

    ``nonfinite``: from engines that check on the device, the requests whose logits row holds NaN
    or inf (None: not checked; the sampler checks the row itself). Checking a device row on the
    host would wait for the device, and with it for the next forward already queued (overlap)."""

    logits: dict[int, Any]
    num_tokens: int = 0  # positions in the forward
    greedy_tokens: dict[int, int] | None = None
    nonfinite: set[int] | None = None
    # Requests that ask for prompt log-probabilities, in a context chunk: (the chunk's first prompt
    # position, (chunk length, vocab) logits: row i predicts prompt position start + i + 1).
    prompt_logits: dict[int, tuple[int, Any]] | None = None
    # Requests that verified drafts: the greedy pick at the sampling row, then after each draft
    # (1 + drafts tokens; ``speculative.verification.accept_greedy`` reads them). None: no drafts
    # ran, or an engine without a model (its drafts are all rejected).
    draft_targets: dict[int, list[int]] | None = None
    # Beam-search requests in generation: the (beam_width, vocab) logits of their beams, beam 0
    # first (``logits`` holds beam 0's row alone). None: no beams ran, or an engine without a model.
    beam_logits: dict[int, Any] | None = None
    # Requests that verified drafts: the drafts, as the forward's inputs held them (what
    # ``accept_greedy`` compares ``draft_targets`` with: under overlap the request's own
    # ``py_draft_tokens`` are the next step's already, or slots the engine filled). None: no drafts ran.
    verified_drafts: dict[int, list[int]] | None = None
    device_sampled: bool = False
    logprobs: dict[int, TokenLogprob] | None = None
    sampling_errors: dict[int, str] | None = None


class Picks(NamedTuple):
    """What the next forward takes from a forward in flight, per request that sampled in it: the
    token the engine picked (for a request that verified drafts, the token after the drafts it
    accepts) and, per request that verified drafts, its whole run (the accepted drafts, then
    that token): the next forward drafts from it and moves back by the slots it left empty."""

    tokens: Mapping[int, int]
    runs: Mapping[int, Sequence[int]]


NO_PICKS = Picks({}, {})


def picks_of(output: ForwardOutput) -> Picks:
    """:class:`Picks` of a host forward's output: greedy verification (``accept_greedy``) of each
    request's verified drafts against its targets; without targets (an engine without a model)
    every draft is rejected and the pick is the engine's own."""
    tokens = output.greedy_tokens or {}
    drafts = output.verified_drafts
    if not drafts:
        return Picks(tokens, {})
    tokens = dict(tokens)
    runs = {}
    targets = output.draft_targets or {}
    for rid, verified in drafts.items():
        picks = targets.get(rid)
        if picks is None:
            if rid in tokens:
                runs[rid] = (tokens[rid],)
            continue
        run = accept_greedy(verified, picks)
        tokens[rid] = run[-1]
        runs[rid] = run
    return Picks(tokens, runs)


class PendingForward(Protocol):
    """A forward in flight. ``num_tokens``: its positions (set at launch)."""

    num_tokens: int

    def result(self) -> ForwardOutput:
        """Wait for the forward (only it, not what was launched after it); raises what it raised."""

    def picks(self) -> Picks:
        """What the next forward takes from this one (waits for it); :data:`NO_PICKS` if it failed."""


class ReadyForward:
    """A forward that has run."""

    __slots__ = ("_output", "num_tokens")

    def __init__(self, output: ForwardOutput) -> None:
        self._output = output
        self.num_tokens = 0

    def result(self) -> ForwardOutput:
        return self._output

    def picks(self) -> Picks:
        return picks_of(self._output)


class DeferredForward:
    """A host forward that runs when its result is first asked for, after ``previous`` (launch
    order); its error, if it raises, is raised again by every later ``result()``."""

    __slots__ = ("_compute", "_previous", "_output", "_error", "num_tokens")

    def __init__(self, compute: Callable[[], ForwardOutput], previous: PendingForward | None) -> None:
        self._compute: Callable[[], ForwardOutput] | None = compute
        self._previous = previous
        self._output: ForwardOutput | None = None
        self._error: BaseException | None = None
        self.num_tokens = 0

    def result(self) -> ForwardOutput:
        if self._error is not None:
            raise self._error
        if self._output is None:
            compute, previous, self._compute, self._previous = self._compute, self._previous, None, None
            if previous is not None:
                previous.picks()  # launch order: the previous forward runs first (its failure is its own)
            try:
                self._output = compute()
            except BaseException as error:
                self._error = error
                raise
        return self._output

    def picks(self) -> Picks:
        try:
            return picks_of(self.result())
        except Exception:
            return NO_PICKS


class ModelEngine(abc.ABC):
    """Shared input preparation and host launches; subclasses run the prepared inputs (:meth:`_run`).

    ``asynchronous``: on a host engine, :meth:`forward_async` returns before the forward has
    run; it runs when its result (or a later forward's) is first asked for, in launch order,
    over inputs taken at launch. This is how the CPU tests run the overlap scheduler against an
    engine that completes later. Only an engine without KV data may defer this way (the
    simulated one): the KV manager's host-side block copies (onboarding, partial-reuse copies)
    would otherwise run before a forward launched earlier, which a CUDA stream never allows.
    A torch engine on the CPU runs each forward at launch, in order with those copies, and
    still delivers its tokens one iteration later under overlap.
    """

    #: largest beam width / whether draft tokens can be run; checked at submission.
    max_beam_width: int = 1
    supports_draft_tokens: bool = False
    #: whether forwards carry ``greedy_tokens`` (the engine's own pick for each sampling request)
    picks_tokens: bool = False
    #: whether the engine samples every sampling row on its device (``engine.sampling_pass``):
    #: its pick is the answer of every request but a beam search (``ForwardOutput.device_sampled``)
    samples_on_device: bool = False
    #: whether the engine verifies drafts as the sampler does, so that it can pick for a
    #: speculative request in flight and move the next forward back over rejected drafts (:class:`Picks`)
    accepts_drafts: bool = False

    def __init__(
        self, max_num_tokens: int, kv_cache_manager: KVCacheManager, *, asynchronous: bool = False,
        draft_proposer: DraftProposer | None = None,
    ) -> None:
        """``draft_proposer``: what the engine fills draft slots with (the ``Drafter``'s
        ``proposer``; module docstring); None: it fills none (those steps verify no drafts)."""
        self.max_num_tokens = max_num_tokens
        self.kv_cache_manager = kv_cache_manager
        self.asynchronous = asynchronous
        self.draft_proposer = draft_proposer
        self._previous: PendingForward | None = None  # the last forward launched on the host

    @property
    def proposes_drafts(self) -> bool:
        """Whether the engine fills the draft slots of a request whose previous forward is in
        flight (the drafter gives such requests slots only then)."""
        return self.accepts_drafts and self.draft_proposer is not None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def completes_asynchronously(self) -> bool:
        """True when :meth:`forward_async` returns before the forward has run: the overlap
        scheduler then hides the host's work behind it (and is on by default)."""
        return self.asynchronous

    def can_pick(self, request: LlmRequest) -> bool:
        """Whether this engine picks, in the forward itself, the very tokens the sampler will
        return for ``request`` (so the request can be in the next forward before they reach the
        host). One beam and an engine that picks; then, on an engine that samples on its device
        (``samples_on_device``), any request without a grammar (penalties count the token in
        flight on the device; a grammar's matcher must accept it on the host before the next
        mask exists), elsewhere a plain greedy one (nothing that changes the pick or reads the
        row: ``LlmRequest.needs_host_logits``). A speculative request (``max_draft_len`` > 0, or
        drafts of its own) only where the engine also accepts drafts (``accepts_drafts``): its
        next forward is built as if every draft were accepted and the engine moves it back over
        the rejected ones (module docstring). Elsewhere every forward such a request samples in
        completes before the next iteration is scheduled."""
        if not self.picks_tokens or request.beam_width != 1:
            return False
        if not self.accepts_drafts and (request.max_draft_len or request.py_draft_tokens):
            return False
        if self.samples_on_device:
            return request.guided_grammar is None
        return request.sampling_config.is_greedy and not request.needs_host_logits

    @property
    def faults_injected(self) -> Mapping[str, int]:
        """Faults injected so far, by kind: none (``FaultInjectingEngine`` counts its own)."""
        return {}

    def forward(self, scheduled: ScheduledRequests) -> ForwardOutput:
        return self.forward_async(scheduled).result()

    def forward_async(self, scheduled: ScheduledRequests, token_masks: Mapping[int, Any] | None = None) -> PendingForward:
        """Prepare the inputs (TokenBudgetExceeded past the budget, before anything runs) and launch.
        ``token_masks``: request id -> its grammar's bitmask for the token this forward samples
        (the sampler's ``token_masks``), for every guided request that samples in it."""
        inputs = self._prepare_tp_inputs(scheduled)
        inputs.token_masks = token_masks
        pending = self._launch(inputs)
        pending.num_tokens = inputs.total_num_tokens
        return pending

    def _prepare_tp_inputs(self, scheduled: ScheduledRequests) -> ForwardInputs:
        """Flat inputs for the batch (:func:`.inputs.prepare_tp_inputs`)."""
        return prepare_tp_inputs(scheduled, self.kv_cache_manager, self.max_num_tokens)

    def _launch(self, inputs: ForwardInputs) -> PendingForward:
        """A host forward: now, or later in launch order when the engine is asynchronous. Its
        in-flight inputs take the previous forward's picks."""
        previous = self._previous
        run = self._host_forward(inputs)

        def complete() -> ForwardOutput:
            if inputs.in_flight or inputs.engine_drafts:
                tokens, runs = previous.picks() if previous is not None and inputs.in_flight else NO_PICKS
                inputs.resolve(tokens, runs, self._propose_on_host if self.draft_proposer is not None else None)
            output = run()
            output.num_tokens = inputs.total_num_tokens
            return output

        pending: PendingForward = DeferredForward(complete, previous) if self.asynchronous else ReadyForward(complete())
        self._previous = pending
        return pending

    def _propose_on_host(self, histories: list[Sequence[int]], rooms: list[int]) -> list[list[int]]:
        """The drafts of steps built in flight, from their requests' tokens (``ForwardInputs.resolve``):
        the proposer's host form, one sequence at a time."""
        proposer = self.draft_proposer
        return [proposer.propose(np.asarray(history, dtype=np.int64), room) for history, room in zip(histories, rooms)]

    def _host_forward(self, inputs: ForwardInputs) -> Callable[[], ForwardOutput]:
        """Take what running ``inputs`` later needs now (state moves on after launch)."""
        if self.asynchronous:
            inputs.materialize()
        return lambda: self._run(inputs)

    @abc.abstractmethod
    def _run(self, inputs: ForwardInputs) -> ForwardOutput: ...
