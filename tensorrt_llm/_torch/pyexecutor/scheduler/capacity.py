"""Two-stage scheduling: capacity (KV memory) then micro-batch (batch size and token budget).

The capacity scheduler decides which active requests fit in KV memory and hands the
micro-batch scheduler, with them, upstream's reuse estimate of every admitted request that
holds no blocks yet. The micro-batch scheduler picks, among those, what runs in this forward
under ``max_batch_size`` and ``max_num_tokens`` and chooses each context request's chunk.
Charges come from the token-budget policy, so upstream's reuse-discounted admission and our
full-cost path are the same code with different policies.

Within an iteration the waiting requests are admitted lazily
(:meth:`CapacityScheduler.schedule_lazily`): admitting one costs a walk of the prefix tree,
and the micro-batch scheduler looks at the oldest few only (it stops at the first context
request the budget cannot take), so the capacity stage admits the next one when the
micro-batch stage asks for it. The batch is the one an eager admission gives.

Both stages only decide: they allocate nothing, free nothing and write no request field (the
executor pauses what the capacity stage says; chunks travel in the batch).

Under ``waiting_queue_policy="priority"`` both stages take requests in
:class:`~priority.PriorityOrder` (effective priority, then arrival) instead of arrival order:
the capacity stage admits waiting requests in that order (nobody overtakes the first that does
not fit, as under fcfs), MAX_UTILIZATION serves started requests' next steps highest-ranked
first and pauses the lowest-ranked when memory is short, and
the micro-batch stage gives slots and chunk budget to context requests (started or just
admitted) and, when they do not all fit, generation steps in that order. With
``enable_preemption`` the capacity stage decides eagerly (every waiting request, in order) and
a waiting request that does not fit may pause running requests of strictly lower priority
(:func:`~preemption.choose_victims`). Under ``fcfs`` nothing of this runs.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from operator import attrgetter
from itertools import chain, islice
from typing import Iterable, Iterator, Sequence

from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy, ContextChunkingPolicy, ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler.preemption import choose_victims
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests
from tensorrt_llm._torch.pyexecutor.budget.policies import TokenBudgetPolicy

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_request_id = attrgetter("request_id")


@dataclass(slots=True)
class CapacityDecision:
    """Who fits in KV memory this iteration.

    ``fitting`` lists the requests that hold blocks, then the admitted ones that do not
    (oldest first, or in priority order); ``estimated_reusable`` maps each of the latter to
    upstream's estimate of its reusable prefix (the micro-batch scheduler's discount);
    ``paused`` are preempted; ``preempted_for`` maps those of them paused for a waiting request
    of higher priority (priority preemption) to that request's id.
    """

    fitting: list[LlmRequest]
    paused: list[LlmRequest] = field(default_factory=list)
    estimated_reusable: dict[int, int] = field(default_factory=dict)
    preempted_for: dict[int, int] = field(default_factory=dict)


def _with_estimates(admissions: Iterable[tuple[LlmRequest, int]], estimated_reusable: dict[int, int]) -> Iterator[LlmRequest]:
    """Each admitted request, its estimate recorded in ``estimated_reusable`` as it is read."""
    for request, estimate in admissions:
        estimated_reusable[request.request_id] = estimate
        yield request


class CapacityScheduler:
    """Admits requests into KV memory.

    ``GUARANTEED_NO_EVICT`` reserves every started request's blocks to completion and
    admits new ones (oldest first) while their blocks to completion fit. ``MAX_UTILIZATION``
    reserves one step at a time and, when a started request cannot get its next step,
    pauses the most recently started one. Both credit a new request only with the reusable
    prompt blocks that started requests already hold: a cached, unreferenced block that a
    claim pins leaves the pool's available count just as a fresh block does, so crediting
    upstream's whole estimate over-admits, and GUARANTEED_NO_EVICT, which never pauses,
    then deadlocks with every started request waiting for a block.
    """

    def __init__(
        self,
        policy: CapacitySchedulerPolicy,
        kv_cache_manager: KVCacheManager,
        *,
        order: PriorityOrder | None = None,
        preemption_cooldown: int | None = None,
    ) -> None:
        """``order``: priority order (None: arrival order). ``preemption_cooldown``: priority
        preemption on (needs ``order``), with that cooldown in iterations; None: off."""
        if preemption_cooldown is not None and order is None:
            raise ValueError("priority preemption needs a priority order")
        self.policy = policy
        self.kv = kv_cache_manager
        self.order = order
        self.preemption_cooldown = preemption_cooldown

    def schedule(self, active: Sequence[LlmRequest], iteration: int = 0) -> CapacityDecision:
        """Every request that fits: the started ones, then every waiting one admitted."""
        decision, admissions = self.schedule_lazily(active, iteration)
        for request, estimate in admissions:
            decision.fitting.append(request)
            decision.estimated_reusable[request.request_id] = estimate
        return decision

    def schedule_lazily(
        self, active: Sequence[LlmRequest], iteration: int = 0
    ) -> tuple[CapacityDecision, Iterator[tuple[LlmRequest, int]]]:
        """:meth:`schedule` with the waiting requests admitted only as far as the caller reads.

        Returns the decision for the started requests (``fitting``, ``paused``) and an iterator
        of the admitted waiting requests, oldest first (or in priority order), each with
        upstream's reuse estimate: what :meth:`schedule` appends to ``fitting`` and
        ``estimated_reusable``. Each one is admitted as it is read, against the KV state of that
        moment: read it before anything allocates or frees. With priority preemption every
        waiting request is decided here (the iterator is empty): a preemption changes
        ``fitting``. ``iteration`` is the executor's, for the preemption cooldown.
        """
        started, waiting = self.kv.split_allocated(active)
        if self.order is not None and waiting:
            waiting.sort(key=self.order.key)
        if self.preemption_cooldown is not None and waiting:
            return self._preempting(started, waiting, iteration), iter(())
        if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            return self._guaranteed_no_evict(started, waiting)
        return self._max_utilization(started, waiting)

    def _admit(self, waiting: list[LlmRequest], available: int, *, to_completion: bool) -> Iterator[tuple[LlmRequest, int]]:
        """Admit waiting requests, oldest first, while their blocks fit ``available``."""
        kv = self.kv
        for request in waiting:
            match = kv.match(request)
            needed = kv.blocks_needed(request, match, to_completion=to_completion)
            if needed > available:
                return  # first come, first served: nobody overtakes the oldest waiting request
            available -= needed
            yield request, match.reusable_tokens

    def _guaranteed_no_evict(
        self, started: list[LlmRequest], waiting: list[LlmRequest]
    ) -> tuple[CapacityDecision, Iterator[tuple[LlmRequest, int]]]:
        if not waiting:
            return CapacityDecision(started), iter(())
        # every holder's reservation, not only the requests scheduled now: under overlap one whose
        # last token is in flight is not scheduled but holds its blocks until that forward completes
        available = self.kv.available_blocks - self.kv.reserved_blocks
        return CapacityDecision(started), self._admit(waiting, available, to_completion=True)

    def _max_utilization(
        self, started: list[LlmRequest], waiting: list[LlmRequest]
    ) -> tuple[CapacityDecision, Iterator[tuple[LlmRequest, int]]]:
        kv = self.kv
        available = kv.available_blocks
        running = kv.step_needs(started)  # oldest first
        if self.order is not None:  # highest-ranked first: the lowest-ranked gives way
            running.sort(key=lambda need: self.order.key(need.request))
        decision = CapacityDecision([])
        fitting, paused = decision.fitting, decision.paused
        while running:
            need = running[0]
            if need.blocks <= available:
                available -= need.blocks
                fitting.append(running.pop(0).request)
                continue
            victim = running.pop()  # the most recently started request gives way (under priority: the lowest-ranked)
            available += victim.held
            paused.append(victim.request)
        if paused:  # memory is short while anything is paused: admit nothing new
            return decision, iter(())
        return decision, self._admit(waiting, available, to_completion=False)

    def _preempting(self, started: list[LlmRequest], waiting: list[LlmRequest], iteration: int) -> CapacityDecision:
        """Both policies with priority preemption: the started requests as without it, then each
        waiting request in priority order, pausing running ones of lower priority when it does
        not fit (see ``preemption``); the first that does not fit even so waits, and so does
        everyone ranked after it."""
        kv = self.kv
        to_completion = self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        if to_completion:
            decision = CapacityDecision(list(started))
            available = kv.available_blocks - kv.reserved_blocks  # every holder's (see _guaranteed_no_evict)

            def set_aside(request: LlmRequest) -> int:
                return kv.blocks_reserved_to_completion([request])
        else:
            decision, _ = self._max_utilization(started, [])
            if decision.paused:  # memory is short while anything is paused: admit nothing new
                return decision
            steps = {need.request.request_id: need.blocks for need in kv.step_needs(decision.fitting)}
            available = kv.available_blocks - sum(steps.values())

            def set_aside(request: LlmRequest) -> int:
                return steps[request.request_id]
        running = list(decision.fitting)

        def credit(request: LlmRequest) -> int:
            return kv.releasable_blocks(request) + set_aside(request)

        for request in waiting:
            match = kv.match(request)
            needed = kv.blocks_needed(request, match, to_completion=to_completion)
            if needed > available:
                needed = kv.blocks_needed(request, to_completion=to_completion)  # no sharing credit: see preemption
                victims = choose_victims(request, needed - available, running, credit, self.order,
                                         iteration=iteration, cooldown=self.preemption_cooldown)
                if victims is None:
                    break  # nobody overtakes the first waiting request that does not fit
                for victim in victims:
                    available += credit(victim)
                    running.remove(victim)
                    decision.fitting.remove(victim)
                    decision.paused.append(victim)
                    decision.preempted_for[victim.request_id] = request.request_id
            available -= needed
            decision.fitting.append(request)
            decision.estimated_reusable[request.request_id] = match.reusable_tokens
        return decision


class MicroBatchScheduler:
    """Picks this forward's requests and chunk sizes under ``max_batch_size`` and ``max_num_tokens``.

    Generation requests are charged first (their cost is fixed); the budget left is then
    split between context requests by the chunking policy. Chunk sizes are multiples of
    ``chunk_unit_size`` except a chunk that finishes its prompt.
    """

    def __init__(self, config: ExecutorConfig, policy: TokenBudgetPolicy) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_num_tokens = config.max_num_tokens
        self.chunked = config.enable_chunked_prefill
        self.unit = config.chunk_unit_size
        self.chunking_policy = config.context_chunking_policy
        self.policy = policy
        self.order = PriorityOrder.of(config.scheduler_config)  # None: arrival order
        # priority: the prompt tokens a forward gives the low class at most (None: no cap)
        self.low_priority_tokens = config.scheduler_config.low_priority_max_num_tokens if self.order else None
        self.low_below = config.scheduler_config.priority_low_below

    def schedule(
        self,
        candidates: Sequence[LlmRequest],
        estimated_reusable: dict[int, int],
        admissions: Iterable[tuple[LlmRequest, int]] = (),
    ) -> ScheduledRequests:
        """The batch among ``candidates``; ``estimated_reusable`` holds upstream's estimate for
        every candidate that holds no blocks yet (the capacity stage's, see :class:`CapacityDecision`).

        ``admissions``: more context candidates after ``candidates``, with their estimates
        (:meth:`CapacityScheduler.schedule_lazily`), read only as far as the batch needs them:
        the same batch as with them appended to ``candidates``."""
        generation = [r for r in candidates if r.state is not _CONTEXT_INIT]
        contexts = [r for r in candidates if r.state is _CONTEXT_INIT] if len(generation) < len(candidates) else []
        costs = list(map(self.policy.generation_charge, generation))
        budget = self.max_num_tokens
        total = sum(costs)
        if len(generation) <= self.max_batch_size and total <= budget:  # the usual case: every step fits
            charges = dict(zip(map(_request_id, generation), costs))
        else:
            if self.order is not None:  # the highest-ranked steps first when not all fit
                ranked = sorted(range(len(generation)), key=lambda i: self.order.key(generation[i]))
                generation, costs = [generation[i] for i in ranked], [costs[i] for i in ranked]
            generation, charges = self._fit_generation(generation, costs)
            total = sum(charges.values())
        budget -= total
        # Context requests share the slots and budget that generation left.
        slots = self.max_batch_size - len(generation)
        estimated_reusable = dict(estimated_reusable)  # admissions add theirs as they are read
        ordered: Iterable[LlmRequest]
        if self.order is None:
            del contexts[slots:]
            admitted = _with_estimates(islice(admissions, max(0, slots - len(contexts))), estimated_reusable)
            ordered = chain(contexts, admitted)
        else:  # started and admitted context requests together, by rank (admissions arrive ranked)
            contexts.sort(key=self.order.key)
            ordered = islice(heapq.merge(contexts, _with_estimates(admissions, estimated_reusable), key=self.order.key),
                             max(0, slots))
        if self.chunked and self.chunking_policy is ContextChunkingPolicy.EQUAL_PROGRESS:
            chunks = self._equal_progress(list(ordered), budget, estimated_reusable, charges)
        else:  # it stops at the first request that does not fit: later admissions are never read
            chunks = self._first_come_first_served(ordered, budget, estimated_reusable, charges)
        return ScheduledRequests(
            context_chunks=chunks,
            generation_requests=generation,
            charges=charges,
            estimated_reusable={c.request.request_id: estimated_reusable[c.request.request_id]
                                for c in chunks if c.request.request_id in estimated_reusable},
            generation_charge=total,
        )

    def _fit_generation(self, generation: list[LlmRequest], costs: list[int]) -> tuple[list[LlmRequest], dict[int, int]]:
        """Generation steps in order while slots and budget last; one that does not fit is skipped."""
        budget = self.max_num_tokens
        fitting: list[LlmRequest] = []
        charges: dict[int, int] = {}
        for request, cost in zip(generation, costs):
            if len(fitting) >= self.max_batch_size or cost > budget:
                continue
            budget -= cost
            fitting.append(request)
            charges[request.request_id] = cost
        return fitting, charges

    def _largest_chunk(self, request: LlmRequest, budget: int, reusable: int | None) -> tuple[int, int]:
        """The largest allowed chunk whose charge fits ``budget`` (charges grow with the chunk), and its charge."""
        charge = self.policy.context_charge
        remaining = request.prompt_len - request.context_current_position
        cost = charge(request, remaining, reusable)
        if cost <= budget:
            return remaining, cost
        if not self.chunked:
            return 0, 0
        lo, hi = 0, (remaining - 1) // self.unit  # multiples of the unit strictly below the remainder
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if charge(request, mid * self.unit, reusable) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.unit, (charge(request, lo * self.unit, reusable) if lo else 0)

    def _first_come_first_served(
        self, contexts: Iterable[LlmRequest], budget: int, estimated_reusable: dict[int, int], charges: dict[int, int]
    ) -> list[ContextChunk]:
        chunks = []
        low_left = self.low_priority_tokens  # None: no cap on the low class's prompt tokens
        for request in contexts:
            low = low_left is not None and request.priority < self.low_below
            size, cost = self._largest_chunk(request, min(budget, low_left) if low else budget,
                                             estimated_reusable.get(request.request_id))
            if size == 0:
                break  # the oldest context request that does not fit waits; nobody overtakes it
            budget -= cost
            if low:
                low_left -= cost
            chunks.append(ContextChunk.of(request, size))
            charges[request.request_id] = cost
        return chunks

    def _equal_progress(
        self, contexts: list[LlmRequest], budget: int, estimated_reusable: dict[int, int], charges: dict[int, int]
    ) -> list[ContextChunk]:
        charge = self.policy.context_charge
        reusable = [estimated_reusable.get(r.request_id) for r in contexts]
        sizes = [0] * len(contexts)
        costs = [0] * len(contexts)
        # Under priority (contexts in rank order): once a request cannot start, nobody ranked
        # below it starts (they may still grow); the low class gets at most its token cap.
        ranked = self.order is not None
        blocked = len(contexts)
        low_left = self.low_priority_tokens
        progressed = True
        while progressed:
            progressed = False
            for i, request in enumerate(contexts):
                remaining = request.prompt_len - request.context_current_position
                if sizes[i] >= remaining or (i > blocked and not sizes[i]):
                    continue
                low = low_left is not None and request.priority < self.low_below
                grown = min(sizes[i] + self.unit, remaining)
                cost = charge(request, grown, reusable[i])
                if cost - costs[i] > (min(budget, low_left) if low else budget):
                    if ranked and not sizes[i]:
                        blocked = min(blocked, i)
                    continue
                if cost == costs[i] and charge(request, remaining, reusable[i]) == cost:
                    grown = remaining  # the discount covers the rest: growing further is free
                budget -= cost - costs[i]
                if low:
                    low_left -= cost - costs[i]
                sizes[i], costs[i] = grown, cost
                progressed = True
        chunks = []
        for request, size, cost in zip(contexts, sizes, costs):
            if size:
                chunks.append(ContextChunk.of(request, size))
                charges[request.request_id] = cost
        return chunks


class SimpleScheduler:
    """Capacity then micro-batch: one ``ScheduledRequests`` per iteration."""

    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler) -> None:
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(self, active: Sequence[LlmRequest], iteration: int = 0) -> ScheduledRequests:
        """``iteration``: the executor's (the preemption cooldown counts iterations)."""
        capacity, admissions = self.capacity_scheduler.schedule_lazily(active, iteration)
        scheduled = self.micro_batch_scheduler.schedule(capacity.fitting, capacity.estimated_reusable, admissions)
        if capacity.paused:
            scheduled = dataclasses.replace(scheduled, paused_requests=capacity.paused,
                                            preempted_for=capacity.preempted_for)
        return scheduled


def make_scheduler(config: ExecutorConfig, kv_cache_manager: KVCacheManager, policy: TokenBudgetPolicy) -> SimpleScheduler:
    """The two-stage scheduler an executor with ``config`` runs over ``kv_cache_manager``."""
    scheduling = config.scheduler_config
    order = PriorityOrder.of(scheduling)
    cooldown = scheduling.preemption_cooldown_iterations if scheduling.enable_preemption else None
    capacity = CapacityScheduler(config.capacity_scheduler_policy, kv_cache_manager, order=order,
                                 preemption_cooldown=cooldown)
    return SimpleScheduler(capacity, MicroBatchScheduler(config, policy))
