"""The prefix tree: block keys, lookup, and the commit of computed chains.

A node is a :class:`~.block.KVBlock` holding one full block of tokens; the chain from the root
is the prefix those tokens continue::

    root ─┬─ [A0] ── [A1] ─┬─ [A2]          prompt A: A0 A1 A2 ...
          │                └─ [B2] ── [B3]  prompt B shares A's first two blocks
          └─ [C0]                           children keyed by hash(tokens), every hit verified

* Keys: a block's key is ``(hash, tokens)``, ``tokens`` packed (:data:`~.block.BlockTokens`), so
  a verification is one memcmp. :func:`pack_tokens` packs a prompt, :func:`block_keys` keys its
  full blocks (:func:`content_hashes` by default: the same in every process, which ranks rely on).
  A hash collision costs a comparison, never wrong KV.
* Lookup: :meth:`PrefixTree.match` walks keys down from a node (either tier matches);
  :meth:`PrefixTree.match_partial` finds the primary child sharing the longest token prefix with
  a block (partial reuse).
* Commit: :meth:`PrefixTree.commit_chain` links computed blocks under their predecessors. A
  block whose content a node already holds (computed concurrently) is replaced by that node,
  and the pool's ``merge`` moves the reference onto it.

The tree owns links only: the pool owns slots, reference counts and LRU order, and drops a
node with its subtree (:meth:`unlink`) when eviction reaches it. With an event buffer
(:mod:`.events`) the tree says what joined it (``BlocksStored``, at commit) and what left it
(``BlocksRemoved``, at :meth:`drop`), naming each node by its chained ``event_hash``. Holding a block means holding
its ancestors, so ``ref_count(parent) >= ref_count(child)`` and a node never leaves the tree
before its descendants.
"""

from __future__ import annotations

import functools
from array import array
from typing import Callable, Sequence

import numpy as np

from tensorrt_llm._torch.pyexecutor.kv_cache.block import TOKEN_BYTES, BlockTokens, KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.events import (
    BlocksRemoved,
    BlocksStored,
    CacheLevel,
    KVCacheEventBuffer,
    StoredBlock,
    chain_hash,
)
from tensorrt_llm._torch.pyexecutor.llm_request import TOKEN_TYPECODE

BlockKey = tuple[int, BlockTokens]  # (hash, packed tokens) of one full block

_ID_LIMIT = 1 << 32  # token ids key the tree as unsigned 32-bit ints
_FOLD = np.uint32(16)  # content_hashes folds a hash's high half into its low one


# ---- keys -----------------------------------------------------------------------------------
def pack_tokens(tokens: array | Sequence[int]) -> np.ndarray:
    """``tokens`` as the prefix tree keys them: native unsigned 32-bit ids (``.tobytes()`` of a
    block's slice is its :data:`~.block.BlockTokens`).

    Takes a packed token array (``LlmRequest.tokens`` or a slice of it: viewed, one numpy
    conversion) or a sequence of ints; raises ValueError unless every id is an int in [0, 2**32).
    """
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:  # every prompt: one reduction checks it
        ids = np.frombuffer(tokens, dtype=np.int64)
        if ids.size and ids.view(np.uint64).max() >= _ID_LIMIT:  # a negative id, seen unsigned, is above 2**63
            raise ValueError(f"token ids must be ints in [0, 2**32) to key the prefix tree, got {tokens!r:.80}")
        return ids.astype(np.uint32)
    ids = np.asarray(tokens) if len(tokens) else np.empty(0, dtype=np.int64)
    if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= _ID_LIMIT)):
        raise ValueError(f"token ids must be ints in [0, 2**32) to key the prefix tree, got {tokens!r:.80}")
    return ids.astype(np.uint32)


@functools.lru_cache(maxsize=8)
def _hash_weights(tokens_per_block: int) -> np.ndarray:
    """One fixed odd 32-bit weight per position in a block (the same in every process)."""
    rng = np.random.default_rng(0x6B765F68617368)
    return rng.integers(0, 1 << 31, size=tokens_per_block, dtype=np.uint32) * np.uint32(2) + np.uint32(1)


