"""Token-budget policies: how the executor keeps a forward within ``max_num_tokens``.

Each policy is a small class behind one interface with four hooks, called in iteration
order: the scheduler's charges (``context_charge``/``generation_charge``), then
``before_allocation`` and ``after_allocation`` around the KV manager's allocation, then
``before_inputs`` at the top of ``_prepare_tp_inputs``. Only ``recheck`` claims safety.

=========  ==========================================================================
none       upstream before any fix: reuse-discounted admission, nothing after it
trim       closed upstream proposal: predict the total at the top of
           ``_prepare_tp_inputs`` and shrink trailing context chunks; its prediction
           misses beam width and first-draft padding (its own review said so)
fit        upstream's merged approach: after allocation, shrink context chunks (last
           chunks first, block-aligned, at least one block of progress) until the batch
           fits; cannot repair generation-only overshoot or runs without chunked prefill
recheck    ours: :func:`recheck_remaining_budget` before any allocation; defers what
           overflows; the scheduler charges deferred requests at full cost
claim      ours, claim-then-charge: first pin (claim) every first chunk's matched prefix
           for the whole batch, then run the same re-check on exact post-reuse costs —
           nothing can evict a pinned prefix, so no budget is spent on reuse that does
           materialise
=========  ==========================================================================
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from tensorrt_llm._torch.pyexecutor.budget import BudgetDecision, recheck_remaining_budget
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

logger = logging.getLogger(__name__)


def reuse_discounted_charge(chunk: int, remaining: int, reusable: int) -> int:
    """Upstream's admission charge for a context chunk (DESIGN.md §1).

    A non-last chunk's window shifts with reuse but does not shrink, so it is charged in
    full; a chunk that reaches the end is charged only the part reuse does not cover.
    """
    if reusable <= 0 or reusable + chunk < remaining:
        charge = chunk
    else:
        charge = max(0, remaining - reusable)
    return max(charge, 1)


class TokenBudgetPolicy:
    """Base policy = upstream's behaviour: discounted admission, no later guard."""

    name: ClassVar[TokenBudgetPolicyName]
    claims_safety: ClassVar[bool] = False

    def __init__(self, max_num_tokens: int, *, enable_chunked_prefill: bool, tokens_per_block: int) -> None:
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.tokens_per_block = tokens_per_block

    def context_charge(self, request: LlmRequest, kv_cache_manager: "KVCacheManager") -> int:
        """Tokens the scheduler charges for ``request``'s current ``context_chunk_size``."""
        reusable = 0 if kv_cache_manager.is_allocated(request) else request.estimated_reusable_tokens
        return reuse_discounted_charge(request.context_chunk_size, request.context_remaining_length, reusable)

    def generation_charge(self, request: LlmRequest) -> int:
        return request.beam_width + request.num_draft_tokens

    def before_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        """Runs at the start of ``KVCacheManager.prepare_resources``, before any claim."""

    def after_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        """Runs at the end of ``prepare_resources``, once every block is in place."""

    def before_inputs(self, scheduled: "ScheduledRequests") -> None:
        """Runs at the top of ``_prepare_tp_inputs``."""


class NoTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.NONE


class TrimTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.TRIM

    @staticmethod
    def predicted_positions(request: LlmRequest) -> int:
        """The proposal's count: a generation request is 1 + drafts, whatever its beams or first-draft padding."""
        if request.is_context_init_state:
            return forward_cost(request)
        return 1 + request.num_draft_tokens

    def before_inputs(self, scheduled: "ScheduledRequests") -> None:
        excess = sum(map(self.predicted_positions, scheduled.all_requests)) - self.max_num_tokens
        for request in reversed(list(scheduled.context_requests)):
            if excess <= 0:
                break
            before = forward_cost(request)
            request.context_chunk_size = max(0, request.context_chunk_size - excess)
            excess -= before - forward_cost(request)
            if request.context_chunk_size == 0:
                scheduled.defer(request, DeferReason.BUDGET)


class FitTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.FIT

    def after_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        if not self.enable_chunked_prefill:
            return  # chunks are whole prompts: nothing it may shrink
        excess = sum(map(forward_cost, scheduled.all_requests)) - self.max_num_tokens
        if excess <= 0:
            return
        tpb = self.tokens_per_block
        # Last chunks first (they are the ones reuse most often fails to shrink), from the back.
        order = sorted(reversed(scheduled.context_requests), key=lambda r: not r.is_last_context_chunk)
        for request in order:
            if excess <= 0:
                break
            start = request.context_current_position
            end = start + request.context_chunk_size
            at_least = (start // tpb + 1) * tpb  # one block of progress, block-aligned
            new_end = max((end - excess) // tpb * tpb, at_least)
            if new_end >= end:
                continue
            before = forward_cost(request)
            request.context_chunk_size = new_end - start
            excess -= before - forward_cost(request)
        if excess > 0:
            logger.debug("fit could not repair an overshoot of %d tokens", excess)


class RecheckTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.RECHECK
    claims_safety = True

    def context_charge(self, request: LlmRequest, kv_cache_manager: "KVCacheManager") -> int:
        # Full cost where it is known (allocated chunks) or owed (deferred requests);
        # upstream's discount otherwise: reuse usually materialises, and the re-check
        # catches the case where it does not.
        if request.py_budget_deferred or kv_cache_manager.is_allocated(request):
            return forward_cost(request, reuse_can_shift=kv_cache_manager.reuse_can_shift(request))
        return super().context_charge(request, kv_cache_manager)

    def generation_charge(self, request: LlmRequest) -> int:
        return forward_cost(request)

    def before_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        self._apply(recheck_remaining_budget(scheduled, self.max_num_tokens, kv_cache_manager), scheduled)

    @staticmethod
    def _apply(decision: BudgetDecision, scheduled: "ScheduledRequests") -> None:
        for request in decision.admitted:
            if request.consecutive_budget_deferrals:
                request.consecutive_budget_deferrals = 0
        for request in decision.deferred:
            logger.debug(
                "request %d deferred: its full cost does not fit the remaining budget %d",
                request.request_id,
                decision.remaining_budget,
            )
            scheduled.defer(request, DeferReason.BUDGET)

    def after_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        for request in scheduled.context_requests:
            request.py_budget_deferred = False  # allocated: its priority is spent


class ClaimTokenBudget(RecheckTokenBudget):
    name = TokenBudgetPolicyName.CLAIM

    def before_allocation(self, scheduled: "ScheduledRequests", kv_cache_manager: "KVCacheManager") -> None:
        # Pin every prefix before anything allocates: from here on no allocation in this
        # batch can evict what a later request claimed, so its post-reuse cost is exact.
        for request in scheduled.context_requests:
            if not kv_cache_manager.is_allocated(request):
                kv_cache_manager.claim_prefix(request)
        decision = recheck_remaining_budget(scheduled, self.max_num_tokens, kv_cache_manager)
        for request in decision.deferred:
            kv_cache_manager.release_claim(request)  # back to exactly how it was scheduled
        self._apply(decision, scheduled)


_POLICIES: dict[TokenBudgetPolicyName, type[TokenBudgetPolicy]] = {
    policy.name: policy
    for policy in (NoTokenBudget, TrimTokenBudget, FitTokenBudget, RecheckTokenBudget, ClaimTokenBudget)
}


def make_token_budget_policy(
    name: TokenBudgetPolicyName | str, max_num_tokens: int, *, enable_chunked_prefill: bool, tokens_per_block: int
) -> TokenBudgetPolicy:
    policy = _POLICIES[TokenBudgetPolicyName(name)]
    return policy(max_num_tokens, enable_chunked_prefill=enable_chunked_prefill, tokens_per_block=tokens_per_block)
