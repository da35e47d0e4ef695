"""The remaining_budget re-check: our fix, run before any KV allocation.

Admission upstream is reuse-discounted: a first chunk that expects to reuse most of its
prompt is charged only the uncached tail. Reuse is then claimed one request after another,
and an earlier allocation in the same batch can evict what a later request was counted as
reusing; that request's chunk runs at full size and the forward overshoots
``max_num_tokens``. The re-check closes the gap *before any block is claimed*:

1. ``remaining_budget = max_num_tokens``;
2. charge the costs that cannot change first: generation steps, then context chunks that
   are already allocated (later chunks), then first chunks in priority order (requests
   deferred earlier first, then scheduler order);
3. charge every chunk its full forward cost, reuse not discounted
   (:func:`forward_cost` with ``reuse_can_shift``), an upper bound of what
   ``_prepare_tp_inputs`` will append whatever reuse materialises (a first chunk whose
   prefix is already claimed — pinned, window shifted — is charged its exact cost);
4. a first chunk that does not fit is first *cut*, when chunks may be cut (chunked
   prefill), and still charged the full cost of the cut chunk:

   * if it expects reuse (upstream's estimate from the capacity stage), to the whole units
     that finish its prompt should that reuse materialise — taking whole units from first
     chunks admitted before it that are not last, each keeping at least one, when the
     room is short (their prompts simply continue next iteration; this one gets its first
     token now instead of an iteration later);
   * otherwise to the largest unit-aligned size that fits, at least one unit so that it
     progresses;

   only a request for which not even one unit fits is *deferred*: it leaves the batch
   untouched.

A deferred request is charged at full cost by the scheduler next iteration and comes first
here, so it fits whole: it is never deferred twice in a row for budget reasons.

**Under priority** (``waiting_queue_policy="priority"``, :func:`recheck_by_priority`) the
steps are the same but the order is the request's rank (:class:`~priority.PriorityOrder`):

1. generation steps first (exact; they hold KV and cost a position or a few);
2. every context chunk, later and first alike, in rank order, each charged as above and cut
   to what fits when it overflows; the lowest-ranked are thus the first cut and deferred;
3. a request that owes a deferral is not put first: the smallest progress it may make (one
   unit, or its whole chunk without chunked prefill) is set aside for it before the loop, so
   higher-ranked chunks cannot take that room and it is still never deferred twice in a row;
4. once a chunk is deferred, every lower-ranked chunk that owes nothing is deferred too: a
   higher-priority request is never deferred while a lower-priority one in the same batch
   runs. The one exception is a lower-priority request that owes a deferral: it runs its set
   aside smallest progress (cut to one unit; whole only if its chunk is no larger, or chunked
   prefill is off). Room is never taken from higher-ranked chunks for a lower-ranked one.

:func:`recheck_remaining_budget` is pure: it takes the batch's parts as values and returns a
:class:`BudgetDecision`; the caller (``ResourceManager``) acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk


@dataclass(slots=True)
class BudgetDecision:
    """Outcome of one re-check.

    ``chunks`` maps the request id of every admitted context request to the chunk it may
    run; ``cut`` lists, in scheduler order, the admitted first chunks that are smaller than
    scheduled; ``generation`` lists the admitted generation steps;
    ``deferred`` the requests that did not fit, with the cost they were charged; ``charged``
    the total the admitted requests were charged.
    """

    max_num_tokens: int
    chunks: dict[int, ContextChunk] = field(default_factory=dict)
    generation: list[LlmRequest] = field(default_factory=list)
    deferred: list[tuple[LlmRequest, int]] = field(default_factory=list)
    cut: list[ContextChunk] = field(default_factory=list)
    charged: int = 0

    @property
    def remaining_budget(self) -> int:
        return self.max_num_tokens - self.charged


def cut_to_fit(chunk: ContextChunk, room: int, unit: int, *, reuse_can_shift: bool) -> ContextChunk | None:
    """The largest smaller chunk ending on a multiple of ``unit`` whose full cost fits ``room``.

    A cut chunk is not the last one; with ``reuse_can_shift`` reuse may still make it the
    last, so its bound keeps the draft tokens. None when not even one unit fits.
    """
    drafts = len(chunk.request.py_draft_tokens) if reuse_can_shift else 0
    start = chunk.start
    end = min((start + room - drafts) // unit * unit, (chunk.end - 1) // unit * unit)
    if end <= start:
        return None
    return chunk.resized(end - start)


def _take_room(donors: list[ContextChunk], chunks: dict[int, ContextChunk], needed: int, unit: int) -> int:
    """Take ``needed`` tokens, in whole units, from admitted chunks that are not last (the
    latest first), each keeping at least a unit; nothing unless all of it can be had.
    Updates ``donors`` and ``chunks``; returns the tokens taken."""
    spare = [(i, c.size - unit) for i, c in enumerate(donors) if not c.is_last]
    if sum(n for _, n in spare) < needed:
        return 0
    taken = 0
    for i, n in reversed(spare):
        give = min(n, -(-(needed - taken) // unit) * unit)
        if give > 0:
            shrunk = donors[i] = donors[i].resized(donors[i].size - give)
            chunks[shrunk.request.request_id] = shrunk
            taken += give
        if taken >= needed:
            break
    return taken


def recheck_remaining_budget(
    generation: Sequence[LlmRequest],
    later_chunks: Sequence[ContextChunk],
    first_chunks: Sequence[ContextChunk],
    max_num_tokens: int,
    *,
    reuse_can_shift: bool,
    cut_unit: int = 0,
    tokens_per_block: int = 1,
    estimated_reusable: Mapping[int, int] | None = None,
    generation_cost: int | None = None,
) -> BudgetDecision:
    """Decide, before any allocation, what of the scheduled batch this forward can afford.

    ``later_chunks`` are allocated (their cost is exact); ``first_chunks`` are not, in
    scheduler order: their bound includes the drafts a reuse shift could add when
    ``reuse_can_shift`` (block reuse on and no prefix claimed yet). ``cut_unit`` > 0 lets
    an overflowing first chunk be cut to a multiple of it (a claimed, shifted window to a
    multiple of ``tokens_per_block``); 0 defers it whole (chunked prefill off).
    ``estimated_reusable`` (request id -> upstream's estimate) sizes the cut of a chunk
    that expects reuse; it never changes a bound. ``generation_cost`` is the summed
    :func:`forward_cost` of ``generation`` when the caller already has it (a scheduler that
    charged generation steps exactly), so that the re-check stays O(context requests).
    """
    decision = BudgetDecision(max_num_tokens)
    chunks = decision.chunks
    fixed = sum(map(forward_cost, generation)) if generation_cost is None else generation_cost
    later_costs = [chunk.cost() for chunk in later_chunks]
    if fixed + sum(later_costs) <= max_num_tokens:  # the usual case: the scheduler charged these exactly
        decision.generation = list(generation)
        for chunk in later_chunks:
            chunks[chunk.request.request_id] = chunk
        fixed += sum(later_costs)
    else:
        fixed = 0
        for request in generation:
            cost = forward_cost(request)
            if fixed + cost <= max_num_tokens:
                fixed += cost
                decision.generation.append(request)
            else:
                decision.deferred.append((request, cost))
        for chunk, cost in zip(later_chunks, later_costs):
            if fixed + cost <= max_num_tokens:
                fixed += cost
                chunks[chunk.request.request_id] = chunk
            else:
                decision.deferred.append((chunk.request, cost))
    remaining = max_num_tokens - fixed
    estimates = estimated_reusable if reuse_can_shift and estimated_reusable is not None else {}
    donors: list[ContextChunk] = []  # admitted unshifted chunks that expect no reuse: they may give room
    # sorted() is stable: scheduler order is kept within each priority class.
    for chunk in sorted(first_chunks, key=lambda c: not c.request.py_budget_deferred):
        cost = chunk.cost(reuse_can_shift=reuse_can_shift)
        request = chunk.request
        estimate = estimates.get(request.request_id, 0)
        aligned = cut_unit and chunk.start % cut_unit == 0
        if cost > remaining and aligned and estimate:
            # What finishes the prompt if the estimated reuse materialises, in whole units.
            tail = request.prompt_len - max(min(estimate, request.prompt_len - 1), chunk.start)
            size = -(-tail // cut_unit) * cut_unit
            if size < chunk.size:
                finishing = chunk.resized(size)
                needed = finishing.cost(reuse_can_shift=True)
                if needed > remaining:
                    remaining += _take_room(donors, chunks, needed - remaining, cut_unit)
                if needed <= remaining:
                    chunk, cost = finishing, needed
        if cost > remaining and cut_unit:
            unit = cut_unit if aligned else tokens_per_block
            cut = cut_to_fit(chunk, remaining, unit, reuse_can_shift=reuse_can_shift)
            if cut is not None:
                chunk, cost = cut, cut.cost(reuse_can_shift=reuse_can_shift)
        if cost <= remaining:
            remaining -= cost
            chunks[request.request_id] = chunk
            if aligned:
                donors.append(chunk)
        else:
            decision.deferred.append((request, cost))
    decision.charged = max_num_tokens - remaining
    decision.cut = [chunks[c.request.request_id] for c in first_chunks if chunks.get(c.request.request_id, c) != c]
    return decision


def _smallest_step(chunk: ContextChunk, unit: int, *, reuse_can_shift: bool) -> ContextChunk:
    """The least progress ``chunk`` may make: up to the first multiple of ``unit`` after its
    start (``unit`` 0: the whole chunk, which cannot be cut)."""
    if not unit:
        return chunk
    first_boundary = (chunk.start // unit + 1) * unit
    if chunk.end <= first_boundary:
        return chunk
    drafts = len(chunk.request.py_draft_tokens) if reuse_can_shift else 0
    cut = cut_to_fit(chunk, first_boundary - chunk.start + drafts, unit, reuse_can_shift=reuse_can_shift)
    return chunk if cut is None else cut


def recheck_by_priority(
    generation: Sequence[LlmRequest],
    later_chunks: Sequence[ContextChunk],
    first_chunks: Sequence[ContextChunk],
    max_num_tokens: int,
    rank: Callable[[LlmRequest], object],
    *,
    reuse_can_shift: bool,
    cut_unit: int = 0,
    tokens_per_block: int = 1,
    estimated_reusable: Mapping[int, int] | None = None,
    generation_cost: int | None = None,
) -> BudgetDecision:
    """:func:`recheck_remaining_budget` in priority order (the module docstring's "under priority").

    ``rank(request)`` is the sort key of :class:`~priority.PriorityOrder` (smallest first).
    The other arguments are :func:`recheck_remaining_budget`'s; each chunk's bound is the same.
    """
    decision = BudgetDecision(max_num_tokens)
    chunks = decision.chunks
    fixed = sum(map(forward_cost, generation)) if generation_cost is None else generation_cost
    if fixed <= max_num_tokens:
        decision.generation = list(generation)
    else:  # the scheduler charged them otherwise: the highest-ranked steps first
        fixed = 0
        for request in sorted(generation, key=rank):
            cost = forward_cost(request)
            if fixed + cost <= max_num_tokens:
                fixed += cost
                decision.generation.append(request)
            else:
                decision.deferred.append((request, cost))
    remaining = max_num_tokens - fixed
    estimates = estimated_reusable if reuse_can_shift and estimated_reusable is not None else {}
    # (chunk, whether reuse may still move its window), highest-ranked first
    work = [(chunk, False) for chunk in later_chunks] + [(chunk, reuse_can_shift) for chunk in first_chunks]
    work.sort(key=lambda item: rank(item[0].request))

    def unit_of(chunk: ContextChunk) -> int:
        if not cut_unit:
            return 0
        return cut_unit if chunk.start % cut_unit == 0 else tokens_per_block

    reserved = {
        chunk.request.request_id: _smallest_step(chunk, unit_of(chunk), reuse_can_shift=shift).cost(reuse_can_shift=shift)
        for chunk, shift in work if chunk.request.py_budget_deferred
    }
    outstanding = sum(reserved.values())
    blocked = False
    for chunk, shift in work:
        request = chunk.request
        owed = reserved.get(request.request_id)
        if owed is not None:
            outstanding -= owed
        elif blocked:
            decision.deferred.append((request, chunk.cost(reuse_can_shift=shift)))
            continue
        room = remaining - outstanding
        cost = chunk.cost(reuse_can_shift=shift)
        unit = unit_of(chunk)
        if cost > room and unit:
            estimate = estimates.get(request.request_id, 0) if shift else 0
            if estimate and unit == cut_unit:
                # What finishes the prompt if the estimated reuse materialises, in whole units.
                tail = request.prompt_len - max(min(estimate, request.prompt_len - 1), chunk.start)
                finishing = chunk.resized(-(-tail // unit) * unit)
                if finishing.size < chunk.size and finishing.cost(reuse_can_shift=True) <= room:
                    chunk, cost = finishing, finishing.cost(reuse_can_shift=True)
            if cost > room:
                cut = cut_to_fit(chunk, room, unit, reuse_can_shift=shift)
                if cut is not None:
                    chunk, cost = cut, cut.cost(reuse_can_shift=shift)
        if cost <= room:
            remaining -= cost
            chunks[request.request_id] = chunk
        else:
            decision.deferred.append((request, cost))
            blocked = True
    decision.charged = max_num_tokens - remaining
    scheduled = [*later_chunks, *first_chunks]
    decision.cut = [chunks[c.request.request_id] for c in scheduled if chunks.get(c.request.request_id, c) != c]
    return decision
