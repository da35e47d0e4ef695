"""``KVCacheManager``: per-request block tables over a :class:`BlockPool`, with prefix reuse.

Lifecycle per iteration (upstream's resource-manager protocol):

* ``prepare_resources(scheduled)``: first the token-budget policy's pre-allocation hook
  (the remaining_budget re-check), then allocation, one request after another in batch
  order, then the policy's post-allocation hook. A first chunk walks the prefix tree,
  claims what matches (at most ``prompt_len - 1`` tokens: the last prompt token is always
  computed, to get logits), copies a partly matching block (partial reuse), onboards host
  blocks, and allocates fresh blocks for the whole prompt. Allocation is all-or-nothing
  per request: if its blocks cannot be had, it is deferred and nothing stays claimed.
* ``update_resources(scheduled)``: after a forward, full blocks that now hold computed KV
  are committed to the prefix tree, so later requests can reuse them.
* ``free_resources(request)``: blocks go back, leaves first, so that LRU eviction takes the
  deepest blocks of a prefix before its root.

``estimate_reusable_tokens`` is upstream's pre-allocation estimate: full prompt blocks that
exactly match cached blocks (either tier), with no ``prompt_len - 1`` limit and no regard
for what allocation may evict first. The gap between it and the claim is the bug.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tensorrt_llm._torch.pyexecutor.block_pool import BlockPool, BlockTokens, KVBlock
from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._torch.pyexecutor.token_budget import TokenBudgetPolicy

logger = logging.getLogger(__name__)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Sequence:
    """The blocks one request holds. ``blocks[:num_committed]`` are tree nodes."""

    blocks: list[KVBlock]
    num_committed: int
    num_computed: int  # tokens whose KV is written
    beam_blocks: list[KVBlock] = field(default_factory=list)  # private tails of beams 1..W-1
    stamp: int = 0  # allocation order
    # block_id of each of ``blocks``, kept in step with it: a held block never changes slot,
    # so the table only changes where ``blocks`` does (append, commit to a canonical block).
    table: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.table = [block.block_id for block in self.blocks]


@dataclass(slots=True)
class PrefixClaim:
    """A first chunk's pinned reusable prefix, between the claim and the allocation."""

    saved: tuple[int, int, int]  # (context_current_position, context_chunk_size, prepopulated_prompt_len)
    chain: list[KVBlock] = field(default_factory=list)  # matched full blocks, either tier
    partial: KVBlock | None = None  # primary block to copy a partial match from
    partial_len: int = 0
    reused: int = 0

    @property
    def pinned(self) -> list[KVBlock]:
        return self.chain + ([self.partial] if self.partial is not None else [])


@dataclass(slots=True)
class ClaimRecord:
    """What allocation found for a first chunk: the estimate it was admitted with and the claim."""

    request_id: int
    estimated_reusable_tokens: int
    reused_tokens: int


