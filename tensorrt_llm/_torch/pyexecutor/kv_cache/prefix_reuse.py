"""Prefix reuse: what a prompt matches, the claim that pins it, and the commit of computed blocks.

A waiting request's prompt goes through three moments, each with its own value::

    match(request) ─► PrefixMatch      a query: the tree as it is now, nothing pinned
    claim(request) ─► PrefixClaim      the matched prefix pinned (at most prompt_len - 1 tokens)
    take(claim, ...) ─► the blocks     onboard host blocks, copy a partial block, allocate the rest

    prompt      [ P0 ][ P1 ][ P2 ][ P3 ][ P4.. ]      full blocks keyed as (hash, tokens)
    tree        [ P0 ][ P1 ][ P2 ]─┐                  P2 only on the host tier
                                   └[ P3' ]           P3' shares P3's first tokens
    estimate    ├─ 3 full blocks ──┤                  PrefixMatch.reusable_tokens (either tier)
    claim       ├─ chain: P0 P1 P2 ┤+ partial P3'     pins all four; reused = 3 blocks + shared tokens
    allocation  P2 onboarded, P3' copied into a fresh block, fresh blocks to the prompt's end

* The last prompt token is always computed (its logits are needed), so a claim stops at
  ``prompt_len - 1`` tokens; the estimate (upstream's) does not, which is the gap the re-check
  exists for. A request that asks for its prompt's log-probabilities reuses nothing.
* A claim holds one reference per pinned block, so no allocation can evict them: between the
  claim and the allocation the chunk's cost after reuse is exact. ``take`` consumes the claim,
  all or nothing; ``release`` gives it back, leaving the pool exactly as before.
* After a forward, a sequence's full, computed blocks are keyed and committed to the tree
  (:meth:`PrefixReuse.commit_blocks`); prompt blocks reuse the keys the match computed.
* :class:`PrefixIndex` keeps each waiting request's last walk of the tree, so the next match,
  an iteration later, resumes it instead of walking the whole prompt again.
"""

from __future__ import annotations

import bisect
from array import array
from typing import TYPE_CHECKING, Callable, Container

import numpy as np

from tensorrt_llm._torch.pyexecutor.kv_cache.block import TOKEN_BYTES, BlockTokens, KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import BlockKey, PrefixTree, block_keys, pack_tokens
from tensorrt_llm._torch.pyexecutor.kv_cache.values import NO_MATCH, PrefixClaim, PrefixMatch
from tensorrt_llm._torch.pyexecutor.llm_request import TOKEN_TYPECODE, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache.sequence_blocks import HeldBlocks


def _unreferenced(block: KVBlock) -> bool:
    return block.ref_count == 0


class PrefixIndex:
    """Each waiting request's last walk of the prefix tree, resumed by its next one.

    Exact, not a guess: a block leaves the tree only with its whole subtree, so the blocks of an
    old chain that were dropped since are a suffix of it (found by bisection); what was
    committed since is found by walking on from the last surviving block. A dropped block's
    object is reused (``BlockPool``): it is out of the tree, or back in it with a ``serial``
    above the tree's serial when the chain was last brought up to date, which tells it apart.
    :meth:`chain` therefore returns ``tree.match(keys)`` as of now, at the cost of what changed.
    An entry lives from a request's first match until it is allocated or freed (:meth:`forget`).
    """

    def __init__(self, tree: PrefixTree) -> None:
        self._tree = tree
        # request id -> [prompt_len, chain, keys, the tree's serial when the chain was last brought up to date]
        self._entries: dict[int, list] = {}

    def chain(self, request_id: int, prompt_len: int, keys: list[BlockKey]) -> list[KVBlock]:
        """The matched full blocks of a prompt of ``prompt_len`` tokens whose block keys are ``keys``
        (the index's own list: read it, slice it, never change it)."""
        tree = self._tree
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != prompt_len:
            chain = tree.match(keys)
            self._entries[request_id] = [prompt_len, chain, keys, tree.serial]
            return chain
        _, chain, keys, seen = entry  # the chain is updated in place
        if chain and (chain[-1].tokens is None or chain[-1].serial > seen):  # its end left the tree

            def dropped(block: KVBlock) -> bool:  # since ``seen``: out of the tree, or back in it as another block
                return block.tokens is None or block.serial > seen

            del chain[bisect.bisect_left(chain, True, key=dropped) :]
        if len(chain) < len(keys) and (not chain or chain[-1].children):  # else nothing can extend it
            chain += tree.match(keys, chain[-1] if chain else None, start=len(chain))
        entry[3] = tree.serial
        return chain

    def forget(self, request_id: int) -> None:
        self._entries.pop(request_id, None)


