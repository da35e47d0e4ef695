"""The KV block pool: reference-counted blocks, the prefix tree, LRU eviction, the host tier.

Every primary slot is in exactly one of three sets::

    free      no content, on the free list
    held      ref_count > 0: in some sequence's block table (or pinned during a claim)
    cached    ref_count == 0, content in the prefix tree, evictable (primary LRU)

so ``num_free + num_cached + num_held == num_blocks``. A tree block may also live only in
the host tier (``block_id is None``): it still matches, and a claim onboards it.

Block objects are built once and reused, as vLLM's block pool builds its blocks once: a
primary slot gets its object the first time it is handed out, and from then on a free slot
keeps an object on the free list, ready to hand out again (an allocation sets its reference
count, nothing more). A tree block is its content's identity: when it moves to the host tier
it keeps its object and the primary slot it leaves takes a spare one (an object that holds
no slot: a host-only block that left the tree, or a fresh block whose content was already in
the tree). So a pool never holds more than ``num_blocks + num_host_blocks`` block objects,
and once every slot has been used an allocation builds none. A block handed back to the free
list is blank (no tokens, parent, children or host slot); an object that re-enters the tree
gets a new ``serial``, which is how a holder of an old chain tells it apart (``PrefixIndex``).

The two LRU lists (cached primary blocks, host-only tree blocks) are deques with lazy
removal, not ordered dicts: a block is appended each time it becomes evictable and is never
searched for when it stops being so (a claim pins it, it is onboarded or dropped). An entry
is live only if it is its block's last one in that deque (a count on the block, never reset
when the object is reused) and the block is still evictable in that tier; eviction skips the
others as it meets them. Every
LRU operation is then an O(1) deque end operation on contiguous memory, with no hashing and
no linked-list node per block, and the order of live entries is exactly the order an ordered
dict would keep (a block only enters a list when it is not in it).

The prefix tree is keyed by block content: a node's children are indexed by the hash of
the child's tokens and every hit is verified against the tokens, so a hash collision can
never hand out the wrong KV. A block's tokens are kept packed (:data:`BlockTokens`): the
verification is one memcmp, and a block leaving the tree frees one object, where a tuple
would touch the reference count of every token it holds. The chain from the root is the prefix; a sequence that
holds a block holds all its ancestors, hence ``ref_count(parent) >= ref_count(child)``
and evicting a block may drop its whole (unreferenced) subtree.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

logger = logging.getLogger(__name__)

# A block's token ids packed as native unsigned 32-bit ints (``array("I").tobytes()``); the
# ids are below the vocabulary size, at most 2**32 (submission checks it).
BlockTokens = bytes
TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class KvCacheStats:
    """A pool as counted at one moment: ``num_free + num_cached + num_held == num_blocks``.

    ``num_cached`` blocks hold reusable KV that nothing references (evictable); ``num_held``
    blocks are referenced by requests or pinned by claims. ``num_offloads`` and
    ``num_onboards`` count host-tier moves since the pool was made.
    """

    num_blocks: int
    num_free: int
    num_cached: int
    num_offloads: int = 0
    num_onboards: int = 0

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def usage(self) -> float:
        """Share of the pool that requests reference (0..1)."""
        return self.num_held / self.num_blocks if self.num_blocks else 0.0

    def __add__(self, other: "KvCacheStats") -> "KvCacheStats":
        """Two pools counted as one (the ranks of attention DP)."""
        return KvCacheStats(
            self.num_blocks + other.num_blocks, self.num_free + other.num_free, self.num_cached + other.num_cached,
            self.num_offloads + other.num_offloads, self.num_onboards + other.num_onboards,
        )


def common_prefix_tokens(a: BlockTokens, b: BlockTokens) -> int:
    """How many leading tokens ``a`` and ``b`` share: a bisection over slice comparisons
    (equal prefixes are nested), a few memcmps instead of a loop over the tokens."""
    lo, hi = 0, min(len(a), len(b)) // TOKEN_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        end = mid * TOKEN_BYTES
        if a[:end] == b[:end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _serial(block: "KVBlock") -> int:
    return block.serial


def _unindex(by_first: dict[bytes, list["KVBlock"]], block: "KVBlock") -> None:
    """Take ``block``, leaving the tree, out of its parent's first-token index."""
    first = block.tokens[:TOKEN_BYTES]
    siblings = by_first[first]
    if len(siblings) == 1:
        del by_first[first]
    else:
        siblings.remove(block)


