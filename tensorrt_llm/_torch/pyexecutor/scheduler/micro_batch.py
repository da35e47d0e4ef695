"""The micro-batch stage: what runs in this forward, under ``max_batch_size`` and ``max_num_tokens``.

:class:`MicroBatchScheduler` takes the requests the capacity stage let through (with upstream's
reuse estimate of every admitted request that holds no blocks yet, see ``capacity``), charges
generation steps first (their cost is fixed) and splits the budget left between context
requests by the chunking policy, choosing each one's chunk. Charges come from the token-budget
policy (``budget.policies``), so upstream's reuse-discounted admission and our full-cost path
are the same code with different policies.

It only decides: chunks travel in the returned :class:`~scheduled_requests.ScheduledRequests`,
and no request field is written.

Under ``waiting_queue_policy="priority"`` it gives slots and chunk budget to context requests
(started or just admitted) and, when they do not all fit, generation steps in
:class:`~priority.PriorityOrder`; ``low_priority_max_num_tokens`` caps the low class's prompt
tokens per forward.
"""

from __future__ import annotations

import heapq
from itertools import chain, islice
from operator import attrgetter
from typing import Iterable, Iterator, Sequence

from tensorrt_llm._torch.pyexecutor.budget.policies import TokenBudgetPolicy
from tensorrt_llm._torch.pyexecutor.config import ContextChunkingPolicy, ExecutorConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_request_id = attrgetter("request_id")


def _with_estimates(admissions: Iterable[tuple[LlmRequest, int]], estimated_reusable: dict[int, int]) -> Iterator[LlmRequest]:
    """Each admitted request, its estimate recorded in ``estimated_reusable`` as it is read."""
    for request, estimate in admissions:
        estimated_reusable[request.request_id] = estimate
        yield request


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