class PrefixReuse:
    """Matches and claims prompts' prefixes in the pool's tree, and commits computed blocks to it.

    ``started`` holds the ids of requests that hold blocks (the sequences', read only): they
    match nothing and claim nothing. ``block_hash`` keys blocks (None: ``content_hashes``).
    """

    def __init__(
        self,
        pool: BlockPool,
        tokens_per_block: int,
        *,
        enabled: bool,
        partial: bool,
        block_hash: Callable[[BlockTokens], int] | None,
        started: Container[int],
    ) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.enabled = enabled
        self.partial = enabled and partial
        self.block_hash = block_hash
        self.index = PrefixIndex(pool.tree)  # waiting requests' last walks (match, claim)
        self.claims: dict[int, PrefixClaim] = {}  # outstanding claims (pinned, not yet allocated)
        self._started = started
        # request id -> (prompt_len, its full prompt blocks' keys, the whole prompt packed)
        self._keys: dict[int, tuple[int, list[BlockKey], bytes]] = {}

    def reuses(self, request: LlmRequest) -> bool:
        """Whether ``request`` may claim cached blocks: not one that asks for its prompt's
        log-probabilities, whose every prompt position must be computed to have logits."""
        return self.enabled and request.sampling_config.prompt_logprobs is None

    def can_shift(self, request: LlmRequest) -> bool:
        """True while allocation may still move this request's chunk window (unclaimed first chunk, reuse on)."""
        rid = request.request_id
        return self.reuses(request) and rid not in self._started and rid not in self.claims

    # ---- match ----------------------------------------------------------------------
    def match(self, request: LlmRequest) -> PrefixMatch:
        """What ``request``'s prompt matches now; no match once it holds blocks. Changes nothing
        but the index's memo of the walk."""
        if (not self.enabled or request.sampling_config.prompt_logprobs is not None  # reuses, inlined
                or request.request_id in self._started):
            self.index.forget(request.request_id)
            return NO_MATCH
        tpb = self.tokens_per_block
        chain = self.index.chain(request.request_id, request.prompt_len, self.prompt_keys(request))
        # A claim matches at most prompt_len - 1 tokens; match() of a prefix of the keys is
        # the same prefix of the chain. Whoever holds a block holds its ancestors, so the
        # held blocks of a chain are a prefix of it: found by bisection.
        claimable = min(len(chain), (request.prompt_len - 1) // tpb)
        if not claimable or chain[0].ref_count == 0:
            shared = 0
        elif chain[claimable - 1].ref_count:  # the usual hit: a started request holds the whole prefix
            shared = claimable
        else:
            shared = bisect.bisect_left(chain, True, 1, claimable - 1, key=_unreferenced)
        return PrefixMatch(len(chain) * tpb, shared)

    # ---- claim ----------------------------------------------------------------------
    def claim(self, request: LlmRequest) -> PrefixClaim:
        """Pin the reusable prefix of an unallocated first chunk (its outstanding claim, if any).

        The claim walks the tree for at most ``prompt_len - 1`` tokens, pins the matched blocks
        so no allocation can evict them, and with partial reuse pins the primary block that
        shares the longest prefix with the next block.
        """
        rid = request.request_id
        existing = self.claims.get(rid)
        if existing is not None:
            return existing
        tpb = self.tokens_per_block
        claim_limit = request.prompt_len - 1
        chain: list[KVBlock] = []
        partial, partial_len = None, 0
        if self.reuses(request):
            # the admission walk's match, resumed (a prefix of the keys matches a prefix of the chain)
            keys = self.prompt_keys(request)
            chain = self.index.chain(rid, request.prompt_len, keys)[: claim_limit // tpb]
            if self.partial and request.beam_width == 1:
                start = len(chain) * tpb
                want = self._keys[rid][2][start * TOKEN_BYTES : min(start + tpb, claim_limit) * TOKEN_BYTES]
                if want:
                    partial, partial_len = self.pool.tree.match_partial(chain[-1] if chain else None, want)
        claim = PrefixClaim(rid, chain, partial, partial_len, len(chain) * tpb + partial_len)
        self.pool.incref_all(claim.pinned)  # pinned: no allocation can evict them now
        self.claims[rid] = claim
        return claim

    def release(self, claim: PrefixClaim) -> None:
        """Unpin an outstanding claim: the pool is left exactly as before it."""
        if self.claims.pop(claim.request_id, None) is not None:
            # Leaves first, as freeing does: a root released after its leaves stays younger
            # in LRU, so one eviction cannot drop the whole cached prefix.
            self.pool.release(claim.pinned)

    def take(self, claim: PrefixClaim, total: int, shared_total: int) -> tuple[list[KVBlock], list[KVBlock], int] | None:
        """Turn an outstanding claim into a first chunk's blocks, all or nothing: onboard its host
        blocks, copy its partial match into the first fresh block, and allocate fresh blocks up to
        ``shared_total`` blocks of table and ``total`` in all (the rest: beams' own). Returns the
        table's blocks, the beams' blocks and how many blocks were onboarded; None, with the
        claim released, when the blocks cannot be had."""
        pool, chain = self.pool, claim.chain
        on_host = [block for block in chain if block.block_id is None]  # pinned: they stay there until onboarded
        # A partial-match source pinned by this claim alone goes back to the cache once it is
        # copied into the first fresh block, so the rest of the allocation may take its slot.
        recycled = int(claim.partial is not None and claim.partial.ref_count == 1)
        available = pool.available
        if total - len(chain) + len(on_host) > available + recycled or len(on_host) + recycled > available:
            self.release(claim)
            return None
        del self.claims[claim.request_id]
        for block in on_host:
            pool.onboard(block)
        blocks = chain + (pool.allocate_many(1) if shared_total > len(chain) else [])
        if claim.partial is not None:
            pool.copy(claim.partial, blocks[len(chain)])
            pool.release([claim.partial])
        blocks += pool.allocate_many(shared_total - len(blocks))
        return blocks, pool.allocate_many(total - shared_total), len(on_host)

    # ---- commit ---------------------------------------------------------------------
    def commit_blocks(self, sequences: list[tuple[LlmRequest, HeldBlocks]]) -> None:
        """Commit each sequence's computed full blocks that are not in the tree yet, in order.

        Prompt blocks reuse the keys the match computed; blocks of generated tokens are keyed
        here, every sequence's at once (one packing and hashing pass). A beam-search request
        commits its prompt blocks only."""
        tpb, commit_chain = self.tokens_per_block, self.pool.tree.commit_chain
        spans: list[tuple[HeldBlocks, list[BlockKey], int, int]] = []
        generated = array(TOKEN_TYPECODE)  # every sequence's generated tokens to key, one after another
        for request, seq in sequences:
            limit = seq.num_computed if request.beam_width == 1 else min(seq.num_computed, request.prompt_len)
            full = min(limit // tpb, len(seq.blocks))
            if full <= seq.num_committed:
                continue
            keys = self.prompt_keys(request)
            begin = max(seq.num_committed, len(keys))  # its first block of generated tokens
            if full > begin:
                generated += request.tokens[begin * tpb : full * tpb]
            spans.append((seq, keys, begin, full))
        generated_keys = (block_keys(pack_tokens(generated), len(generated) // tpb, tpb, self.block_hash)
                          if generated else [])
        offset = 0
        for seq, keys, begin, full in spans:
            blocks, committed = seq.blocks, seq.num_committed
            if committed < len(keys):
                commit_chain(blocks, committed, keys[committed:full])
            if full > begin:
                commit_chain(blocks, begin, generated_keys[offset : offset + full - begin])
                offset += full - begin
            table = seq.table
            for i in range(committed, full):
                table[i] = blocks[i].block_id
            seq.num_committed = full

    def prompt_keys(self, request: LlmRequest) -> list[BlockKey]:
        """The keys of the full prompt blocks, cached per request while the prompt is unchanged,
        beside the whole prompt packed (a claim's partial block is a slice of it)."""
        cached = self._keys.get(request.request_id)
        if cached is not None and cached[0] == request.prompt_len:
            return cached[1]
        prompt_len, tokens = request.prompt_len, request.tokens
        packed: np.ndarray = pack_tokens(tokens if len(tokens) == prompt_len else tokens[:prompt_len])
        buffer = packed.tobytes()
        keys = block_keys(packed, prompt_len // self.tokens_per_block, self.tokens_per_block, self.block_hash, buffer)
        self._keys[request.request_id] = (prompt_len, keys, buffer)
        return keys

    def forget(self, request: LlmRequest) -> None:
        """``request`` is freed: its outstanding claim is released, its keys and walk dropped."""
        claim = self.claims.get(request.request_id)
        if claim is not None:
            self.release(claim)
        self._keys.pop(request.request_id, None)
        self.index.forget(request.request_id)
