"""The remaining_budget re-check: our fix, run at the start of ``KVCacheManager.prepare_resources``.

Admission upstream is reuse-discounted: a first chunk that expects to reuse most of its
prompt is charged only the uncached tail. Reuse is then claimed one request after another,
and an earlier allocation in the same batch can evict what a later request was counted as
reusing; that request's chunk runs at full size and the forward overshoots
``max_num_tokens``. The re-check closes the gap *before any block is claimed*:

1. ``remaining_budget = max_num_tokens``;
2. charge the costs that cannot change first: generation requests, then context chunks
   that are already allocated (non-first chunks), then first chunks in priority order
   (requests deferred earlier first, then scheduler order);
3. charge every request its full forward cost, reuse not discounted
   (:func:`forward_cost` with ``reuse_can_shift``), an upper bound of what
   ``_prepare_tp_inputs`` will append whatever reuse materialises (a first chunk whose
   prefix is already claimed — pinned, window shifted — is charged its exact cost);
4. a request that does not fit is deferred: it leaves the batch untouched.

A deferred request is charged at full cost by the scheduler next iteration, so when it
comes first here it fits: it is never deferred twice in a row for budget reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests


@dataclass(slots=True)
class BudgetDecision:
    """Outcome of one re-check, in charge order."""

    admitted: list[LlmRequest] = field(default_factory=list)
    deferred: list[LlmRequest] = field(default_factory=list)
    remaining_budget: int = 0

    def charge(self, request: LlmRequest, cost: int) -> None:
        if cost <= self.remaining_budget:
            self.remaining_budget -= cost
            self.admitted.append(request)
        else:
            self.deferred.append(request)


def recheck_remaining_budget(
    scheduled: "ScheduledRequests", max_num_tokens: int, kv_cache_manager: "KVCacheManager"
) -> BudgetDecision:
    """Decide, before any allocation, which scheduled requests this forward can afford.

    Pure: it reads the batch and the KV manager and changes neither; the caller defers.
    """
    first_chunks: list[LlmRequest] = []
    fixed = list(scheduled.generation_requests)  # costs that allocation cannot change
    for request in scheduled.context_requests:
        (fixed if kv_cache_manager.is_allocated(request) else first_chunks).append(request)
    # sorted() is stable: scheduler order is kept within each priority class.
    first_chunks.sort(key=lambda r: not r.py_budget_deferred)

    decision = BudgetDecision(remaining_budget=max_num_tokens)
    fixed_cost = sum(map(forward_cost, fixed))
    if fixed_cost <= max_num_tokens:  # the usual case, in one pass: the scheduler charged these exactly
        decision.admitted.extend(fixed)
        decision.remaining_budget -= fixed_cost
    else:
        for request in fixed:
            decision.charge(request, forward_cost(request))
    for request in first_chunks:
        decision.charge(request, forward_cost(request, reuse_can_shift=kv_cache_manager.reuse_can_shift(request)))
    return decision
