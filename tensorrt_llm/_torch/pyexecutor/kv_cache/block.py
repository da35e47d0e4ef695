"""``KVBlock``: one block of KV content, the unit the pool hands out and the prefix tree links.

A block object plays three parts, each read by the module that owns it::

    slots        block_id (primary, or None)  host_id (host tier, or None)     BlockPool, HostTier
    references   ref_count: the sequences and claims that hold it              BlockPool
    tree         tokens, hash, parent, children, by_first, serial              PrefixTree
                 event_hash: the chained identity hash events carry (events on)  PrefixTree
    LRU          lru_entries, host_lru_entries (entries in the LRU deques)      BlockPool, HostTier

A block is in the prefix tree exactly when ``tokens`` is set; it may then live in primary memory,
in the host tier only (``block_id is None``), or both for an instant during a move. Objects are
built once per slot and reused (see :mod:`.block_pool`), so a block's identity is its content's
only while it is in the tree; ``serial`` tells one stay in the tree from the next.
"""

from __future__ import annotations

from typing import Iterable, Protocol

# A block's token ids packed as native unsigned 32-bit ints (``array("I").tobytes()``); the
# ids are below the vocabulary size, at most 2**32 (submission checks it).
BlockTokens = bytes
TOKEN_BYTES = 4


class BlockStorage(Protocol):
    """Moves real K/V between slots; the pool calls it only when tensors exist."""

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None: ...

    def offload(self, block_id: int, host_id: int) -> None: ...

    def onboard(self, host_id: int, block_id: int) -> None: ...


class KVBlock:
    """One block of KV content: a primary slot and/or a host slot, possibly a tree node."""

    __slots__ = (
        "block_id", "host_id", "ref_count", "tokens", "hash", "parent", "children", "by_first", "serial",
        "event_hash", "lru_entries", "host_lru_entries",
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
        # (PrefixTree.match_partial), kept up to date from then on; None until then. Only the parents
        # of first chunks' partial blocks are ever asked (the root, mostly): the other nodes, nearly all
        # the tree, never pay for an index at commit or drop.
        self.by_first: dict[bytes, list[KVBlock]] | None = None
        self.serial = 0  # commit order among the tree's blocks (orders a by_first index built late)
        # the chained identity hash KV cache events name this node by (events.chain_hash); set at
        # commit only when events are on (the root's stays events.ROOT_HASH)
        self.event_hash = 0
        # entries of this block in the pool's primary / host LRU deques (the last one may be live)
        self.lru_entries = 0
        self.host_lru_entries = 0

    @property
    def in_tree(self) -> bool:
        return self.tokens is not None

    def iter_children(self) -> Iterable[KVBlock]:
        if self.children:
            for bucket in self.children.values():
                yield from bucket

    def __repr__(self) -> str:
        where = f"gpu{self.block_id}" if self.block_id is not None else f"host{self.host_id}"
        return f"KVBlock({where} ref={self.ref_count} cached={self.in_tree})"
