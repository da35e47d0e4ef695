"""``BlockPool``: the primary slots, their reference counts and LRU eviction.

Every primary slot is in exactly one of three sets, so ``num_free + num_cached + num_held == num_blocks``::

    free     no content                                   allocate_many() takes these first
    held     ref_count > 0: in block tables, or claimed    release() gives them back
    cached   ref_count == 0, in the prefix tree            evicted least recently used first

    allocate ─► held ─release─► cached ─evict─► host tier (offloaded: still matches), or dropped ─► free
                     └─release (not in the tree) ───────────────────────────────────────────────► free

It is vLLM's block pool, a free queue and a hash map: the map is the prefix tree (:attr:`tree`,
:mod:`.prefix_tree`), the host slots behind the pool are :attr:`host` (:mod:`.host_tier`), and
the LRU deques drop stale entries lazily (:mod:`.lru`).

With an event buffer (``KvCacheConfig.event_buffer_max_size``) the pool and its tree say what
the reuse index did, where they decide it (:mod:`.events`): stored at commit, removed when a
node leaves the tree, moved when it changes tier, all cleared by :meth:`reset_prefix_cache`.

Block objects are built once and reused: a slot gets its object the first time it is handed out
and keeps one on the free list from then on, so an allocation only sets a reference count. A tree
block is its content's identity: offloaded, it keeps its object and the slot it leaves takes a
spare one (an object that holds no slot: a host-only block that left the tree, or a fresh block
whose content a node already held). A pool never holds more than ``num_blocks + num_host_blocks``
objects (:attr:`num_block_objects`). A block back on the free list is blank; one that re-enters
the tree gets a new ``serial``.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from tensorrt_llm._torch.pyexecutor.kv_cache.block import TOKEN_BYTES, BlockStorage, BlockTokens, KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.events import (
    AllBlocksCleared,
    BlockMoved,
    BlocksRemoved,
    CacheLevel,
    KVCacheEventBuffer,
    PoolCreated,
    StoredBlock,
)
from tensorrt_llm._torch.pyexecutor.kv_cache.host_tier import HostTier
from tensorrt_llm._torch.pyexecutor.kv_cache.lru import SLACK, compact, live_blocks
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import PrefixTree, common_prefix_tokens, unindex
from tensorrt_llm._torch.pyexecutor.kv_cache.values import KvCacheStats

__all__ = ["BlockPool", "BlockStorage", "BlockTokens", "KVBlock", "KvCacheStats", "TOKEN_BYTES", "common_prefix_tokens"]


class BlockPool:
    """Owns every primary and host slot; hands out blocks and takes them back.

    Running out is a value, not an exception: ``allocate_many`` returns fewer blocks than asked
    (callers check ``available`` first: free + evictable) and the caller defers.
    """

    def __init__(
        self,
        num_blocks: int,
        num_host_blocks: int = 0,
        *,
        storage: BlockStorage | None = None,
        events: KVCacheEventBuffer | None = None,
    ) -> None:
        """``events``: where the reuse index's changes are told (None: off); it gets
        ``PoolCreated`` first."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.storage = storage
        self.events = events
        if events is not None:
            events.emit(PoolCreated((num_blocks, num_host_blocks)))
        self.tree = PrefixTree(merge=self._merge, release=self._release_node, events=events)
        self.host = HostTier(num_host_blocks)
        # Free primary slots, handed out in this order: the never-used slots, lowest first
        # (``num_blocks - _unused`` is the next; they get their objects then), then the
        # released ones in release order, each with its object (block_id set, ref_count 0).
        self._unused = num_blocks
        self._free: deque[KVBlock] = deque()
        self._spare: list[KVBlock] = []  # objects holding no slot, ready for a slot that needs one
        self.num_block_objects = 0  # block objects built (the root aside): at most num_blocks + num_host_blocks
        self._lru: deque[KVBlock] = deque()  # cached primary blocks, oldest first, with stale entries
        self._num_cached = 0
        self.num_evictions = 0
        self.num_offloads = 0
        self.num_onboards = 0

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + self._unused

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def available(self) -> int:
        """Blocks an allocation could obtain now: free ones and cached ones it may evict."""
        return len(self._free) + self._unused + self._num_cached

    @property
    def num_host_cached(self) -> int:
        return self.host.num_cached

    @property
    def lru_length(self) -> int:
        """Entries in the primary LRU deque, stale ones included: below ``2 * num_cached + SLACK`` (see .lru)."""
        return len(self._lru)

    def stats(self) -> KvCacheStats:
        return KvCacheStats(self.num_blocks, self.num_free, self._num_cached, self.num_offloads, self.num_onboards)

    # ---- references -----------------------------------------------------------------
    def incref_all(self, blocks: Iterable[KVBlock]) -> None:
        """One more reference on each of ``blocks`` (a claim pins its whole matched prefix at once)."""
        for block in blocks:
            if block.ref_count == 0:  # it leaves its LRU list: its entry goes stale
                if block.block_id is not None:
                    self._num_cached -= 1
                else:
                    self.host.num_cached -= 1
            block.ref_count += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """One reference less on each of ``blocks``, last first (leaves first: they become the
        oldest in LRU, so eviction takes a prefix's deepest blocks before its root)."""
        lru, free = self._lru, self._free
        cached = 0
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise AssertionError(f"decref of unreferenced {block!r}")
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.tokens is None:  # not in the tree: a private block, its slot (with it) is free
                free.append(block)
            elif block.block_id is not None:  # a finished request releases every block here
                lru.append(block)
                block.lru_entries += 1
                cached += 1
            else:
                self.host.push(block)
        self._num_cached += cached
        if len(lru) > 2 * self._num_cached + SLACK:
            self._lru = compact(lru, host=False)

    def _merge(self, node: KVBlock, duplicate: KVBlock) -> None:
        """``duplicate`` (fresh, held once) was computed with ``node``'s content: ``node`` takes
        over its reference; the duplicate's slot is freed, or becomes a host-only node's slot."""
        if node.block_id is None:  # host-only: the fresh primary copy becomes its primary slot
            if self.events is not None:
                self._moved(node, CacheLevel.HOST, CacheLevel.GPU)
            if node.ref_count == 0:  # it leaves the host LRU: its entry goes stale
                self.host.num_cached -= 1
            self.host.free.append(node.host_id)
            node.host_id, node.block_id = None, duplicate.block_id
            node.ref_count += 1
            duplicate.block_id, duplicate.ref_count = None, 0  # private, now without a slot: a spare
            self._spare.append(duplicate)
        else:
            self.incref_all((node,))
            self.release([duplicate])  # private, so this frees its slot

    # ---- allocation -----------------------------------------------------------------
    def allocate_many(self, count: int) -> list[KVBlock]:
        """``count`` fresh private blocks, each referenced once: never-used slots first (lowest
        first), then released ones in release order, then slots freed by evicting the least
        recently used cached blocks; fewer only if the pool runs out."""
        blocks = self._allocate_unused(count) if self._unused else []
        count -= len(blocks)
        free = self._free
        if len(free) < count:
            self._evict_until(count)
        if count == 1 and free:  # the usual step: one block
            block = free.popleft()
            block.ref_count = 1
            blocks.append(block)
        elif count > 0:
            taken = [free.popleft() for _ in range(min(count, len(free)))]
            for block in taken:
                block.ref_count = 1
            blocks += taken
        return blocks

    def _allocate_unused(self, count: int) -> list[KVBlock]:
        """Up to ``count`` never-used slots, lowest first, each with its object (a spare one
        while there are spares), referenced once."""
        first = self.num_blocks - self._unused
        taken = min(count, self._unused)
        self._unused -= taken
        blocks = []
        spare = self._spare
        for block_id in range(first, first + taken):
            if spare:
                block = spare.pop()
                block.block_id, block.ref_count = block_id, 1
            else:
                block = KVBlock(block_id, 1)
                self.num_block_objects += 1
            blocks.append(block)
        return blocks

    def _slot_freed(self, block_id: int) -> None:
        """A slot whose block keeps its object elsewhere (offloaded to the host tier) is free:
        a spare object holds it on the free list."""
        if self._spare:
            slot = self._spare.pop()
        else:
            slot = KVBlock(None)
            self.num_block_objects += 1
        slot.block_id = block_id
        self._free.append(slot)

    def copy(self, src: KVBlock, dst: KVBlock) -> None:
        """Copy ``src``'s KV into ``dst`` (partial reuse, a beam's copy on write)."""
        if self.storage is not None:
            self.storage.copy_block(src.block_id, dst.block_id)

    # ---- the host tier --------------------------------------------------------------
    def onboard(self, block: KVBlock) -> bool:
        """Bring a pinned host-only tree block back into a primary slot (may evict); False when none can be had."""
        assert block.block_id is None and block.ref_count > 0, block
        taken = self.allocate_many(1)
        if not taken:
            return False
        slot = taken[0]  # its own object becomes a spare: the block keeps its object
        if self.events is not None:  # after the allocation's own evictions, which come first
            self._moved(block, CacheLevel.HOST, CacheLevel.GPU)
        block.block_id, slot.block_id, slot.ref_count = slot.block_id, None, 0
        self._spare.append(slot)
        if self.storage is not None:
            self.storage.onboard(block.host_id, block.block_id)
        self.host.free.append(block.host_id)
        block.host_id = None
        self.num_onboards += 1
        return True

    def offload_until(self, num_free: int) -> int:
        """Evict as an allocation would until ``num_free`` slots are free or nothing cached is left
        (to the host tier, or out of the tree when every host slot is held); returns how many."""
        if not self.num_host_blocks:
            raise ValueError("offload_until needs a host tier: without one, eviction drops the blocks")
        return self._evict_until(num_free)

    # ---- eviction -------------------------------------------------------------------
    def _evict_until(self, num_free: int) -> int:
        """Evict LRU cached blocks, oldest first, until ``num_free`` slots are free or nothing is
        left to evict; returns how many. A victim moves to the host tier when it can (the tier's
        own LRU block dropped when it is full), else leaves the tree with its subtree.

        Every block a long replay allocates passes through here, usually pushing one host block
        out of the tree: counts are kept in locals (written back around the rare calls that
        change them) and the usual host drop, a leaf, is inlined (``PrefixTree.unlink``)."""
        free, host, events = self._free, self.host, self.events
        free_host = host.free
        num_free -= self._unused  # never-used slots count as free (none is left when anything is cached)
        host_tier, storage = self.num_host_blocks > 0, self.storage
        pop_oldest, pop_oldest_host, push_host = self._lru.popleft, host.lru.popleft, host.lru.append
        num_cached, num_host_cached = self._num_cached, host.num_cached
        evicted = dropped_whole = 0
        while num_cached and len(free) < num_free:
            victim = pop_oldest()
            victim.lru_entries -= 1
            if victim.lru_entries or victim.ref_count or victim.tokens is None or victim.block_id is None:
                continue  # a stale entry (see .lru)
            num_cached -= 1
            evicted += 1
            if not host_tier or not (free_host or num_host_cached):
                self._num_cached, host.num_cached = num_cached, num_host_cached
                self.tree.drop(victim)  # it counts the descendants it drops
                num_cached, num_host_cached = self._num_cached, host.num_cached
                dropped_whole += 1
                continue
            if free_host:
                host_id = free_host.popleft()
                num_host_cached += 1  # the victim joins the host LRU below
            else:
                # The tier is full: its LRU block goes, and the victim takes its place in the
                # host LRU count. Usually a leaf (LRU order takes a prefix's deepest blocks
                # first), dropped inline: its host slot is the one the victim takes.
                while True:  # the oldest live entry; stale ones are skipped
                    dropped = pop_oldest_host()
                    dropped.host_lru_entries -= 1
                    if not (dropped.host_lru_entries or dropped.ref_count or dropped.tokens is None
                            or dropped.block_id is not None):
                        break
                if dropped.children:  # (unreferenced, as the loop above found it)
                    self._num_cached, host.num_cached = num_cached, num_host_cached - 1  # it counts only the descendants
                    self.tree.drop(dropped)
                    num_cached, num_host_cached = self._num_cached, host.num_cached + 1
                    host_id = free_host.popleft()
                else:  # PrefixTree.unlink inlined
                    if events is not None:
                        events.emit(BlocksRemoved((dropped.event_hash,), CacheLevel.HOST))
                    parent = dropped.parent
                    children, block_hash = parent.children, dropped.hash
                    bucket = children[block_hash]
                    if len(bucket) == 1:
                        del children[block_hash]
                    else:
                        bucket.remove(dropped)
                    if parent.by_first is not None:
                        unindex(parent.by_first, dropped)
                    host_id = dropped.host_id
                    dropped.host_id = dropped.tokens = dropped.parent = dropped.children = dropped.by_first = None
                    self._spare.append(dropped)  # out of the tree, no slot: its object is reused
            victim.host_id = host_id
            if events is not None:
                self._moved(victim, CacheLevel.GPU, CacheLevel.HOST)
            if storage is not None:
                storage.offload(victim.block_id, host_id)
            self._slot_freed(victim.block_id)  # the victim keeps its object, as the host copy
            victim.block_id = None
            push_host(victim)  # HostTier.push inlined (counted above), its compaction done once below
            victim.host_lru_entries += 1
        self._num_cached, host.num_cached = num_cached, num_host_cached
        if len(host.lru) > 2 * num_host_cached + SLACK:
            host.lru = compact(host.lru, host=True)
        self.num_evictions += evicted
        self.num_offloads += evicted - dropped_whole
        return evicted

    def _release_node(self, node: KVBlock, descendant: bool) -> None:
        """Give a node the tree dropped its slots back, with its object (``PrefixTree.drop``
        calls it); a ``descendant`` of the evicted block leaves its LRU list too."""
        if descendant:  # its LRU entry goes stale
            if node.block_id is not None:
                self._num_cached -= 1
            else:
                self.host.num_cached -= 1
        if node.host_id is not None:
            self.host.free.append(node.host_id)
            node.host_id = None
        if node.block_id is not None:
            self._free.append(node)
        else:
            self._spare.append(node)

    def _moved(self, block: KVBlock, source: CacheLevel, destination: CacheLevel) -> None:
        """Tell the buffer that tree node ``block`` changes tier."""
        parent = block.parent
        self.events.emit(BlockMoved(
            StoredBlock(block.event_hash, block.tokens), None if parent is self.tree.root else parent.event_hash,
            len(block.tokens) // TOKEN_BYTES, source, destination,
        ))

    # ---- reset ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every block of the reuse index, both tiers, and tell ``AllBlocksCleared``; True
        when done. False, changing nothing, while any tree block is referenced (a running
        request or a claim holds it: its KV is in use and stays matchable), as vLLM's reset
        refuses while blocks are in use."""
        root = self.tree.root
        if any(child.ref_count for child in root.iter_children()):  # a held node's ancestors are held too
            return False
        removed = _descendants_first(root) if self.events is not None else ()
        for child in list(root.iter_children()):
            if child.block_id is not None:  # it leaves its LRU list: its entry goes stale
                self._num_cached -= 1
            else:
                self.host.num_cached -= 1
            self.tree.drop(child, tell=False)
        if self.events is not None:
            self.events.emit(AllBlocksCleared(removed))
        return True

    # ---- integrity ------------------------------------------------------------------
    def lru_blocks(self) -> list[KVBlock]:
        """The cached primary blocks, oldest first (for checks; O(entries)); the host's: ``host.lru_blocks()``."""
        return live_blocks(self._lru, host=False)

    def check_integrity(self, held_blocks: Iterable[KVBlock] = ()) -> None:
        """The leak oracle: raise AssertionError unless free + cached + ``held_blocks``
        partition the primary slots (and the host slots, :meth:`HostTier.check`)."""
        held = {id(b): b for b in held_blocks}
        assert all(b.ref_count == 0 and b.tokens is None and b.host_id is None for b in self._free), "a free block is in use"
        assert all(b.block_id is None and b.ref_count == 0 and b.tokens is None for b in self._spare), "a spare holds a slot"
        free = {b.block_id for b in self._free} | set(range(self.num_blocks - self._unused, self.num_blocks))
        lru = self.lru_blocks()
        cached = {b.block_id for b in lru}
        assert len(cached) == len(lru) == self._num_cached, f"{len(lru)} cached blocks, counted {self._num_cached}"
        held_ids = {b.block_id for b in held.values() if b.block_id is not None}
        assert len(free) == self.num_free, "a slot is on the free list twice"
        assert not (free & cached) and not (free & held_ids) and not (cached & held_ids), "a slot is in two sets"
        assert len(free) + len(cached) + len(held_ids) == self.num_blocks, (
            f"leak: free {len(free)} + cached {len(cached)} + held {len(held_ids)} != {self.num_blocks}"
        )
        assert all(b.ref_count == 0 and b.in_tree for b in lru), "a cached block is referenced"
        self.host.check(held.values())


def _descendants_first(root: KVBlock) -> tuple[int, ...]:
    """The event hashes of every node below ``root``, each after its descendants."""
    order, stack = [], list(root.iter_children())
    while stack:
        node = stack.pop()
        order.append(node.event_hash)
        stack.extend(node.iter_children())
    return tuple(reversed(order))
