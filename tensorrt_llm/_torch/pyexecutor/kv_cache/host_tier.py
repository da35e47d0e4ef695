"""``HostTier``: the host slots behind the primary pool, and the LRU order of the blocks there.

A tree block evicted from primary memory moves here when it can, keeping its object and its
place in the prefix tree, so it still matches; a claim that matches it pins it and onboards it::

    primary slot ──evict: offload──► host slot ──claim + onboard──► primary slot
                                         │
                                         └── the tier is full: its LRU block is dropped from the
                                             tree (with its subtree) and its slot reused

Every host slot is free, or holds one host-only tree block, cached (``ref_count == 0``, in
:attr:`lru`) or held (pinned by a claim until it is onboarded)::

    len(free) + num_cached + held host-only blocks == num_blocks

The pool moves the blocks (:meth:`.BlockPool.onboard`, its eviction loop, which reads ``free`` and
``lru`` directly: it runs once per evicted block); this class keeps the slots and the order.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.lru import SLACK, compact, live_blocks


class HostTier:
    """Host slots: the free ones, and the cached host-only tree blocks, least recently used first."""

    __slots__ = ("num_blocks", "free", "lru", "num_cached")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # free host slots, handed out oldest first
        self.lru: deque[KVBlock] = deque()  # host-only tree blocks, with stale entries (see .lru)
        self.num_cached = 0  # live entries of ``lru``

    def push(self, block: KVBlock) -> None:
        """``block`` (host-only, in the tree) became evictable: the most recently used end."""
        self.lru.append(block)
        block.host_lru_entries += 1
        self.num_cached += 1
        if len(self.lru) > 2 * self.num_cached + SLACK:
            self.lru = compact(self.lru, host=True)

    def lru_blocks(self) -> list[KVBlock]:
        """The cached host-only blocks, oldest first (for checks; O(entries))."""
        return live_blocks(self.lru, host=True)

    def check(self, held: Iterable[KVBlock]) -> None:
        """Raise AssertionError unless free + cached + held partition the host slots."""
        cached = self.lru_blocks()
        assert len(cached) == self.num_cached, f"{len(cached)} host blocks, counted {self.num_cached}"
        assert all(b.ref_count == 0 and b.in_tree and b.host_id is not None for b in cached), "bad host LRU block"
        held_here = sum(1 for b in held if b.host_id is not None)
        assert len(self.free) + len(cached) + held_here == self.num_blocks, "host slot leak"
