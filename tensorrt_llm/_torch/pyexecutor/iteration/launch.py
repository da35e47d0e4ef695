"""What a launch writes on its requests, and the forward it leaves in flight.

::

    prepare_resources ─► PreparedBatch ─► record_prepared: who was deferred, the prefix each
                                          new allocation reused, a preempted request's resumption
    budget_bound(batch, active)           whether the budget, not the traffic, limited the iteration
    forward_async ─► PendingForward ─► advance: every request moves past the positions the forward
                                       computes; under overlap a request whose token the engine
                                       picks gets placeholders ─► InFlight (completion takes it)
    drop_in_flight_tokens                 a request that ends or starts over keeps no placeholder

**Overlap** (upstream's overlap scheduler): the forward launched by step n+1 is built while
forward n still runs, and forward n is completed only after n+1 is launched. A request that
samples in forward n gets a placeholder (``IN_FLIGHT_TOKEN_ID``) in its ``tokens`` at launch,
so the scheduler, the re-check and the KV manager charge it its *next* position, as upstream
charges a generation request in flight, and the engine feeds its own pick into n+1; completing
n writes the sampled token over the placeholder (``completion``). Upstream's rules for what
n+1 cannot know:

* a request that finishes at n by EOS or a stop token was also scheduled into n+1: the
  token n+1 computes for it is dropped (never sent), and its KV blocks are freed only when n+1
  completes (the device still writes them); a request whose placeholder is its last token by
  ``max_new_tokens`` is known to finish and is not scheduled again;
* a request whose next token the engine cannot pick (sampling other than greedy, beams:
  ``ModelEngine.can_pick``) gets no placeholder, and the forward it samples in is completed
  before the next iteration is scheduled (that iteration runs without overlap);
* a speculative request stays under overlap where the engine accepts drafts itself: forward n
  verifying ``k`` draft slots leaves ``k + 1`` placeholders (as if it accepted them all), n+1 is
  built on them with draft slots of its own that the engine fills at launch from the tokens n
  produced (the drafter never drafts from unverified drafts); the engine moves n+1 back over the
  slots n did not accept (positions on the device, the KV written there is overwritten later), and
  completing n replaces the placeholders with the run it accepted, which pulls n+1's placeholders
  back the same way; blocks that held only rejected positions go back to the pool at the commit;
* a capacity pause (``MAX_UTILIZATION``) of a request in flight waits for its forward: the
  iteration completes it first and schedules again;
* a request cancelled or failed while in flight keeps its blocks until its forward completes;
  its output from that forward is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Sequence

from tensorrt_llm._torch.pyexecutor.iteration.records import Launch
from tensorrt_llm._torch.pyexecutor.llm_request import (
    IN_FLIGHT_TOKEN_ID,
    DeferReason,
    LlmRequest,
    LlmRequestState,
    num_in_flight_tokens,
    token_array,
)
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.engine.interface import PendingForward
    from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_GENERATING = LlmRequestState.GENERATION_IN_PROGRESS
_request_id = attrgetter("request_id")
_IN_FLIGHT = token_array([IN_FLIGHT_TOKEN_ID])  # times a width: a speculative request's placeholders


@dataclass(slots=True)
class InFlight:
    """A launched forward whose tokens have not reached its requests yet."""

    pending: PendingForward
    batch: ScheduledRequests  # the batch that runs
    sampling: list[LlmRequest]  # the requests that sample in it, in batch order
    # each one's placeholders in its tokens (1, or 1 + the drafts it verifies), or None: appended at completion
    slots: list[int | None]
    launch: Launch  # what the iteration decided and measured up to its launch
    _request_ids: frozenset[int] | None = field(default=None, init=False, repr=False)

    @property
    def overlappable(self) -> bool:
        """Whether the next iteration can be scheduled before this one completes."""
        return None not in self.slots

    @property
    def request_ids(self) -> frozenset[int]:
        """Every request in the forward: their blocks stay held until it completes. Made when first
        asked: only a forward still in flight when the next iteration runs (overlap) is asked."""
        if self._request_ids is None:
            self._request_ids = frozenset(map(_request_id, self.batch.all_requests))
        return self._request_ids


def record_prepared(prepared: PreparedBatch, iteration: int) -> PreparedBatch:
    """Record on the requests what ``prepare_resources`` decided at ``iteration``: who was
    deferred and why, the prefix each new allocation reused, and a preempted request that got
    its blocks back (what it recomputes, what came from the host tier). Returns ``prepared``."""
    for deferral in prepared.deferred:
        if deferral.reason is DeferReason.BUDGET:
            deferral.request.record_budget_deferral()
        else:
            deferral.request.record_capacity_deferral()
    for claim in prepared.claims:
        if claim.reused_tokens:
            claim.request.reuse_prefix(claim.reused_tokens)
        if claim.request.counters.awaiting_resumption:  # preempted: its resumption is counted
            claim.request.record_resumption(iteration, claim.reused_tokens, claim.onboarded_tokens)
    return prepared


def budget_bound(batch: ScheduledRequests, active: Sequence[LlmRequest]) -> bool:
    """The budget, not the traffic, limited the iteration (``budget_utilization_when_bound``,
    docs/design.md §5): some ``active`` request still has prompt tokens to compute after
    ``batch`` (taken before it runs)."""
    finishing = {c.request.request_id for c in batch.context_chunks if c.is_last}
    # Newest first: requests still in their prompt are the latest to arrive, so the scan
    # usually stops at once instead of passing every generation request first.
    return any(r.state is _CONTEXT_INIT and r.request_id not in finishing for r in reversed(active))


def advance(
    batch: ScheduledRequests, pending: PendingForward, launch: Launch, can_pick: Callable[[LlmRequest], bool] | None
) -> InFlight:
    """Move each request of ``batch`` past the positions its launched forward computes. Under
    overlap (``can_pick``: the engine's answer, None without overlap) a request that samples and
    whose token the engine picks gets that token's placeholders."""
    sampling = [chunk.request for chunk in batch.context_chunks if chunk.is_last]
    sampling += batch.generation_requests
    # whether the engine picks each one's token, asked before first-draft padding goes
    picked = list(map(can_pick, sampling)) if can_pick is not None else None
    for chunk in batch.context_chunks:
        request = chunk.request
        request.complete_context_chunk(chunk.end)
        request.record_forward()
        if chunk.is_last:
            request.state = _GENERATING
    for request in batch.generation_requests:
        if request.py_budget_deferred:
            request.record_forward()
        if request.is_first_draft:
            request.is_first_draft = False  # it runs its padded first draft step
    slots: list[int | None] = [None] * len(sampling)  # without overlap tokens are appended at completion
    if picked is not None:
        for index, (request, pick) in enumerate(zip(sampling, picked)):
            if pick:
                # one placeholder per draft it verifies, then one for the token after them
                width = 1 + len(request.py_draft_tokens)
                slots[index] = width
                if width == 1:
                    request.tokens.append(IN_FLIGHT_TOKEN_ID)
                else:
                    request.tokens.extend(_IN_FLIGHT * width)
    return InFlight(pending, batch, sampling, slots, launch)


def drop_in_flight_tokens(request: LlmRequest) -> None:
    """A request that ends or starts over while forwards are in flight keeps none of their placeholders."""
    count = num_in_flight_tokens(request.tokens)
    if count:
        del request.tokens[-count:]
