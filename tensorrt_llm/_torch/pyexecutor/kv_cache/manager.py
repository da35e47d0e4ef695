"""``KVCacheManager``: per-request block tables over a :class:`BlockPool`, with prefix reuse.

The KV manager answers questions about memory and allocates; it knows nothing of token
budgets. It has a few verbs, in vLLM's shape, and queries that change nothing::

    match(request) ─► PrefixMatch                 what a waiting prompt matches now (nothing claimed)
    claim_prefix(request) ─► PrefixClaim          pin it ahead of the allocation (claim-then-charge)
    allocate(chunk, claim) ─► Allocation | None   one request's blocks, all or nothing
    prepare_resources(scheduled) ─► KVAllocation  a batch, request after request (upstream's name)
    commit(scheduled)                             after a forward: computed full blocks join the tree
    free(request)                                 every block back, leaves first

It composes three parts, each a module of its own, and owns none of their state::

    KVCacheManager ─┬─ prefix:    PrefixReuse     (prefix_reuse)     match, claim, commit to the tree
                    ├─ sequences: SequenceBlocks  (sequence_blocks)  each request's blocks, growth, beams
                    └─ pool:      BlockPool       (block_pool)       slots, references, LRU, host tier
                                                                     └─ tree: PrefixTree (prefix_tree)

A block's life, and who holds it::

    claimed ──────► held by one sequence ──commit──► tree node, shared ──free──► cached ──► evicted
    (the claim's      (private: allocate,             (any sequence that         (LRU, no holder:
     reference)        a later chunk, a step)          matched it holds it)       host tier or gone)

* ``allocate(chunk, claim)``: a first chunk claims what matches (at most ``prompt_len - 1``
  tokens: the last prompt token is always computed, to get logits), onboards host blocks, copies
  a partly matching block and allocates fresh blocks for the whole prompt; its chunk window
  moves onto the reused prefix. A later chunk, or a generation step, grows its sequence. None
  when the blocks cannot be had, and then nothing stays claimed.
* The capacity scheduler's block counts are queries: ``blocks_needed`` (a waiting request, less
  what ``match`` says it shares), ``step_needs`` (started ones), ``available_blocks``; the finer
  ones are the sequences' (``reserved_blocks``, ``releasable_blocks``, ``split_allocated``).
* ``ResourceManager`` calls ``prepare_resources``, ``commit`` and ``free`` from upstream's
  ``prepare_resources``, ``update_resources`` and ``free_resources``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.block import BlockTokens
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVCacheEventBuffer
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_reuse import PrefixIndex, PrefixReuse
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import content_hashes, pack_tokens
from tensorrt_llm._torch.pyexecutor.kv_cache.sequence_blocks import (
    SequenceBlocks,
    blocks_for_tokens,
    ceil_div,
    max_sequence_len,
)
from tensorrt_llm._torch.pyexecutor.kv_cache.values import (
    NO_MATCH,
    STEP,
    Allocation,
    ClaimRecord,
    KVAllocation,
    PrefixClaim,
    PrefixMatch,
    StepNeed,
)
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests

if TYPE_CHECKING:  # the tensors: only engines that run a model read them (the KV manager imports no torch)
    from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

__all__ = [  # the values live in .values, the keys in .prefix_tree, the index in .prefix_reuse
    "NO_MATCH", "Allocation", "ClaimRecord", "KVAllocation", "KVCacheManager", "PrefixClaim", "PrefixIndex",
    "PrefixMatch", "StepNeed", "content_hashes", "pack_tokens",
]

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Block tables, prefix reuse and the host tier; optionally backed by real K/V tensors.

    ``storage`` is None in bookkeeping-only mode (simulation): every decision is the same,
    only no tensor moves. ``block_hash`` keys the prefix tree: a function of a block's packed
    tokens (:data:`~.block.BlockTokens`), for tests that force collisions. The default
    (``None``) is :func:`~.prefix_tree.content_hashes`, computed for a whole prompt at once and
    the same in every process, which tensor-parallel ranks rely on to take identical decisions
    (Python's ``hash`` of bytes is salted per process: do not pass it where ranks must agree).

    ``events`` (the pool's, :mod:`.events`): a buffer of ``config.event_buffer_max_size``
    events, made here when that is above 0; None when events are off.
    """

    def __init__(
        self,
        config: KvCacheConfig,
        *,
        num_blocks: int,
        num_host_blocks: int = 0,
        storage: KVCacheStorage | None = None,
        block_hash: Callable[[BlockTokens], int] | None = None,
    ) -> None:
        if config.offload_ahead_blocks >= num_blocks:
            raise ValueError(f"KvCacheConfig.offload_ahead_blocks={config.offload_ahead_blocks} must be below the"
                             f" pool's {num_blocks} blocks")
        if config.offload_ahead_blocks and not num_host_blocks:
            raise ValueError(f"KvCacheConfig.offload_ahead_blocks={config.offload_ahead_blocks} needs a host tier of at"
                             f" least one block; host_cache_size={config.host_cache_size} bytes holds none")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.enable_block_reuse = config.enable_block_reuse
        self.enable_partial_reuse = config.enable_block_reuse and config.enable_partial_reuse
        self.storage = storage
        self.block_hash = block_hash
        self.events = KVCacheEventBuffer(config.event_buffer_max_size) if config.event_buffer_max_size else None
        self.pool = BlockPool(num_blocks, num_host_blocks, storage=storage, events=self.events)
        self.sequences = SequenceBlocks(self.pool, self.tokens_per_block)
        self.prefix = PrefixReuse(self.pool, self.tokens_per_block, enabled=self.enable_block_reuse,
                                  partial=self.enable_partial_reuse, block_hash=block_hash,
                                  started=self.sequences.held)

    # ---- queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation could obtain now: free ones and cached ones it may evict."""
        return self.pool.available

    def is_allocated(self, request: LlmRequest) -> bool:
        return request.request_id in self.sequences.held

    def block_table(self, request: LlmRequest) -> list[int]:
        """The block ids of ``request``'s sequence (beam 0's), position ``p`` in block ``p // tokens_per_block``."""
        return list(self.sequences.held[request.request_id].table)

    def match(self, request: LlmRequest) -> PrefixMatch:
        """What ``request``'s prompt matches now (:class:`PrefixMatch`); no match once it holds blocks.
        Nothing is claimed: the capacity scheduler asks it for every waiting request it admits.

        Upstream's pre-allocation estimate: full prompt blocks that exactly match cached blocks,
        either tier, with no ``prompt_len - 1`` limit and no regard for what allocation may evict
        first (the gap between it and the claim is what the re-check is for)."""
        return self.prefix.match(request)

    def blocks_needed(self, request: LlmRequest, match: PrefixMatch = NO_MATCH, *, to_completion: bool = True) -> int:
        """Blocks a request that holds none needs: for its whole sequence to completion (draft
        slots and beams included), or for its prompt only; less the blocks ``match`` says it
        would share with started requests (those need no pool slot)."""
        length = max_sequence_len(request) if to_completion else request.prompt_len
        return max(0, blocks_for_tokens(request, length, self.tokens_per_block) - match.shared_blocks)

    def step_needs(self, started: Sequence[LlmRequest]) -> list[StepNeed]:
        """Each request that holds blocks, in the order they started (MAX_UTILIZATION pauses the
        latest): the blocks its next forward still needs and the blocks it holds."""
        return self.sequences.step_needs(started)

    # ---- verbs ----------------------------------------------------------------------
    def claim_prefix(self, request: LlmRequest) -> PrefixClaim:
        """Pin the reusable prefix of an unallocated first chunk (claim-then-charge): the chunk's
        window, moved onto ``claim.reused`` (:meth:`ContextChunk.after_reuse`), then has an exact
        forward cost. :meth:`allocate` consumes the claim; :meth:`release_claim` undoes it."""
        assert request.request_id not in self.sequences.held, f"{request!r} is already allocated"
        return self.prefix.claim(request)

    def release_claim(self, claim: PrefixClaim) -> None:
        """Unpin a claim: the pool is left exactly as before it."""
        self.prefix.release(claim)

    def allocate(self, work: ContextChunk | LlmRequest, claim: PrefixClaim | None = None) -> Allocation | None:
        """Blocks for one request's next forward, all or nothing; None when they cannot be had
        (what it held is unchanged, and nothing stays claimed for it).

        ``work`` is a context chunk, or a generation request (its next step, drafts included).
        A first chunk claims its reusable prefix, or takes ``claim`` (pinned by
        :meth:`claim_prefix`; the chunk must already start at it, and the claim is consumed
        either way), onboards it and allocates the rest of the prompt; the :class:`Allocation`
        carries the chunk moved onto the reused prefix. A later chunk grows to its end.
        """
        sequences = self.sequences
        if not isinstance(work, ContextChunk):
            return STEP if sequences.grow_step(work) else None
        request, tpb = work.request, self.tokens_per_block
        if request.request_id in sequences.held:
            return Allocation(work) if sequences.grow(request, work.start + work.cost()) else None
        if claim is None:
            claim = self.claim_prefix(request)
            work = work.after_reuse(claim.reused, tpb)
        elif work.reused != claim.reused:
            raise ValueError(f"{work!r} does not start at its claim of {claim.reused} tokens")
        needed_len = max(request.prompt_len, work.start + work.cost())
        taken = self.prefix.take(claim, blocks_for_tokens(request, needed_len, tpb), ceil_div(needed_len, tpb))
        if taken is None:
            return None
        blocks, beam_blocks, onboarded = taken
        sequences.start(request, blocks, len(claim.chain), claim.reused, beam_blocks)
        return Allocation(work, first=True, onboarded=onboarded)

    def prepare_resources(
        self, scheduled: ScheduledRequests, claims: Mapping[int, PrefixClaim] | None = None
    ) -> KVAllocation:
        """Allocate the batch, one request after another in batch order (:meth:`allocate` each).

        ``claims`` are prefixes already pinned by :meth:`claim_prefix`, by request id; such
        a first chunk's window must already start at its claim. Every claim handed in is
        consumed: allocated, or released with its request deferred.
        """
        claims = claims or {}
        chunks: list[ContextChunk] = []
        deferred: list[LlmRequest] = []
        records: list[ClaimRecord] = []
        for chunk in scheduled.context_chunks:
            request = chunk.request
            allocation = self.allocate(chunk, claims.get(request.request_id))
            if allocation is None:
                logger.debug("request %d deferred: KV blocks unavailable", request.request_id)
                deferred.append(request)
                continue
            chunks.append(allocation.chunk)
            if allocation.first:
                estimate = scheduled.estimated_reusable.get(request.request_id, 0)
                records.append(ClaimRecord(request, estimate, allocation.chunk.reused, request.prompt_len,
                                           allocation.onboarded * self.tokens_per_block))
        generation = scheduled.generation_requests
        # Most steps need no block: a one-beam step without drafts (plain, or speculative in an
        # iteration without drafts) whose blocks already cover its next position. Only the
        # others allocate, in batch order.
        room = self.sequences.step_room
        growing = [r for r in generation
                   if len(r.tokens) > room[r.request_id] or r.py_draft_tokens or r.is_first_draft]
        if growing:
            short = set()
            for request in growing:
                if self.allocate(request) is None:
                    logger.debug("request %d deferred: KV blocks unavailable", request.request_id)
                    deferred.append(request)
                    short.add(request.request_id)
            if short:
                generation = [r for r in generation if r.request_id not in short]
        return KVAllocation(scheduled.with_batch(chunks, list(generation)), deferred, records)

    def commit(self, scheduled: ScheduledRequests) -> None:
        """Record the KV the forward of ``scheduled`` computed, commit newly full blocks to the
        prefix tree (reuse on) and release blocks that held only rejected drafts."""
        self.sequences.record_forward(scheduled, self.prefix.commit_blocks if self.enable_block_reuse else None)

    def free(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        """Release every block ``request`` holds (or its outstanding claim); its computed full
        blocks stay cached for reuse."""
        held = self.sequences.held.get(request.request_id)
        if held is not None and store_for_reuse and self.enable_block_reuse:
            self.prefix.commit_blocks([(request, held)])
        self.prefix.forget(request)
        if held is not None:
            self.sequences.release(request)

    def offload_ahead(self) -> int:
        """Keep ``KvCacheConfig.offload_ahead_blocks`` primary blocks free: move least recently used
        cached blocks to the host tier and start their copies now; returns how many moved (0: the
        reserve is off, already free, or nothing cached is left).

        The executor calls it after each launch. An allocation that finds free slots moves
        nothing, so the tier's device-to-host copies then run beside the forward just launched
        rather than right before the forward whose allocation would have evicted them (on CUDA
        that forward waits, on the device, for every copy issued before it). Only unreferenced
        blocks move, never one that a forward in flight or a claim holds; they stay in the
        prefix tree, matchable from the host."""
        reserve = self.config.offload_ahead_blocks
        if not reserve or self.pool.num_free >= reserve:
            return 0
        moved = self.pool.offload_until(reserve)
        if moved and self.storage is not None:
            self.storage.flush()
        return moved

    def reset_prefix_cache(self) -> bool:
        """Empty the reuse index, both tiers (``BlockPool.reset_prefix_cache``); False, changing
        nothing, while a started request or a claim holds a cached block."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """The leak oracle: free + cached + held partition the pool; no request holds a foreign
        block; every sequence's table, room, beams and the reserved total are in step."""
        held = [b for seq in self.sequences.held.values() for b in (*seq.blocks, *seq.beam_blocks)]
        held += [b for claim in self.prefix.claims.values() for b in claim.pinned]
        self.pool.check_integrity(held)
        self.sequences.check()