class BlockStorage(Protocol):
    """Moves real K/V between slots; the pool calls it only when tensors exist."""

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None: ...

    def offload(self, block_id: int, host_id: int) -> None: ...

    def onboard(self, host_id: int, block_id: int) -> None: ...


class KVBlock:
    """One block of KV content: a primary slot and/or a host slot, possibly a tree node."""

    __slots__ = (
        "block_id", "host_id", "ref_count", "tokens", "hash", "parent", "children", "by_first", "serial",
        "lru_entries", "host_lru_entries",
    )

    def __init__(self, block_id: int | None, ref_count: int = 0) -> None:
        self.block_id = block_id
        self.host_id: int | None = None
        self.ref_count = ref_count
        self.tokens: BlockTokens | None = None  # set when committed to the tree
        self.hash = 0
        self.parent: KVBlock | None = None
        self.children: dict[int, list[KVBlock]] | None = None
        # the same children by their first token (its packed bytes), in commit order: partial matching looks
        # only at children that share at least the first token. Built when partial matching first asks
        # (BlockPool._first_token_index), kept up to date from then on; None until then. Only the parents
        # of first chunks' partial blocks are ever asked (the root, mostly): the other nodes, nearly all
        # the tree, never pay for an index at commit or drop.
        self.by_first: dict[bytes, list[KVBlock]] | None = None
        self.serial = 0  # commit order among the tree's blocks (orders a by_first index built late)
        # entries of this block in the pool's primary / host LRU deques (the last one may be live)
        self.lru_entries = 0
        self.host_lru_entries = 0

    @property
    def in_tree(self) -> bool:
        return self.tokens is not None

    def child(self, block_hash: int, tokens: BlockTokens) -> KVBlock | None:
        if self.children is None:
            return None
        for candidate in self.children.get(block_hash, ()):
            if candidate.tokens == tokens:  # verified: equal hash alone proves nothing
                return candidate
        return None

    def iter_children(self) -> Iterable[KVBlock]:
        if self.children:
            for bucket in self.children.values():
                yield from bucket

    def __repr__(self) -> str:
        where = f"gpu{self.block_id}" if self.block_id is not None else f"host{self.host_id}"
        return f"KVBlock({where} ref={self.ref_count} cached={self.in_tree})"


