"""Two-stage scheduling: capacity (KV memory) then micro-batch (batch size and token budget).

The capacity scheduler decides which active requests fit in KV memory; the micro-batch
scheduler picks, among those, what runs in this forward under ``max_batch_size`` and
``max_num_tokens`` and sets each context request's chunk size. Charges come from the
token-budget policy, so upstream's reuse-discounted admission and our full-cost path
are the same code with different policies. Both stages only decide: they allocate
nothing and free nothing (the executor pauses and frees what the capacity stage says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy, ContextChunkingPolicy, ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_budget import TokenBudgetPolicy


@dataclass(slots=True)
class CapacityDecision:
    fitting: list[LlmRequest]
    paused: list[LlmRequest]


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

    def __init__(self, policy: CapacitySchedulerPolicy, kv_cache_manager: KVCacheManager) -> None:
        self.policy = policy
        self.kv = kv_cache_manager

    def schedule(self, active: Iterable[LlmRequest]) -> CapacityDecision:
        started, waiting = [], []
        for request in active:
            (started if self.kv.is_allocated(request) else waiting).append(request)
        if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            return self._guaranteed_no_evict(started, waiting)
        return self._max_utilization(started, waiting)

    def _new_request_blocks(self, request: LlmRequest, num_tokens: int) -> int:
        # Also stores upstream's estimate on the request: the micro-batch discount reads it.
        shared = self.kv.estimate_admission(request)
        return max(0, self.kv.blocks_for_tokens(request, num_tokens) - shared)

    def _guaranteed_no_evict(self, started: list[LlmRequest], waiting: list[LlmRequest]) -> CapacityDecision:
        available = self.kv.pool.available
        reserved = sum(self.kv.blocks_to_completion(r) for r in started)
        fitting = list(started)
        for request in waiting:
            needed = self._new_request_blocks(request, self.kv.max_sequence_len(request))
            if reserved + needed > available:
                break  # first come, first served: nobody overtakes the oldest waiting request
            reserved += needed
            fitting.append(request)
        return CapacityDecision(fitting, [])

    def _max_utilization(self, started: list[LlmRequest], waiting: list[LlmRequest]) -> CapacityDecision:
        available = self.kv.pool.available
        running = sorted(started, key=self.kv.allocation_stamp)
        fitting: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        while running:
            request = running[0]
            needed = self.kv.blocks_for_next_step(request)
            if needed <= available:
                available -= needed
                fitting.append(running.pop(0))
                continue
            victim = running.pop()  # the most recently started request gives way
            available += self.kv.num_held_blocks(victim)
            paused.append(victim)
        if paused:
            return CapacityDecision(fitting, paused)  # memory is short: admit nothing new
        for request in waiting:
            needed = self._new_request_blocks(request, request.prompt_len)
            if needed > available:
                break
            available -= needed
            fitting.append(request)
        return CapacityDecision(fitting, paused)


class MicroBatchScheduler:
    """Picks this forward's requests and chunk sizes under ``max_batch_size`` and ``max_num_tokens``.

    Generation requests are charged first (their cost is fixed); the budget left is then
    split between context requests by the chunking policy. Chunk sizes are multiples of
    ``chunk_unit_size`` except a chunk that finishes its prompt.
    """

    def __init__(self, config: ExecutorConfig, kv_cache_manager: KVCacheManager, policy: TokenBudgetPolicy) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_num_tokens = config.max_num_tokens
        self.chunked = config.enable_chunked_prefill
        self.unit = config.chunk_unit_size
        self.chunking_policy = config.context_chunking_policy
        self.kv = kv_cache_manager
        self.policy = policy

    def schedule(self, candidates: Iterable[LlmRequest]) -> ScheduledRequests:
        scheduled = ScheduledRequests()
        budget = self.max_num_tokens
        contexts: list[LlmRequest] = []
        for request in candidates:
            if request.is_context_init_state:
                contexts.append(request)
                continue
            if len(scheduled.generation_requests) >= self.max_batch_size:
                continue
            charge = self.policy.generation_charge(request)
            if charge > budget:
                continue
            budget -= charge
            scheduled.generation_requests.append(request)
            scheduled.charges[request.request_id] = charge
        # Context requests share the slots and budget that generation left.
        del contexts[self.max_batch_size - len(scheduled.generation_requests) :]
        if self.chunked and self.chunking_policy is ContextChunkingPolicy.EQUAL_PROGRESS:
            self._equal_progress(contexts, budget, scheduled)
        else:
            self._first_come_first_served(contexts, budget, scheduled)
        return scheduled

    def _charge(self, request: LlmRequest, chunk: int) -> int:
        request.context_chunk_size = chunk
        return self.policy.context_charge(request, self.kv)

    def _largest_chunk(self, request: LlmRequest, budget: int) -> int:
        """The largest allowed chunk whose charge fits ``budget`` (charges grow with the chunk)."""
        remaining = request.context_remaining_length
        if self._charge(request, remaining) <= budget:
            return remaining
        if not self.chunked:
            return 0
        lo, hi = 0, (remaining - 1) // self.unit  # multiples of the unit strictly below the remainder
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._charge(request, mid * self.unit) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.unit

    def _first_come_first_served(self, contexts: list[LlmRequest], budget: int, scheduled: ScheduledRequests) -> None:
        blocked = False
        for request in contexts:
            chunk = 0 if blocked else self._largest_chunk(request, budget)
            if chunk == 0:
                # The oldest context request that does not fit waits; nobody overtakes it.
                blocked = True
                request.context_chunk_size = 0
                continue
            charge = self._charge(request, chunk)
            budget -= charge
            scheduled.context_requests.append(request)
            scheduled.charges[request.request_id] = charge

    def _equal_progress(self, contexts: list[LlmRequest], budget: int, scheduled: ScheduledRequests) -> None:
        chunks = dict.fromkeys(contexts, 0)
        charges = dict.fromkeys(contexts, 0)
        progressed = True
        while progressed:
            progressed = False
            for request in contexts:
                remaining = request.context_remaining_length
                if chunks[request] >= remaining:
                    continue
                grown = min(chunks[request] + self.unit, remaining)
                charge = self._charge(request, grown)
                if charge - charges[request] > budget:
                    continue
                if charge == charges[request] and self._charge(request, remaining) == charge:
                    grown = remaining  # the discount covers the rest: growing further is free
                budget -= charge - charges[request]
                chunks[request], charges[request] = grown, charge
                progressed = True
        for request in contexts:
            request.context_chunk_size = chunks[request]
            if chunks[request]:
                scheduled.context_requests.append(request)
                scheduled.charges[request.request_id] = charges[request]


class SimpleScheduler:
    """Capacity then micro-batch: one ``ScheduledRequests`` per iteration."""

    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler) -> None:
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(self, active: Iterable[LlmRequest]) -> ScheduledRequests:
        capacity = self.capacity_scheduler.schedule(active)
        scheduled = self.micro_batch_scheduler.schedule(capacity.fitting)
        scheduled.paused_requests = capacity.paused
        return scheduled
