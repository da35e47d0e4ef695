"""LRU order with lazy removal: the pool's cached primary blocks and the host tier's blocks.

Each list is a deque, oldest first, not an ordered dict: a block is appended each time it
becomes evictable and is never searched for when it stops being so (a claim pins it, it is
onboarded or dropped). An entry is live only if it is its block's last one in that deque (a
count on the block, ``lru_entries`` / ``host_lru_entries``, never reset when the object is
reused) and the block is still evictable in that tier; eviction skips the others as it meets
them::

    primary deque   [a][b][a][c]      a's first entry is stale (a was pinned, then released again)
    a.lru_entries    2                live: [b][a][c], oldest first

Every LRU operation is then an O(1) deque end operation on contiguous memory, with no hashing
and no linked-list node per block, and the order of live entries is exactly the order an
ordered dict would keep (a block only enters a list when it is not in it). A deque whose stale
entries outnumber its live ones (plus 64) is compacted: a pool that never evicts, with a hot
prefix pinned and released by every request, would otherwise grow it without bound; the cost
is O(1) per append, amortised.
"""

from __future__ import annotations

from collections import deque

from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock

SLACK = 64  # stale entries a deque may hold beyond its live ones before it is compacted


def is_live(block: KVBlock, *, host: bool) -> bool:
    """Whether ``block``, met at its last entry of a tier's deque, is evictable in that tier."""
    return not block.ref_count and block.tokens is not None and (block.block_id is None) is host


def compact(lru: deque[KVBlock], *, host: bool) -> deque[KVBlock]:
    """``lru`` without its stale entries, in order; each live block's entry count set to 1."""
    live = deque()
    for block in lru:
        if host:
            block.host_lru_entries -= 1
            if block.host_lru_entries or block.ref_count or block.tokens is None or block.block_id is not None:
                continue
            block.host_lru_entries = 1
        else:
            block.lru_entries -= 1
            if block.lru_entries or block.ref_count or block.tokens is None or block.block_id is None:
                continue
            block.lru_entries = 1
        live.append(block)
    # counts were decremented for every entry and reset to 1 for the live ones; blocks
    # with only stale entries are at 0, as they should be
    return live


def live_blocks(lru: deque[KVBlock], *, host: bool) -> list[KVBlock]:
    """The live entries of ``lru``, oldest first (for checks and tests; O(entries), changes nothing)."""
    remaining: dict[int, int] = {}
    live = []
    for block in lru:  # an entry is live if it is its block's last and the block is evictable there
        left = remaining.get(id(block), block.host_lru_entries if host else block.lru_entries) - 1
        remaining[id(block)] = left
        if not left and is_live(block, host=host):
            live.append(block)
    return live