def content_hashes(packed: np.ndarray, num_blocks: int, tokens_per_block: int) -> list[int]:
    """The default block hash of the first ``num_blocks`` blocks of ``packed`` (:func:`pack_tokens`), all at once.

    A multilinear hash, ``sum(w[i] * token[i]) mod 2**32`` with its high half folded into the
    low one (dicts index by the low bits): one numpy pass over the whole prompt, with no
    temporary, instead of a Python call per block; and the same in every process (Python's
    ``hash`` of bytes is salted per process; tensor-parallel ranks must take identical
    decisions). A collision costs a comparison only: every hit is verified against the tokens.
    """
    ids = packed[: num_blocks * tokens_per_block]
    h = ids.reshape(num_blocks, tokens_per_block) @ _hash_weights(tokens_per_block)  # (num_blocks,) uint32, wraps
    h ^= h >> _FOLD
    return h.tolist()


def block_keys(
    packed: np.ndarray,
    num_blocks: int,
    tokens_per_block: int,
    block_hash: Callable[[BlockTokens], int] | None = None,
    buffer: bytes | None = None,
) -> list[BlockKey]:
    """The keys of the first ``num_blocks`` full blocks of ``packed`` (``buffer``: its bytes, if
    at hand), hashed by ``block_hash`` (None: :func:`content_hashes`)."""
    width = tokens_per_block * TOKEN_BYTES
    if buffer is None:
        buffer = packed.tobytes()
    if block_hash is None:
        hashes = content_hashes(packed, num_blocks, tokens_per_block) if num_blocks else []
        return [(h, buffer[i : i + width]) for h, i in zip(hashes, range(0, num_blocks * width, width))]
    blocks = [buffer[i : i + width] for i in range(0, num_blocks * width, width)]
    return list(zip(map(block_hash, blocks), blocks))


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


def _serial(block: KVBlock) -> int:
    return block.serial


def unindex(by_first: dict[bytes, list[KVBlock]], block: KVBlock) -> None:
    """Take ``block``, leaving the tree, out of its parent's first-token index."""
    first = block.tokens[:TOKEN_BYTES]
    siblings = by_first[first]
    if len(siblings) == 1:
        del by_first[first]
    else:
        siblings.remove(block)


