"""Token-budget policies: how the executor keeps a forward within ``max_num_tokens``.

A policy decides and returns values; it never allocates and never writes a request. Its
three decisions come in iteration order: the scheduler's admission charges
(:meth:`~TokenBudgetPolicy.context_charge`, :meth:`~TokenBudgetPolicy.generation_charge`),
the re-check before allocation (:meth:`~TokenBudgetPolicy.before_allocation`), and the
fix-ups once the blocks are in place (:meth:`~TokenBudgetPolicy.after_allocation`).
``ResourceManager.prepare_resources`` sequences the last two around the KV manager's
allocation. Only ``recheck`` and ``claim`` claim safety.

=========  ==========================================================================
none       upstream before any fix: reuse-discounted admission, nothing after it
trim       closed upstream proposal: predict the total just before the inputs are built
           and shrink trailing context chunks; its prediction misses beam width and
           first-draft padding (its own review said so)
fit        upstream's merged approach: after allocation, shrink context chunks (last
           chunks first, block-aligned, at least one block of progress) until the batch
           fits; cannot repair generation-only overshoot or runs without chunked prefill
recheck    ours: :func:`recheck_remaining_budget` before any allocation; with chunked
           prefill a first chunk that overflows is cut to the largest block-aligned size
           that fits, and only one for which not even a unit fits is deferred; the
           scheduler charges deferred requests at full cost
claim      ours, claim-then-charge: the caller first pins (claims) every first chunk's
           matched prefix for the whole batch, then the same re-check runs on exact
           post-reuse costs — nothing can evict a pinned prefix, so no budget is spent on
           reuse that does materialise
=========  ==========================================================================
"""

from __future__ import annotations

import logging
from typing import ClassVar, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.budget.recheck import (
    BudgetDecision,
    recheck_by_priority,
    recheck_remaining_budget,
)
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, Deferral, ScheduledRequests

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
    #: claim-then-charge: ``prepare_resources`` pins every first chunk's prefix before the re-check
    claims_prefixes: ClassVar[bool] = False

    def __init__(
        self,
        max_num_tokens: int,
        *,
        enable_chunked_prefill: bool,
        tokens_per_block: int,
        chunk_unit_size: int | None = None,
        enable_block_reuse: bool = True,
        order: PriorityOrder | None = None,
    ) -> None:
        """``order``: the priority order the re-check cuts and defers by (None: fcfs, scheduler order)."""
        self.max_num_tokens = max_num_tokens
        self.order = order
        self.enable_chunked_prefill = enable_chunked_prefill
        self.tokens_per_block = tokens_per_block
        self.chunk_unit_size = chunk_unit_size or tokens_per_block
        self.enable_block_reuse = enable_block_reuse

    def context_charge(self, request: LlmRequest, chunk: int, reusable: int | None) -> int:
        """Tokens the scheduler charges for the next ``chunk`` prompt tokens of ``request``.

        ``reusable`` is upstream's reuse estimate for a first chunk (not yet allocated),
        None for a request that holds its blocks. Pure: the scheduler's search calls it
        for every size it tries.
        """
        remaining = request.prompt_len - request.context_current_position
        return reuse_discounted_charge(min(chunk, remaining), remaining, reusable or 0)

    @staticmethod
    def generation_charge(request: LlmRequest) -> int:
        return request.beam_width + len(request.py_draft_tokens)

    def before_allocation(
        self,
        generation: Sequence[LlmRequest],
        later_chunks: Sequence[ContextChunk],
        first_chunks: Sequence[ContextChunk],
        *,
        prefixes_claimed: bool,
        estimated_reusable: Mapping[int, int] | None = None,
        generation_cost: int | None = None,
    ) -> BudgetDecision | None:
        """The re-check before any allocation; None admits the batch as scheduled.

        ``estimated_reusable`` and ``generation_cost`` are the scheduler's (see
        ``ScheduledRequests``): reuse estimates, and what it charged the generation steps.
        """
        return None

    def after_allocation(self, scheduled: ScheduledRequests) -> tuple[ScheduledRequests, list[Deferral]]:
        """Fix-ups once every block is in place: the batch to run, and who left it."""
        return scheduled, []


class NoTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.NONE


class TrimTokenBudget(TokenBudgetPolicy):
    """Runs last, right before the inputs are built (upstream's proposal put it at the top
    of ``_prepare_tp_inputs``; nothing happens in between)."""

    name = TokenBudgetPolicyName.TRIM

    @staticmethod
    def predicted_positions(request: LlmRequest) -> int:
        """The proposal's count for a generation step: 1 + drafts, whatever its beams or first-draft padding."""
        return 1 + len(request.py_draft_tokens)

    def after_allocation(self, scheduled: ScheduledRequests) -> tuple[ScheduledRequests, list[Deferral]]:
        chunks = list(scheduled.context_chunks)
        predicted = sum(chunk.cost() for chunk in chunks) + sum(map(self.predicted_positions, scheduled.generation_requests))
        excess = predicted - self.max_num_tokens
        if excess <= 0:
            return scheduled, []
        deferred = []
        for index in reversed(range(len(chunks))):
            if excess <= 0:
                break
            chunk = chunks[index]
            trimmed = chunk.resized(max(0, chunk.size - excess))
            excess -= chunk.cost() - trimmed.cost()
            chunks[index] = trimmed
            if trimmed.size == 0:
                deferred.append(Deferral(chunk.request, DeferReason.BUDGET, chunk.cost()))
        kept = [chunk for chunk in chunks if chunk.size]
        return scheduled.with_batch(kept, scheduled.generation_requests), deferred


class FitTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.FIT

    def after_allocation(self, scheduled: ScheduledRequests) -> tuple[ScheduledRequests, list[Deferral]]:
        if not self.enable_chunked_prefill:
            return scheduled, []  # chunks are whole prompts: nothing it may shrink
        chunks = list(scheduled.context_chunks)
        excess = sum(chunk.cost() for chunk in chunks) + sum(map(forward_cost, scheduled.generation_requests))
        excess -= self.max_num_tokens
        if excess <= 0:
            return scheduled, []
        tpb = self.tokens_per_block
        # Last chunks first (they are the ones reuse most often fails to shrink), from the back.
        order = sorted(reversed(range(len(chunks))), key=lambda i: not chunks[i].is_last)
        for index in order:
            if excess <= 0:
                break
            chunk = chunks[index]
            at_least = (chunk.start // tpb + 1) * tpb  # one block of progress, block-aligned
            new_end = max((chunk.end - excess) // tpb * tpb, at_least)
            if new_end >= chunk.end:
                continue
            shrunk = chunk.resized(new_end - chunk.start)
            excess -= chunk.cost() - shrunk.cost()
            chunks[index] = shrunk
        if excess > 0:
            logger.debug("fit could not repair an overshoot of %d tokens", excess)
        return scheduled.with_batch(chunks, scheduled.generation_requests), []


class RecheckTokenBudget(TokenBudgetPolicy):
    name = TokenBudgetPolicyName.RECHECK
    claims_safety = True
    #: with chunked prefill, cut an overflowing first chunk to what fits before deferring it
    cuts_chunks: ClassVar[bool] = True

    def context_charge(self, request: LlmRequest, chunk: int, reusable: int | None) -> int:
        # Full cost where it is known (allocated chunks) or owed (deferred requests);
        # upstream's discount otherwise: reuse usually materialises, and the re-check
        # catches the case where it does not.
        if reusable is None:
            return forward_cost(request, chunk)
        if request.py_budget_deferred:
            return forward_cost(request, chunk, reuse_can_shift=self.enable_block_reuse)
        return super().context_charge(request, chunk, reusable)

    generation_charge = staticmethod(forward_cost)  # exact: a step's cost cannot change before the forward

    def before_allocation(
        self,
        generation: Sequence[LlmRequest],
        later_chunks: Sequence[ContextChunk],
        first_chunks: Sequence[ContextChunk],
        *,
        prefixes_claimed: bool,
        estimated_reusable: Mapping[int, int] | None = None,
        generation_cost: int | None = None,
    ) -> BudgetDecision:
        options = dict(
            reuse_can_shift=self.enable_block_reuse and not prefixes_claimed,
            cut_unit=self.chunk_unit_size if self.cuts_chunks and self.enable_chunked_prefill else 0,
            tokens_per_block=self.tokens_per_block,
            estimated_reusable=estimated_reusable,
            # this policy charges a generation step its exact forward cost: the sum carries over
            generation_cost=generation_cost,
        )
        if self.order is not None:  # lowest-ranked cut and deferred first
            decision = recheck_by_priority(generation, later_chunks, first_chunks, self.max_num_tokens,
                                           self.order.key, **options)
        else:
            decision = recheck_remaining_budget(generation, later_chunks, first_chunks, self.max_num_tokens, **options)
        for request, cost in decision.deferred:
            logger.debug(
                "request %d deferred: its full cost %d does not fit the remaining budget %d",
                request.request_id,
                cost,
                decision.remaining_budget,
            )
        return decision


class ClaimTokenBudget(RecheckTokenBudget):
    name = TokenBudgetPolicyName.CLAIM
    claims_prefixes = True


_POLICIES: dict[TokenBudgetPolicyName, type[TokenBudgetPolicy]] = {
    policy.name: policy
    for policy in (NoTokenBudget, TrimTokenBudget, FitTokenBudget, RecheckTokenBudget, ClaimTokenBudget)
}


def make_token_budget_policy(
    name: TokenBudgetPolicyName | str,
    max_num_tokens: int,
    *,
    enable_chunked_prefill: bool,
    tokens_per_block: int,
    chunk_unit_size: int | None = None,
    enable_block_reuse: bool = True,
    order: PriorityOrder | None = None,
) -> TokenBudgetPolicy:
    policy = _POLICIES[TokenBudgetPolicyName(name)]
    return policy(
        max_num_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        tokens_per_block=tokens_per_block,
        chunk_unit_size=chunk_unit_size,
        enable_block_reuse=enable_block_reuse,
        order=order,
    )


def token_budget_policy_for(config: ExecutorConfig) -> TokenBudgetPolicy:
    """The policy an executor with ``config`` runs."""
    kv = config.kv_cache_config
    return make_token_budget_policy(
        config.token_budget_policy,
        config.max_num_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        tokens_per_block=kv.tokens_per_block,
        chunk_unit_size=config.chunk_unit_size,
        enable_block_reuse=kv.enable_block_reuse,
        order=PriorityOrder.of(config.scheduler_config),
    )
