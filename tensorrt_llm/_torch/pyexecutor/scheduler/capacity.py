"""The capacity stage: which active requests fit in KV memory this iteration.

:class:`CapacityScheduler` asks the KV manager for counts (``available_blocks``,
``blocks_needed``, ``step_needs``, reservations) and ``match(request)`` for each waiting prompt,
and returns a :class:`CapacityDecision`: the started requests that keep running, those it
pauses, and the waiting ones it admits, each with upstream's reuse estimate (the micro-batch
stage's discount, see ``micro_batch``).

Waiting requests are admitted lazily (:meth:`CapacityScheduler.schedule_lazily`): admitting one
costs a walk of the prefix tree, and the micro-batch stage looks at the oldest few only (it
stops at the first context request the budget cannot take), so this stage admits the next one
when the micro-batch stage asks for it. The batch is the one an eager admission gives.

It only decides: it allocates nothing, frees nothing and writes no request field (the executor
pauses what it says).

Under ``waiting_queue_policy="priority"`` waiting requests are admitted in
:class:`~priority.PriorityOrder` (effective priority, then arrival; nobody overtakes the first
that does not fit, as under fcfs), and MAX_UTILIZATION serves started requests' next steps
highest-ranked first and pauses the lowest-ranked when memory is short. With
``enable_preemption`` it decides eagerly (every waiting request, in order) and a waiting request
that does not fit may pause running requests of strictly lower priority
(:func:`~preemption.choose_victims`). Under ``fcfs`` nothing of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.scheduler.preemption import choose_victims


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
        started, waiting = self.kv.sequences.split_allocated(active)
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
        available = self.kv.available_blocks - self.kv.sequences.reserved_blocks
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
            available = kv.available_blocks - kv.sequences.reserved_blocks  # every holder's (see _guaranteed_no_evict)

            def set_aside(request: LlmRequest) -> int:
                return kv.sequences.blocks_reserved_to_completion([request])
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
            return kv.sequences.releasable_blocks(request) + set_aside(request)

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
