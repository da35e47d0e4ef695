"""``ResourceManager``: every per-request resource under one prepare / update / free lifecycle,
and the place where the token budget meets KV allocation.

``prepare_resources`` runs three steps, each a call that takes values and returns values::

    ScheduledRequests ──► policy.before_allocation ──► BudgetDecision      (the re-check; cuts, defers)
                          KVCacheManager.prepare_resources ──► KVAllocation (claims, allocates; defers)
                          policy.after_allocation ──► batch + deferrals  (fit / trim fix-ups)
                      ──► PreparedBatch: the batch that runs, who left it and why, what was claimed

The KV manager answers questions and allocates; the token-budget policy decides; this
module sequences them, so neither calls the other. Under claim-then-charge it first pins
every first chunk's prefix (``KVCacheManager.claim_prefix``) and hands the claims to the
re-check as shifted chunk windows, then to the allocation.

The KV cache manager is a named field, with its own verbs (``allocate`` through its batch form
``prepare_resources``, ``commit``, ``free``): upstream's ``update_resources`` and
``free_resources`` are this class's, which call them. Every other
manager (:meth:`ResourceManager.add_resource_manager`) is a :class:`ResourceObserver`: one
interface, one signature per phase. Observers are prepared after allocation, with the
:class:`PreparedBatch` itself (what runs and what left it), in registration order; updated
after the KV manager; freed before it, in reverse order, as upstream frees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tensorrt_llm._torch.pyexecutor.budget.recheck import BudgetDecision
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.kv_cache.values import ClaimRecord, PrefixClaim
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, Deferral, ScheduledRequests
from tensorrt_llm._torch.pyexecutor.budget.policies import TokenBudgetPolicy

KV_CACHE_MANAGER = "kv_cache_manager"  # upstream's name: get_resource_manager(KV_CACHE_MANAGER) is the KV manager


class ResourceObserver(Protocol):
    """A per-request resource beside the KV cache, following its lifecycle."""

    def prepare_resources(self, prepared: "PreparedBatch") -> None:
        """After allocation: ``prepared`` is the batch that runs, who left it and why."""

    def update_resources(self, scheduled: ScheduledRequests) -> None:
        """After the forward of ``scheduled`` completed."""

    def free_resources(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        """``request`` is over (or starts over): release what it holds."""


BaseResourceManager = ResourceObserver  # upstream's name for a manager beside the KV cache


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """What ``prepare_resources`` returns.

    ``scheduled`` is the batch that runs: chunks cut by the re-check and moved onto reused
    prefixes by allocation, deferred requests out. ``deferred`` are the requests that left
    it, untouched (unless a fix-up deferred them after allocation: ``trim``), in the order
    they left. ``claims`` say, per first chunk allocated, the reuse it was admitted with and
    the reuse it got. ``budget`` is the re-check (None under a policy without one).
    """

    scheduled: ScheduledRequests
    deferred: list[Deferral]
    claims: list[ClaimRecord]
    budget: BudgetDecision | None = None


class ResourceManager:
    """The KV cache manager, the token-budget policy, and the observers registered beside them."""

    def __init__(self, kv_cache_manager: KVCacheManager, token_budget: TokenBudgetPolicy) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.token_budget = token_budget
        self.observers: dict[str, ResourceObserver] = {}

    def get_resource_manager(self, name: str) -> KVCacheManager | ResourceObserver:
        """Upstream's lookup: the KV manager under ``KV_CACHE_MANAGER``, an observer by its name."""
        return self.kv_cache_manager if name == KV_CACHE_MANAGER else self.observers[name]

    def add_resource_manager(self, name: str, observer: ResourceObserver) -> None:
        """Register ``observer`` after the others: it is prepared after allocation (with the
        prepared batch), updated after the KV manager and freed before it."""
        if name == KV_CACHE_MANAGER or name in self.observers:
            raise ValueError(f"a resource manager named {name!r} is already registered")
        self.observers[name] = observer

    def prepare_resources(self, scheduled: ScheduledRequests) -> PreparedBatch:
        """Re-check the budget, allocate what it admits, apply the fix-ups; see the module docstring."""
        kv, policy = self.kv_cache_manager, self.token_budget
        later: list[ContextChunk] = []
        first: list[ContextChunk] = []
        for chunk in scheduled.context_chunks:
            (later if kv.is_allocated(chunk.request) else first).append(chunk)
        claims: dict[int, PrefixClaim] = {}
        if policy.claims_prefixes:
            # Pin every prefix before anything allocates: from here on no allocation in this
            # batch can evict what a later request claimed, so its post-reuse cost is exact.
            for index, chunk in enumerate(first):
                claim = claims[chunk.request.request_id] = kv.claim_prefix(chunk.request)
                first[index] = chunk.after_reuse(claim.reused, kv.tokens_per_block)
        decision = policy.before_allocation(
            scheduled.generation_requests,
            later,
            first,
            prefixes_claimed=policy.claims_prefixes,
            estimated_reusable=scheduled.estimated_reusable,
            generation_cost=scheduled.generation_charge,
        )
        deferred: list[Deferral] = []
        to_allocate = scheduled
        if decision is not None:
            for request, cost in decision.deferred:
                deferred.append(Deferral(request, DeferReason.BUDGET, cost))
                claim = claims.pop(request.request_id, None)
                if claim is not None:
                    kv.release_claim(claim)  # back to exactly how it was scheduled
            admitted = decision.chunks
            to_allocate = scheduled.with_batch(
                [admitted[c.request.request_id] for c in scheduled.context_chunks if c.request.request_id in admitted],
                decision.generation,
            )
        allocation = kv.prepare_resources(to_allocate, claims)
        deferred += [Deferral(request, DeferReason.CAPACITY) for request in allocation.deferred]
        batch, fixed_up = policy.after_allocation(allocation.scheduled)
        deferred += fixed_up
        prepared = PreparedBatch(batch, deferred, allocation.claims, decision)
        for observer in self.observers.values():
            observer.prepare_resources(prepared)
        return prepared

    def update_resources(self, scheduled: ScheduledRequests) -> None:
        """After the forward of ``scheduled``: the KV manager commits what it computed, then the observers."""
        self.kv_cache_manager.commit(scheduled)
        for observer in self.observers.values():
            observer.update_resources(scheduled)

    def free_resources(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        """``request`` is over (or starts over): the observers release theirs, then the KV manager frees its blocks."""
        for observer in reversed(self.observers.values()):
            observer.free_resources(request, store_for_reuse=store_for_reuse)
        self.kv_cache_manager.free(request, store_for_reuse=store_for_reuse)