# ---- the tree -------------------------------------------------------------------------------
class PrefixTree:
    """The tree's root and commit order; lookup, commit and unlinking of nodes.

    Slots and reference counts are the pool's, which the tree calls for them:
    ``merge(node, duplicate)`` when a committed block's content is already a node's (the node
    takes over the duplicate's reference), ``release(node, descendant)`` for each node
    :meth:`drop` takes out of the tree. ``serial`` is the :attr:`~.block.KVBlock.serial` of the
    last block committed (0: none yet). ``events``: where stored and removed blocks are told
    (None: events off, nothing computed for them).
    """

    __slots__ = ("root", "serial", "events", "_merge", "_release")

    def __init__(
        self,
        merge: Callable[[KVBlock, KVBlock], None],
        release: Callable[[KVBlock, bool], None],
        events: KVCacheEventBuffer | None = None,
    ) -> None:
        self.root = KVBlock(None)
        self.serial = 0
        self.events = events
        self._merge = merge
        self._release = release

    def match(self, keys: list[BlockKey], parent: KVBlock | None = None, start: int = 0) -> list[KVBlock]:
        """Longest chain of nodes (either tier) equal to ``keys[start:]``, below ``parent`` (default: the root)."""
        # KVBlock lookup inlined: the schedulers walk every waiting prompt every iteration.
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
        ``tokens`` (the earliest committed among equals), and how many tokens it shares.

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

    def commit_chain(self, blocks: list[KVBlock], start: int, keys: Sequence[BlockKey]) -> None:
        """Put computed, referenced blocks into the tree: ``blocks[start + i]`` holds ``keys[i]``
        and goes under the block before it (the root for ``blocks[0]``); ``blocks[:start]`` are
        in the tree already.

        Each block is replaced in ``blocks`` by the canonical block for its content: itself, or
        a node with the same prefix (computed concurrently), which then takes over the
        reference (``merge``) while the block is released.
        """
        parent = blocks[start - 1] if start else self.root
        serial = self.serial
        events = self.events
        run: list[KVBlock] = []  # events on: the new nodes since the last existing one, a chain
        for index, (block_hash, tokens) in enumerate(keys, start):
            children = parent.children
            existing = None
            if children is None:
                children = parent.children = {}
            else:  # match inlined: every computed block is committed here
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
                if events is not None:
                    block.event_hash = chain_hash(parent.event_hash, tokens)
                    run.append(block)
                parent = block
                continue
            if run:  # the chain stored so far comes first: the merge may move ``existing`` (an event)
                self._stored(run)
                run = []
            self._merge(existing, block)
            blocks[index] = parent = existing
        self.serial = serial
        if run:
            self._stored(run)

    def _stored(self, run: list[KVBlock]) -> None:
        """Tell the buffer that ``run``, a chain of new primary nodes, joined the tree."""
        parent = run[0].parent
        self.events.emit(BlocksStored(
            None if parent is self.root else parent.event_hash,
            tuple(StoredBlock(block.event_hash, block.tokens) for block in run),
            len(run[0].tokens) // TOKEN_BYTES,
        ))

    @staticmethod
    def unlink(block: KVBlock) -> None:
        """Take ``block`` out of its parent's children (both indexes); its own links stay for the caller."""
        parent = block.parent
        bucket = parent.children[block.hash]
        if len(bucket) == 1:
            del parent.children[block.hash]
        else:
            bucket.remove(block)
        if parent.by_first is not None:
            unindex(parent.by_first, block)

    def drop(self, block: KVBlock, *, tell: bool = True) -> None:
        """Take unreferenced ``block`` (already out of its LRU list) and its subtree out of the
        tree, blank, and hand each node to ``release``: ``block`` first, then its descendants
        (each subtree's nodes after their parent). With events on (and ``tell``), the nodes
        removed are told, descendants first, one event per run of nodes in the same tier."""
        if block.ref_count:
            raise AssertionError(f"evicting referenced {block!r}")
        self.unlink(block)
        release = self._release
        events = self.events if tell else None
        if not block.children:  # a leaf, the usual victim: LRU order takes leaves before their prefix
            if events is not None:
                events.emit(BlocksRemoved((block.event_hash,), tier(block)))
            block.tokens = block.parent = block.children = block.by_first = None
            release(block, False)
            return
        removed: list[tuple[int, CacheLevel]] = []
        stack = [block]
        while stack:
            node = stack.pop()
            if node.ref_count:
                raise AssertionError(f"evicting referenced {node!r}: a child is held without its parent")
            if node.children:
                stack.extend(node.iter_children())
            if events is not None:
                removed.append((node.event_hash, tier(node)))  # before release frees its slots
            node.tokens = node.parent = node.children = node.by_first = None
            release(node, node is not block)
        if events is not None:
            self._removed(removed)

    def _removed(self, nodes: list[tuple[int, CacheLevel]]) -> None:
        """Tell the buffer that ``nodes`` (hash and tier, ancestors first) left the tree:
        descendants first, one event per run of nodes in the same tier."""
        run: list[int] = []
        level = None
        for event_hash, node_level in reversed(nodes):
            if node_level is not level and run:
                self.events.emit(BlocksRemoved(tuple(run), level))
                run = []
            level = node_level
            run.append(event_hash)
        self.events.emit(BlocksRemoved(tuple(run), level))


def tier(block: KVBlock) -> CacheLevel:
    """The tier a tree block lives in now."""
    return CacheLevel.HOST if block.block_id is None else CacheLevel.GPU