class BlockPool:
    """Owns every primary and host slot; hands out blocks and takes them back.

    Running out is a value, not an exception: ``allocate`` returns ``None`` and the caller
    defers. ``available`` counts what an allocation could obtain (free + evictable).
    """

    def __init__(
        self,
        num_blocks: int,
        num_host_blocks: int = 0,
        *,
        storage: BlockStorage | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.storage = storage
        self.root = KVBlock(None)
        # Free primary slots, handed out in this order: the never-used slots, lowest first
        # (``num_blocks - _unused`` is the next; they get their objects then), then the
        # released ones in release order, each with its object (block_id set, ref_count 0).
        self._unused = num_blocks
        self._free: deque[KVBlock] = deque()
        self._spare: list[KVBlock] = []  # objects holding no slot, ready for a slot that needs one
        self.num_block_objects = 0  # block objects built (the root aside): at most num_blocks + num_host_blocks
        self._free_host: deque[int] = deque(range(num_host_blocks))
        # LRU deques, oldest first, with stale entries (see the module docstring) and live counts
        self._lru: deque[KVBlock] = deque()  # cached primary blocks
        self._host_lru: deque[KVBlock] = deque()  # host-only tree blocks
        self._num_cached = 0
        self._num_host_cached = 0
        self.serial = 0  # the KVBlock.serial of the last block committed to the tree (0: none yet); read-only outside
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
        return len(self._free) + self._unused + self._num_cached

    @property
    def num_host_cached(self) -> int:
        return self._num_host_cached

    @property
    def lru_length(self) -> int:
        """Entries in the primary LRU deque, stale ones included: the lazy removal keeps it
        below ``2 * num_cached + 64`` (it compacts past that)."""
        return len(self._lru)

    def stats(self) -> KvCacheStats:
        return KvCacheStats(self.num_blocks, self.num_free, self._num_cached, self.num_offloads, self.num_onboards)

    # ---- matching -------------------------------------------------------------------
    def match(
        self, keys: list[tuple[int, BlockTokens]], parent: KVBlock | None = None, start: int = 0
    ) -> list[KVBlock]:
        """Longest chain of tree blocks (either tier) equal to ``keys[start:]``, below
        ``parent`` (default: the root)."""
        # KVBlock.child inlined: the schedulers walk every waiting prompt every iteration.
        chain: list[KVBlock] = []
        children = (parent or self.root).children
        for i in range(start, len(keys)):
            block_hash, tokens = keys[i]
            if children is None:
                break
            for candidate in children.get(block_hash, ()):
                if candidate.tokens == tokens:  # verified: equal hash alone proves nothing
                    break
            else:
                break
            chain.append(candidate)
            children = candidate.children
        return chain

    def match_partial(self, parent: KVBlock | None, tokens: BlockTokens) -> tuple[KVBlock | None, int]:
        """The primary-resident child of ``parent`` sharing the longest token prefix with
        ``tokens`` (the earliest committed among equals).

        Partial reuse copies from primary memory only: onboarding a whole host block to
        salvage part of it is not worth a free slot.
        """
        parent = parent or self.root
        if not tokens or not parent.children:
            return None, 0
        by_first = parent.by_first if parent.by_first is not None else self._first_token_index(parent)
        best, best_len = None, 0
        for candidate in by_first.get(tokens[:TOKEN_BYTES], ()):
            if candidate.block_id is None:
                continue
            n = common_prefix_tokens(tokens, candidate.tokens)
            if n > best_len:
                best, best_len = candidate, n
        return best, best_len

    @staticmethod
    def _first_token_index(parent: KVBlock) -> dict[bytes, list[KVBlock]]:
        """Build ``parent.by_first`` from its children, in commit order; commits and drops keep it from now on."""
        index: dict[bytes, list[KVBlock]] = {}
        for child in sorted(parent.iter_children(), key=_serial):
            index.setdefault(child.tokens[:TOKEN_BYTES], []).append(child)
        parent.by_first = index
        return index

    # ---- references -----------------------------------------------------------------
    def incref(self, block: KVBlock) -> None:
        if block.ref_count == 0:  # it leaves its LRU list: its entry goes stale
            if block.block_id is not None:
                self._num_cached -= 1
            else:
                self._num_host_cached -= 1
        block.ref_count += 1

    def incref_all(self, blocks: Iterable[KVBlock]) -> None:
        """:meth:`incref` each of ``blocks`` (a claim pins its whole matched prefix at once)."""
        for block in blocks:
            if block.ref_count == 0:  # it leaves its LRU list: its entry goes stale
                if block.block_id is not None:
                    self._num_cached -= 1
                else:
                    self._num_host_cached -= 1
            block.ref_count += 1

    def _to_lru(self, block: KVBlock) -> None:
        """``block`` became evictable in primary memory: the most recently used end."""
        self._lru.append(block)
        block.lru_entries += 1
        self._num_cached += 1
        if len(self._lru) > 2 * self._num_cached + 64:
            self._lru = self._compact(self._lru, primary=True)

    def _to_host_lru(self, block: KVBlock) -> None:
        """``block`` became evictable in the host tier: the most recently used end."""
        self._host_lru.append(block)
        block.host_lru_entries += 1
        self._num_host_cached += 1
        if len(self._host_lru) > 2 * self._num_host_cached + 64:
            self._host_lru = self._compact(self._host_lru, primary=False)

    @staticmethod
    def _compact(lru: deque[KVBlock], *, primary: bool) -> deque[KVBlock]:
        """``lru`` without its stale entries, in order.

        Stale entries otherwise leave only when eviction reaches them: a pool that never
        evicts, with a hot prefix pinned and released by every request, would grow its
        deque without bound. Compacting once stale entries outnumber live ones costs O(1)
        per append, amortised.
        """
        live = deque()
        for block in lru:
            if primary:
                block.lru_entries -= 1
                if block.lru_entries or block.ref_count or block.tokens is None or block.block_id is None:
                    continue
                block.lru_entries = 1
            else:
                block.host_lru_entries -= 1
                if block.host_lru_entries or block.ref_count or block.tokens is None or block.block_id is not None:
                    continue
                block.host_lru_entries = 1
            live.append(block)
        # counts were decremented for every entry and reset to 1 for the live ones; blocks
        # with only stale entries are at 0, as they should be
        return live

    def decref(self, block: KVBlock) -> None:
        if block.ref_count <= 0:
            raise AssertionError(f"decref of unreferenced {block!r}")
        block.ref_count -= 1
        if block.ref_count:
            return
        if not block.in_tree:
            self._free_slot(block)
        elif block.block_id is not None:
            self._to_lru(block)
        else:
            self._to_host_lru(block)

    def release(self, blocks: list[KVBlock]) -> None:
        """:meth:`decref` each of ``blocks``, last first (leaves first: they become the
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
            elif block.block_id is not None:  # _to_lru inlined: a finished request releases every block here
                lru.append(block)
                block.lru_entries += 1
                cached += 1
            else:
                self._to_host_lru(block)
        self._num_cached += cached
        if len(lru) > 2 * self._num_cached + 64:
            self._lru = self._compact(lru, primary=True)

    # ---- allocation -----------------------------------------------------------------
    def allocate(self) -> KVBlock | None:
        """A fresh private block with ref_count 1, evicting the LRU cached block if needed."""
        if not self._free and not self._unused and not self._evict_one():
            return None
        block = self._free.popleft() if self._free and not self._unused else self._take_unused()
        block.ref_count = 1
        return block

    def allocate_many(self, count: int) -> list[KVBlock]:
        """``count`` fresh blocks, as ``count`` calls of :meth:`allocate` would give them
        (free slots first, then evicting one cached block at a time while short); fewer
        only if the pool runs out."""
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

    def _take_unused(self) -> KVBlock:
        """The lowest never-used slot, with its object (unreferenced)."""
        block = self._allocate_unused(1)[0]
        block.ref_count = 0
        return block

    def _take_slot(self) -> int:
        """A free primary slot's id for a block that has an object already (onboarding); the
        slot's own object becomes a spare."""
        slot = self._free.popleft() if self._free and not self._unused else self._take_unused()
        block_id, slot.block_id = slot.block_id, None
        self._spare.append(slot)
        return block_id

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

    def onboard(self, block: KVBlock) -> bool:
        """Bring a pinned host-only tree block back into a primary slot (may evict)."""
        assert block.block_id is None and block.ref_count > 0, block
        if not self._free and not self._unused and not self._evict_one():
            return False
        block.block_id = self._take_slot()
        if self.storage is not None:
            self.storage.onboard(block.host_id, block.block_id)
        self._free_host.append(block.host_id)
        block.host_id = None
        self.num_onboards += 1
        return True

    def copy(self, src: KVBlock, dst: KVBlock) -> None:
        if self.storage is not None:
            self.storage.copy_block(src.block_id, dst.block_id)

    def commit_chain(self, blocks: list[KVBlock], start: int, keys: Sequence[tuple[int, BlockTokens]]) -> None:
        """Put computed, referenced blocks into the tree: ``blocks[start + i]`` holds
        ``keys[i]`` (hash, tokens) and goes under the block before it (the root for
        ``blocks[0]``); ``blocks[:start]`` are in the tree already.

        Each block is replaced in ``blocks`` by the canonical block for its content: itself,
        or an existing node with the same prefix (computed concurrently), which then takes
        over the reference while the block is released.
        """
        root = self.root
        parent = blocks[start - 1] if start else root
        serial = self.serial
        for index, (block_hash, tokens) in enumerate(keys, start):
            children = parent.children
            existing = None
            if children is None:
                children = parent.children = {}
            else:  # KVBlock.child inlined: every computed block is committed here
                for candidate in children.get(block_hash, ()):
                    if candidate.tokens == tokens:  # verified: equal hash alone proves nothing
                        existing = candidate
                        break
            block = blocks[index]
            if existing is None:
                block.tokens, block.hash, block.parent = tokens, block_hash, parent
                serial += 1
                block.serial = serial
                bucket = children.get(block_hash)
                if bucket is None:
                    children[block_hash] = [block]
                else:
                    bucket.append(block)
                if parent.by_first is not None:  # indexed (see KVBlock.by_first)
                    parent.by_first.setdefault(tokens[:TOKEN_BYTES], []).append(block)
                parent = block
                continue
            if existing.block_id is None:  # host-only: our fresh primary copy becomes its primary slot
                if existing.ref_count == 0:  # it leaves the host LRU: its entry goes stale
                    self._num_host_cached -= 1
                self._free_host.append(existing.host_id)
                existing.host_id, existing.block_id = None, block.block_id
                existing.ref_count += 1
                block.block_id, block.ref_count = None, 0  # private, now without a slot: a spare
                self._spare.append(block)
            else:
                self.incref(existing)
                self.decref(block)  # private, so this frees its slot
            blocks[index] = parent = existing
        self.serial = serial

    # ---- eviction -------------------------------------------------------------------
    def offload_until(self, num_free: int) -> int:
        """Evict least recently used cached blocks until ``num_free`` primary slots are free or
        nothing cached is left, as an allocation would: each moves to the host tier, or, when no
        host slot can be had (every host block held), leaves the tree. Returns how many were
        evicted. Only with a host tier: without one, every eviction would drop content."""
        if not self.num_host_blocks:
            raise ValueError("offload_until needs a host tier: without one, eviction drops the blocks")
        return self._evict_until(num_free)

    def _evict_one(self) -> bool:
        """Free one primary slot from the LRU cached block; offload it if the host tier can take it."""
        return self._evict_until(self.num_free + 1) > 0

    def _evict_until(self, num_free: int) -> int:
        """Evict LRU cached blocks, oldest first, until ``num_free`` slots are free or nothing
        is left to evict; returns how many were evicted. An evicted block moves to the host
        tier when it can (dropping the host's own LRU block when the tier is full);
        otherwise it leaves the tree with its subtree.

        Every block a long replay allocates passes through here once, and usually pushes one
        host block out of the tree: the counts are kept in locals (written back around the
        rare calls that update them) and the usual host drop, a leaf, is inlined."""
        free, free_host = self._free, self._free_host
        num_free -= self._unused  # never-used slots count as free (none is left when anything is cached)
        host_tier, storage = self.num_host_blocks > 0, self.storage
        pop_oldest, pop_oldest_host, push_host = self._lru.popleft, self._host_lru.popleft, self._host_lru.append
        num_cached, num_host_cached = self._num_cached, self._num_host_cached
        evicted = dropped_whole = 0
        while num_cached and len(free) < num_free:
            victim = pop_oldest()
            victim.lru_entries -= 1
            if victim.lru_entries or victim.ref_count or victim.tokens is None or victim.block_id is None:
                continue  # a stale entry (see the module docstring)
            num_cached -= 1
            evicted += 1
            if not host_tier or not (free_host or num_host_cached):
                self._num_cached, self._num_host_cached = num_cached, num_host_cached
                self._drop_subtree(victim)  # it counts the descendants it drops
                num_cached, num_host_cached = self._num_cached, self._num_host_cached
                dropped_whole += 1
                continue
            if free_host:
                host_id = free_host.popleft()
                num_host_cached += 1  # the victim joins the host LRU below
            else:
                # The tier is full: its LRU block goes, and the victim takes its place in
                # the host LRU count. Usually a leaf (LRU order takes a prefix's deepest
                # blocks first), dropped inline: its host slot is the one the victim takes,
                # as _drop_subtree's append + popleft would hand it over.
                while True:  # the oldest live entry (_compact's test); stale ones are skipped
                    dropped = pop_oldest_host()
                    dropped.host_lru_entries -= 1
                    if not (dropped.host_lru_entries or dropped.ref_count or dropped.tokens is None
                            or dropped.block_id is not None):
                        break
                if dropped.children:  # (unreferenced, as the loop above found it)
                    self._num_cached, self._num_host_cached = num_cached, num_host_cached - 1  # it counts only the descendants
                    self._drop_subtree(dropped)
                    num_cached, num_host_cached = self._num_cached, self._num_host_cached + 1
                    host_id = free_host.popleft()
                else:  # _unlink inlined
                    parent = dropped.parent
                    children, block_hash = parent.children, dropped.hash
                    bucket = children[block_hash]
                    if len(bucket) == 1:
                        del children[block_hash]
                    else:
                        bucket.remove(dropped)
                    if parent.by_first is not None:
                        _unindex(parent.by_first, dropped)
                    host_id = dropped.host_id
                    dropped.host_id = dropped.tokens = dropped.parent = dropped.children = dropped.by_first = None
                    self._spare.append(dropped)  # out of the tree, no slot: its object is reused
            victim.host_id = host_id
            if storage is not None:
                storage.offload(victim.block_id, host_id)
            self._slot_freed(victim.block_id)  # the victim keeps its object, as the host copy
            victim.block_id = None
            push_host(victim)  # _to_host_lru inlined (counted above), its compaction done once below
            victim.host_lru_entries += 1
        self._num_cached, self._num_host_cached = num_cached, num_host_cached
        if len(self._host_lru) > 2 * num_host_cached + 64:
            self._host_lru = self._compact(self._host_lru, primary=False)
        self.num_evictions += evicted
        self.num_offloads += evicted - dropped_whole
        return evicted

    @staticmethod
    def _unlink(block: KVBlock) -> None:
        """Take ``block`` out of its parent's children (both indexes)."""
        parent = block.parent
        bucket = parent.children[block.hash]
        if len(bucket) == 1:
            del parent.children[block.hash]
        else:
            bucket.remove(block)
        if parent.by_first is not None:
            _unindex(parent.by_first, block)

    def _drop_subtree(self, block: KVBlock) -> None:
        """Remove ``block`` (already out of its LRU list) and its descendants from the tree
        and free their slots."""
        if block.ref_count:
            raise AssertionError(f"evicting referenced {block!r}")
        self._unlink(block)
        if not block.children:  # a leaf, the usual victim: LRU order takes leaves before their prefix
            self._release_node(block)
            return
        stack = [block]
        while stack:
            node = stack.pop()
            if node.ref_count:
                raise AssertionError(f"evicting referenced {node!r}: a child is held without its parent")
            if node.children:
                stack.extend(node.iter_children())
            if node is not block:  # a descendant leaves its LRU list (its entry goes stale)
                if node.block_id is not None:
                    self._num_cached -= 1
                else:
                    self._num_host_cached -= 1
            self._release_node(node)

    def _release_node(self, node: KVBlock) -> None:
        """Give a dropped tree node's slots back, with its object; it is no longer in the tree."""
        if node.host_id is not None:
            self._free_host.append(node.host_id)
            node.host_id = None
        node.tokens = node.parent = node.children = node.by_first = None
        if node.block_id is not None:
            self._free.append(node)
        else:
            self._spare.append(node)

    def _free_slot(self, block: KVBlock) -> None:
        self._free.append(block)

    # ---- integrity ------------------------------------------------------------------
    def lru_blocks(self, *, host: bool = False) -> list[KVBlock]:
        """The live entries of the primary (or host) LRU list, oldest first (for checks; O(entries))."""
        lru = self._host_lru if host else self._lru
        remaining: dict[int, int] = {}
        live = []
        for block in lru:  # an entry is live if it is its block's last and the block is evictable there
            left = remaining.get(id(block), block.host_lru_entries if host else block.lru_entries) - 1
            remaining[id(block)] = left
            if left or block.ref_count or block.tokens is None or (block.block_id is None) is not host:
                continue
            live.append(block)
        return live

    def check_integrity(self, held_blocks: Iterable[KVBlock] = ()) -> None:
        """Raise AssertionError unless free + cached + held partition the primary slots."""
        held = {id(b): b for b in held_blocks}
        assert all(b.ref_count == 0 and b.tokens is None and b.host_id is None for b in self._free), "a free block is in use"
        assert all(b.block_id is None and b.ref_count == 0 and b.tokens is None for b in self._spare), "a spare holds a slot"
        free = {b.block_id for b in self._free} | set(range(self.num_blocks - self._unused, self.num_blocks))
        lru = self.lru_blocks()
        cached = {b.block_id for b in lru}
        assert len(cached) == len(lru) == self._num_cached, f"{len(lru)} cached blocks, counted {self._num_cached}"
        host_lru = self.lru_blocks(host=True)
        assert len(host_lru) == self._num_host_cached, f"{len(host_lru)} host blocks, counted {self._num_host_cached}"
        held_ids = {b.block_id for b in held.values() if b.block_id is not None}
        assert len(free) == self.num_free, "a slot is on the free list twice"
        assert not (free & cached) and not (free & held_ids) and not (cached & held_ids), "a slot is in two sets"
        assert len(free) + len(cached) + len(held_ids) == self.num_blocks, (
            f"leak: free {len(free)} + cached {len(cached)} + held {len(held_ids)} != {self.num_blocks}"
        )
        assert all(b.ref_count == 0 and b.in_tree for b in lru), "a cached block is referenced"
        assert all(b.ref_count == 0 and b.in_tree and b.host_id is not None for b in host_lru), "bad host LRU block"
        assert len(self._free_host) + len(host_lru) + sum(
            1 for b in held.values() if b.host_id is not None
        ) == self.num_host_blocks, "host slot leak"
