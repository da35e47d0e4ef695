"""The KV block pool: reference-counted blocks, the prefix tree, LRU eviction, the host tier.

Every primary slot is in exactly one of three sets::

    free      no content, on the free list
    held      ref_count > 0: in some sequence's block table (or pinned during a claim)
    cached    ref_count == 0, content in the prefix tree, evictable (primary LRU)

so ``num_free + num_cached + num_held == num_blocks``. A tree block may also live only in
the host tier (``block_id is None``): it still matches, and a claim onboards it.

The prefix tree is keyed by block content: a node's children are indexed by the hash of
the child's tokens and every hit is verified against the tokens, so a hash collision can
never hand out the wrong KV. The chain from the root is the prefix; a sequence that
holds a block holds all its ancestors, hence ``ref_count(parent) >= ref_count(child)``
and evicting a block may drop its whole (unreferenced) subtree.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Callable, Iterable, Protocol

logger = logging.getLogger(__name__)

BlockTokens = tuple[int, ...]


class BlockStorage(Protocol):
    """Moves real K/V between slots; the pool calls it only when tensors exist."""

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None: ...

    def offload(self, block_id: int, host_id: int) -> None: ...

    def onboard(self, host_id: int, block_id: int) -> None: ...


class KVBlock:
    """One block of KV content: a primary slot and/or a host slot, possibly a tree node."""

    __slots__ = ("block_id", "host_id", "ref_count", "tokens", "hash", "parent", "children", "depth")

    def __init__(self, block_id: int | None) -> None:
        self.block_id = block_id
        self.host_id: int | None = None
        self.ref_count = 0
        self.tokens: BlockTokens | None = None  # set when committed to the tree
        self.hash = 0
        self.parent: KVBlock | None = None
        self.children: dict[int, list[KVBlock]] | None = None
        self.depth = 0  # number of blocks before this one in its prefix

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
        return f"KVBlock({where} ref={self.ref_count} depth={self.depth} cached={self.in_tree})"


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
        block_hash: Callable[[BlockTokens], int] = hash,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.storage = storage
        self.block_hash = block_hash
        self.root = KVBlock(None)
        self._free: deque[int] = deque(range(num_blocks))
        self._free_host: deque[int] = deque(range(num_host_blocks))
        self._lru: OrderedDict[KVBlock, None] = OrderedDict()  # cached primary blocks, oldest first
        self._host_lru: OrderedDict[KVBlock, None] = OrderedDict()  # host-only tree blocks, oldest first
        self.num_evictions = 0
        self.num_offloads = 0
        self.num_onboards = 0

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def available(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_host_cached(self) -> int:
        return len(self._host_lru)

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
        """The primary-resident child of ``parent`` sharing the longest token prefix with ``tokens``.

        Partial reuse copies from primary memory only: onboarding a whole host block to
        salvage part of it is not worth a free slot.
        """
        best, best_len = None, 0
        for candidate in (parent or self.root).iter_children():
            if candidate.block_id is None:
                continue
            n = 0
            for mine, theirs in zip(tokens, candidate.tokens):
                if mine != theirs:
                    break
                n += 1
            if n > best_len:
                best, best_len = candidate, n
        return best, best_len

    # ---- references -----------------------------------------------------------------
    def incref(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            if block.block_id is not None:
                self._lru.pop(block, None)
            else:
                self._host_lru.pop(block, None)
        block.ref_count += 1

    def decref(self, block: KVBlock) -> None:
        if block.ref_count <= 0:
            raise AssertionError(f"decref of unreferenced {block!r}")
        block.ref_count -= 1
        if block.ref_count:
            return
        if not block.in_tree:
            self._free_slot(block)
        elif block.block_id is not None:
            self._lru[block] = None  # most recently used end
        else:
            self._host_lru[block] = None

    # ---- allocation -----------------------------------------------------------------
    def allocate(self) -> KVBlock | None:
        """A fresh private block with ref_count 1, evicting the LRU cached block if needed."""
        if not self._free and not self._evict_one():
            return None
        block = KVBlock(self._free.popleft())
        block.ref_count = 1
        return block

    def onboard(self, block: KVBlock) -> bool:
        """Bring a pinned host-only tree block back into a primary slot (may evict)."""
        assert block.block_id is None and block.ref_count > 0, block
        if not self._free and not self._evict_one():
            return False
        block.block_id = self._free.popleft()
        if self.storage is not None:
            self.storage.onboard(block.host_id, block.block_id)
        self._free_host.append(block.host_id)
        block.host_id = None
        self.num_onboards += 1
        return True

    def copy(self, src: KVBlock, dst: KVBlock) -> None:
        if self.storage is not None:
            self.storage.copy_block(src.block_id, dst.block_id)

    def commit(self, parent: KVBlock | None, block: KVBlock, tokens: BlockTokens) -> KVBlock:
        """Put a computed, referenced block into the tree under ``parent``.

        Returns the canonical block for this content: ``block`` itself, or an existing
        node with the same prefix (computed concurrently), which then takes over the
        reference and ``block`` is released. Callers must use the returned block.
        """
        parent = parent or self.root
        block_hash = self.block_hash(tokens)
        existing = parent.child(block_hash, tokens)
        if existing is None:
            block.tokens, block.hash, block.parent = tokens, block_hash, parent
            block.depth = parent.depth + 1 if parent is not self.root else 0
            if parent.children is None:
                parent.children = {}
            parent.children.setdefault(block_hash, []).append(block)
            return block
        if existing.block_id is None:  # host-only: our fresh primary copy becomes its primary slot
            self._host_lru.pop(existing, None)
            self._free_host.append(existing.host_id)
            existing.host_id, existing.block_id = None, block.block_id
            existing.ref_count += 1
            return existing
        self.incref(existing)
        self.decref(block)  # private, so this frees its slot
        return existing

    # ---- eviction -------------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Free one primary slot from the LRU cached block; offload it if the host tier can take it."""
        if not self._lru:
            return False
        victim, _ = self._lru.popitem(last=False)
        self.num_evictions += 1
        if self.num_host_blocks and (self._free_host or self._evict_host_one()):
            victim.host_id = self._free_host.popleft()
            if self.storage is not None:
                self.storage.offload(victim.block_id, victim.host_id)
            self._free.append(victim.block_id)
            victim.block_id = None
            self._host_lru[victim] = None
            self.num_offloads += 1
        else:
            self._drop_subtree(victim)
        return True

    def _evict_host_one(self) -> bool:
        if not self._host_lru:
            return False
        victim, _ = self._host_lru.popitem(last=False)
        self._drop_subtree(victim)
        return True

    def _drop_subtree(self, block: KVBlock) -> None:
        """Remove ``block`` and its descendants from the tree and free their slots."""
        bucket = block.parent.children[block.hash]
        bucket.remove(block)
        if not bucket:
            del block.parent.children[block.hash]
        stack = [block]
        while stack:
            node = stack.pop()
            if node.ref_count:
                raise AssertionError(f"evicting referenced {node!r}: a child is held without its parent")
            stack.extend(node.iter_children())
            self._lru.pop(node, None)
            self._host_lru.pop(node, None)
            if node.host_id is not None:
                self._free_host.append(node.host_id)
            node.tokens, node.parent, node.children = None, None, None
            if node.block_id is not None:
                self._free.append(node.block_id)
                node.block_id = None

    def _free_slot(self, block: KVBlock) -> None:
        self._free.append(block.block_id)
        block.block_id = None

    # ---- integrity ------------------------------------------------------------------
    def check_integrity(self, held_blocks: Iterable[KVBlock] = ()) -> None:
        """Raise AssertionError unless free + cached + held partition the primary slots."""
        held = {id(b): b for b in held_blocks}
        free = set(self._free)
        cached = {b.block_id for b in self._lru}
        held_ids = {b.block_id for b in held.values() if b.block_id is not None}
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert not (free & cached) and not (free & held_ids) and not (cached & held_ids), "a slot is in two sets"
        assert len(free) + len(cached) + len(held_ids) == self.num_blocks, (
            f"leak: free {len(free)} + cached {len(cached)} + held {len(held_ids)} != {self.num_blocks}"
        )
        assert all(b.ref_count == 0 and b.in_tree for b in self._lru), "a cached block is referenced"
        assert len(self._free_host) + len(self._host_lru) + sum(
            1 for b in held.values() if b.host_id is not None
        ) == self.num_host_blocks, "host slot leak"
