"""An index of one pool's reusable blocks built from its KV cache events alone, as a router builds it.

:class:`ReplayedIndex` applies events in order and refuses any a consumer could not apply: a
stored block whose parent it has never seen, a removal of a block it does not hold (or that
still has children), a move from a tier the block is not in, a gap in the event numbers.
:func:`pool_index` reads the same thing from the pool itself (its prefix tree); the property
tests compare the two after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.kv_cache.events import (
    AllBlocksCleared,
    BlockMoved,
    BlocksRemoved,
    BlocksStored,
    CacheLevel,
    KVEventRecord,
    PoolCreated,
    chain_hash,
)
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import tier

#: hash -> (parent hash or None, tokens, tier)
Index = dict[int, tuple[int | None, bytes, CacheLevel]]


@dataclass
class ReplayedIndex:
    """The reusable blocks the events describe, applied in order (``apply`` raises on one that
    a consumer could not apply)."""

    blocks: Index = field(default_factory=dict)
    next_id: int = 0
    created: tuple[int, int] | None = None
    cleared: int = 0

    def apply(self, records: list[KVEventRecord]) -> None:
        for record in records:
            assert record.event_id == self.next_id, f"event {record.event_id} after {self.next_id - 1}: a gap"
            self.next_id += 1
            self._apply(record.event)

    def _apply(self, event) -> None:
        blocks = self.blocks
        if isinstance(event, PoolCreated):
            assert self.created is None, "created twice"
            self.created = event.num_blocks_per_cache_level
        elif isinstance(event, BlocksStored):
            parent = event.parent_hash
            assert parent is None or parent in blocks, f"stored under unknown parent {parent}: {event}"
            for block in event.blocks:
                assert block.block_hash not in blocks, f"stored twice: {block.block_hash}"
                assert len(block.tokens) == 4 * event.block_size, "only full blocks are stored"
                # the identity hash is the chain's: a router recomputes it from the tokens
                assert block.block_hash == chain_hash(parent or 0, block.tokens), "not the chained hash"
                blocks[block.block_hash] = (parent, block.tokens, event.level)
                parent = block.block_hash
        elif isinstance(event, BlocksRemoved):
            for block_hash in event.block_hashes:
                assert block_hash in blocks, f"removed unknown block {block_hash}"
                assert blocks[block_hash][2] is event.level, f"removed {block_hash} from the wrong tier"
                assert not any(p == block_hash for p, _, _ in blocks.values() if p is not None), (
                    f"removed {block_hash} before its children")
                del blocks[block_hash]
        elif isinstance(event, BlockMoved):
            block_hash = event.block.block_hash
            assert block_hash in blocks, f"moved unknown block {block_hash}"
            parent, tokens, level = blocks[block_hash]
            assert level is event.source, f"moved {block_hash} from {event.source!r}, it is in {level!r}"
            assert (parent, tokens) == (event.parent_hash, event.block.tokens), "a move changed the block"
            blocks[block_hash] = (parent, tokens, event.destination)
        elif isinstance(event, AllBlocksCleared):
            assert set(event.block_hashes) == set(blocks), "a reset named other blocks than the index held"
            blocks.clear()
            self.cleared += 1
        else:
            raise AssertionError(f"unknown event {event!r}")


def pool_index(pool: BlockPool) -> Index:
    """The pool's reusable blocks (its prefix tree, both tiers), as the events name them."""
    root, index = pool.tree.root, {}
    stack = list(root.iter_children())
    while stack:
        node = stack.pop()
        parent = None if node.parent is root else node.parent.event_hash
        index[node.event_hash] = (parent, node.tokens, tier(node))
        stack.extend(node.iter_children())
    return index


def describe_difference(replayed: Index, actual: Index) -> str:
    missed = sorted(set(actual) - set(replayed))
    stale = sorted(set(replayed) - set(actual))
    wrong = sorted(h for h in set(actual) & set(replayed) if actual[h] != replayed[h])
    return (f"events missed {len(missed)} block(s) {missed[:4]}, kept {len(stale)} stale {stale[:4]},"
            f" {len(wrong)} in another tier or place {[(actual[h][2], replayed[h][2]) for h in wrong[:4]]}")