class KVCacheManager:
    """Block tables, prefix reuse and the host tier; optionally backed by real K/V tensors.

    ``storage`` is None in bookkeeping-only mode (simulation): every decision is the same,
    only no tensor moves.
    """

    def __init__(
        self,
        config: KvCacheConfig,
        *,
        num_blocks: int,
        num_host_blocks: int = 0,
        storage: KVCacheStorage | None = None,
        block_hash: Callable[[BlockTokens], int] = hash,
        token_budget: "TokenBudgetPolicy | None" = None,
    ) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.enable_block_reuse = config.enable_block_reuse
        self.enable_partial_reuse = config.enable_block_reuse and config.enable_partial_reuse
        self.storage = storage
        self.pool = BlockPool(num_blocks, num_host_blocks, storage=storage, block_hash=block_hash)
        self.token_budget = token_budget
        self._sequences: dict[int, _Sequence] = {}
        self._keys: dict[int, tuple[int, list[tuple[int, BlockTokens]]]] = {}
        # Waiting requests' matched chains from the last admission walk, keyed like _keys.
        self._matches: dict[int, tuple[int, list[KVBlock]]] = {}
        self._stamps = itertools.count()
        self._claims: dict[int, PrefixClaim] = {}
        self.last_claims: list[ClaimRecord] = []  # first chunks allocated in the last prepare_resources

    # ---- queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def is_allocated(self, request: LlmRequest) -> bool:
        return request.request_id in self._sequences

    def reuse_can_shift(self, request: LlmRequest) -> bool:
        """True while allocation may still move this request's chunk window (unclaimed first chunk, reuse on)."""
        rid = request.request_id
        return self.enable_block_reuse and rid not in self._sequences and rid not in self._claims

    def num_held_blocks(self, request: LlmRequest) -> int:
        seq = self._sequences.get(request.request_id)
        return 0 if seq is None else len(seq.blocks) + len(seq.beam_blocks)

    def block_table(self, request: LlmRequest) -> list[int]:
        return list(self._sequences[request.request_id].table)

    def num_computed_tokens(self, request: LlmRequest) -> int:
        seq = self._sequences.get(request.request_id)
        return 0 if seq is None else seq.num_computed

    def blocks_for_tokens(self, request: LlmRequest, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` positions holds, beams included."""
        blocks = _ceil_div(num_tokens, self.tokens_per_block)
        if request.beam_width > 1:  # beams share full prompt blocks and own everything after
            blocks += (request.beam_width - 1) * max(0, blocks - request.prompt_len // self.tokens_per_block)
        return blocks

    def max_sequence_len(self, request: LlmRequest) -> int:
        """Positions a request may hold before it finishes, draft slots included."""
        return request.max_total_len + max(request.max_draft_len, request.num_draft_tokens)

    def blocks_to_completion(self, request: LlmRequest) -> int:
        return max(0, self.blocks_for_tokens(request, self.max_sequence_len(request)) - self.num_held_blocks(request))

    def blocks_for_next_step(self, request: LlmRequest) -> int:
        """Blocks an allocated request still needs for its next forward."""
        return max(0, self.blocks_for_tokens(request, self._step_len(request)) - self.num_held_blocks(request))

    def allocation_stamp(self, request: LlmRequest) -> int:
        """Order in which allocated requests started (MAX_UTILIZATION pauses the latest)."""
        return self._sequences[request.request_id].stamp

    def estimate_reusable_tokens(self, request: LlmRequest) -> int:
        """Upstream's admission estimate; also stored on the request."""
        estimate = 0
        if self.enable_block_reuse and request.request_id not in self._sequences:
            estimate = len(self.pool.match(self._prompt_keys(request))) * self.tokens_per_block
        request.estimated_reusable_tokens = estimate
        return estimate

    def estimate_admission(self, request: LlmRequest) -> int:
        """:meth:`estimate_reusable_tokens` (stored on the request) and :meth:`num_shared_blocks`
        (returned) from one walk of the prefix tree: the capacity scheduler needs both for
        every waiting request, every iteration."""
        if not self.enable_block_reuse or request.request_id in self._sequences:
            self._matches.pop(request.request_id, None)
            request.estimated_reusable_tokens = 0
            return 0
        chain = self._match_prompt(request)
        request.estimated_reusable_tokens = len(chain) * self.tokens_per_block
        # A claim matches at most prompt_len - 1 tokens; match() of a prefix of the keys is
        # the same prefix of the chain.
        claimable = chain[: (request.prompt_len - 1) // self.tokens_per_block]
        return sum(1 for block in claimable if block.ref_count > 0)

    def _match_prompt(self, request: LlmRequest) -> list[KVBlock]:
        """``pool.match`` of the prompt's keys, resumed from the request's previous match.

        Exact: a block leaves the tree only with its whole subtree, and a dropped block
        object never re-enters it, so the blocks of the old chain that were dropped since
        are a suffix of it (found by bisection); what was committed since is found by
        walking on from the last surviving block.
        """
        keys = self._prompt_keys(request)
        previous = self._matches.get(request.request_id)
        if previous is None or previous[0] != request.prompt_len:
            chain = self.pool.match(keys)
        else:
            chain = previous[1]
            if chain and not chain[-1].in_tree:
                del chain[bisect.bisect_left(chain, True, key=lambda block: not block.in_tree) :]
            chain += self.pool.match(keys, chain[-1] if chain else None, start=len(chain))
        self._matches[request.request_id] = (request.prompt_len, chain)
        return chain

    def num_shared_blocks(self, request: LlmRequest) -> int:
        """Prompt blocks a first-chunk claim would share with started requests (held: no pool slot)."""
        if not self.enable_block_reuse or request.request_id in self._sequences:
            return 0
        keys = self._prompt_keys(request)[: (request.prompt_len - 1) // self.tokens_per_block]
        return sum(1 for block in self.pool.match(keys) if block.ref_count > 0)

    # ---- lifecycle ------------------------------------------------------------------
    def prepare_resources(self, scheduled: "ScheduledRequests") -> None:
        """Re-check the budget, then allocate the admitted requests one after another."""
        if self.token_budget is not None:
            self.token_budget.before_allocation(scheduled, self)
        self.last_claims = []
        for request in (*scheduled.context_requests, *scheduled.generation_requests):
            if not self._allocate_step(request):
                logger.debug("request %d deferred: KV blocks unavailable", request.request_id)
                scheduled.defer(request, DeferReason.CAPACITY)
        if self.token_budget is not None:
            self.token_budget.after_allocation(scheduled, self)

    def update_resources(self, scheduled: "ScheduledRequests") -> None:
        """Record computed KV and commit newly full blocks to the prefix tree."""
        for request in (*scheduled.context_requests, *scheduled.generation_requests):
            seq = self._sequences.get(request.request_id)
            if seq is None or request.state is LlmRequestState.ERROR:
                continue  # a request that finished in this forward computed its KV: record it
            if request.is_context_init_state:
                seq.num_computed = request.context_current_position
            else:  # the newest sampled token has no KV yet
                seq.num_computed = len(request.tokens) - 1
            if self.enable_block_reuse:
                self._commit_full_blocks(request, seq)

    def free_resources(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        """Release every block ``request`` holds; computed full blocks stay cached for reuse."""
        self.release_claim(request)
        seq = self._sequences.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        if seq is None:
            return
        if store_for_reuse and self.enable_block_reuse:
            self._commit_full_blocks(request, seq)
        for block in reversed(seq.beam_blocks):
            self.pool.decref(block)
        for block in reversed(seq.blocks):  # leaves first: they become the oldest in LRU
            self.pool.decref(block)

    def check_integrity(self) -> None:
        """The leak oracle: free + cached + held partition the pool; no request holds a foreign block."""
        held = [b for seq in self._sequences.values() for b in (*seq.blocks, *seq.beam_blocks)]
        held += [b for claim in self._claims.values() for b in claim.pinned]
        self.pool.check_integrity(held)
        for request_id, seq in self._sequences.items():
            assert seq.table == [b.block_id for b in seq.blocks], f"request {request_id}: stale block table"

    # ---- allocation -----------------------------------------------------------------
    def _allocate_step(self, request: LlmRequest) -> bool:
        """Blocks for this iteration's positions of ``request``; all-or-nothing."""
        seq = self._sequences.get(request.request_id)
        if seq is None:
            return self._allocate_first_chunk(request)
        return self._grow(request, seq, self._step_len(request))

    @staticmethod
    def _step_len(request: LlmRequest) -> int:
        """Positions the sequence must hold for the next forward of an allocated request."""
        if request.is_context_init_state:
            return request.context_current_position + forward_cost(request)
        if request.beam_width > 1:  # each beam writes one position
            return len(request.tokens)
        return len(request.tokens) - 1 + forward_cost(request)  # the last token plus any drafts

    def _grow(self, request: LlmRequest, seq: _Sequence, needed_len: int) -> bool:
        shared = _ceil_div(needed_len, self.tokens_per_block) - len(seq.blocks)
        beam_total = self.blocks_for_tokens(request, needed_len) - _ceil_div(needed_len, self.tokens_per_block)
        beam = beam_total - len(seq.beam_blocks)
        missing = max(shared, 0) + max(beam, 0)
        if missing == 0:
            return True
        if missing > self.pool.available:
            return False
        for _ in range(max(shared, 0)):
            block = self.pool.allocate()
            seq.blocks.append(block)
            seq.table.append(block.block_id)
        for _ in range(max(beam, 0)):
            seq.beam_blocks.append(self.pool.allocate())
        return True

    # ---- prefix claims ---------------------------------------------------------------
    def claim_prefix(self, request: LlmRequest) -> PrefixClaim:
        """Pin the reusable prefix of an unallocated first chunk and shift its window onto it.

        The claim walks the prefix tree for at most ``prompt_len - 1`` tokens (the last
        prompt token is always computed, for its logits), pins the matched blocks so no
        allocation can evict them, and with partial reuse pins the primary block that
        shares the longest prefix with the next block. ``forward_cost(request)`` is then
        exact. Allocation consumes the claim; :meth:`release_claim` undoes it.
        """
        assert request.request_id not in self._sequences, f"{request!r} is already allocated"
        existing = self._claims.get(request.request_id)
        if existing is not None:
            return existing
        prompt_len, tpb = request.prompt_len, self.tokens_per_block
        claim_limit = prompt_len - 1
        claim = PrefixClaim(
            saved=(request.context_current_position, request.context_chunk_size, request.prepopulated_prompt_len)
        )
        if self.enable_block_reuse:
            claim.chain = self.pool.match(self._prompt_keys(request)[: claim_limit // tpb])
            if self.enable_partial_reuse and request.beam_width == 1:
                start = len(claim.chain) * tpb
                want = tuple(request.tokens[start : min(start + tpb, claim_limit)])
                if want:
                    parent = claim.chain[-1] if claim.chain else None
                    claim.partial, claim.partial_len = self.pool.match_partial(parent, want)
        for block in claim.pinned:
            self.pool.incref(block)  # pinned: no allocation can evict them now
        claim.reused = len(claim.chain) * tpb + claim.partial_len
        if claim.reused:
            self._shift_chunk_window(request, claim.reused)
        self._claims[request.request_id] = claim
        return claim

    def release_claim(self, request: LlmRequest) -> None:
        """Unpin a claim and restore the request's window: it is left exactly as before the claim."""
        claim = self._claims.pop(request.request_id, None)
        if claim is None:
            return
        # Leaves first, as free_resources does: a root released after its leaves stays
        # younger in LRU, so one eviction cannot drop the whole cached prefix.
        for block in reversed(claim.pinned):
            self.pool.decref(block)
        position, chunk, prepopulated = claim.saved
        request.prepopulated_prompt_len = prepopulated
        request.context_current_position = position
        request.context_chunk_size = chunk

    def _allocate_first_chunk(self, request: LlmRequest) -> bool:
        """Claim the reusable prefix (unless already claimed), onboard it, allocate the rest of the prompt."""
        claim = self.claim_prefix(request)
        chain, tpb = claim.chain, self.tokens_per_block
        needed_len = max(request.prompt_len, request.context_current_position + forward_cost(request))
        total = self.blocks_for_tokens(request, needed_len)
        to_onboard = sum(1 for block in chain if block.block_id is None)
        # A partial-match source pinned by this claim alone goes back to the cache once it is
        # copied into the first fresh block, so the rest of the allocation may take its slot.
        recycled = int(claim.partial is not None and claim.partial.ref_count == 1)
        needed = total - len(chain) + to_onboard
        if needed > self.pool.available + recycled or to_onboard + recycled > self.pool.available:
            self.release_claim(request)
            return False
        del self._claims[request.request_id]
        for block in chain:
            if block.block_id is None:
                self.pool.onboard(block)
        shared_total = _ceil_div(needed_len, tpb)
        fresh = [self.pool.allocate() for _ in range(min(1, shared_total - len(chain)))]
        if claim.partial is not None:
            self.pool.copy(claim.partial, fresh[0])
            self.pool.decref(claim.partial)
        fresh += [self.pool.allocate() for _ in range(shared_total - len(chain) - len(fresh))]
        beam_blocks = [self.pool.allocate() for _ in range(total - shared_total)]
        self._sequences[request.request_id] = _Sequence(
            blocks=chain + fresh,
            num_committed=len(chain),
            num_computed=claim.reused,
            beam_blocks=beam_blocks,
            stamp=next(self._stamps),
        )
        self.last_claims.append(ClaimRecord(request.request_id, request.estimated_reusable_tokens, claim.reused))
        return True

    def _shift_chunk_window(self, request: LlmRequest, reused: int) -> None:
        """Start the chunk at the reused prefix; a non-last chunk still ends on a block boundary."""
        request.prepopulated_prompt_len = reused
        end = reused + request.context_chunk_size
        request.context_current_position = reused
        if end < request.prompt_len:
            floored = end // self.tokens_per_block * self.tokens_per_block
            if floored > reused:  # chunks are whole blocks, so this holds unless a chunk is below one block
                end = floored
        request.context_chunk_size = end - reused

    def _commit_full_blocks(self, request: LlmRequest, seq: _Sequence) -> None:
        limit = seq.num_computed if request.beam_width == 1 else min(seq.num_computed, request.prompt_len)
        full = min(limit // self.tokens_per_block, len(seq.blocks))
        tokens, tpb = request.tokens, self.tokens_per_block
        for i in range(seq.num_committed, full):
            parent = seq.blocks[i - 1] if i else None
            block = seq.blocks[i] = self.pool.commit(parent, seq.blocks[i], tuple(tokens[i * tpb : (i + 1) * tpb]))
            seq.table[i] = block.block_id
        seq.num_committed = max(seq.num_committed, full)

    def _prompt_keys(self, request: LlmRequest) -> list[tuple[int, BlockTokens]]:
        """(hash, tokens) of each full prompt block, cached per request while the prompt is unchanged."""
        cached = self._keys.get(request.request_id)
        if cached is not None and cached[0] == request.prompt_len:
            return cached[1]
        tpb, tokens, block_hash = self.tokens_per_block, request.tokens, self.pool.block_hash
        keys = []
        for start in range(0, request.prompt_len - tpb + 1, tpb):
            block = tuple(tokens[start : start + tpb])
            keys.append((block_hash(block), block))
        self._keys[request.request_id] = (request.prompt_len, keys)
        return keys
