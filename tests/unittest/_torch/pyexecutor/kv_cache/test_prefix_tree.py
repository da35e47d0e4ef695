"""PrefixTree: block keys, lookup (whole and partial blocks), the commit of chains, and dropping.

The tree is driven alone, with block objects made by hand and the two callbacks it makes to its
owner (``merge``, ``release``) recorded, so each contract is checked without a pool: the tree
links and unlinks nodes, the pool (not here) owns slots and reference counts. The tests of
hashing and packing are the tree's keys.
"""

import subprocess
import sys
from array import array

import pytest

from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import (
    PrefixTree,
    block_keys,
    common_prefix_tokens,
    content_hashes,
    pack_tokens,
)

TPB = 4


def packed(*ids: int) -> bytes:
    return array("I", ids).tobytes()


def key(ids: list[int], block_hash: int | None = None) -> tuple[int, bytes]:
    """A block key; ``block_hash`` forces a hash (colliding keys), else any stable one."""
    return (sum(ids) if block_hash is None else block_hash), packed(*ids)


class Owner:
    """Plays the pool: records what the tree hands back."""

    def __init__(self) -> None:
        self.merged: list[tuple[KVBlock, KVBlock]] = []
        self.released: list[tuple[KVBlock, bool]] = []
        self.tree = PrefixTree(merge=lambda node, dup: self.merged.append((node, dup)),
                               release=lambda node, descendant: self.released.append((node, descendant)))
        self._next_id = 0

    def blocks(self, n: int) -> list[KVBlock]:
        made = [KVBlock(self._next_id + i, 1) for i in range(n)]
        self._next_id += n
        return made

    def commit(self, keys: list[tuple[int, bytes]], start_blocks: list[KVBlock] = ()) -> list[KVBlock]:
        """Fresh blocks for ``keys``, committed below ``start_blocks`` (already in the tree)."""
        chain = [*start_blocks, *self.blocks(len(keys))]
        self.tree.commit_chain(chain, len(start_blocks), keys)
        return chain


# ---- keys -------------------------------------------------------------------------------
def test_a_block_hashes_alike_alone_or_within_a_prompt():
    """Prompt blocks are hashed a prompt at a time, generated blocks a few at a time: equal
    content must get equal hashes either way, or a generated block would never match."""
    prompt = [(i * 7919) % 500 + 1 for i in range(5 * TPB)]
    whole = content_hashes(pack_tokens(prompt), 5, TPB)
    alone = [content_hashes(pack_tokens(prompt[i * TPB : (i + 1) * TPB]), 1, TPB)[0] for i in range(5)]
    assert whole == alone
    assert len(set(whole)) == 5  # not a constant


def test_the_default_hash_is_the_same_in_another_process():
    """Ranks must key blocks alike: the default hash depends on nothing salted per process
    (Python's ``hash`` of bytes is)."""
    probe = ("from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import content_hashes, pack_tokens;"
             "print(content_hashes(pack_tokens(list(range(1, 13))), 3, 4))")
    other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert other == str(content_hashes(pack_tokens(list(range(1, 13))), 3, TPB))


def test_block_keys_slice_the_packed_prompt_and_use_the_given_hash():
    tokens = pack_tokens(list(range(1, 11)))  # two full blocks and two tokens
    default = block_keys(tokens, 2, TPB)
    assert [t for _, t in default] == [packed(1, 2, 3, 4), packed(5, 6, 7, 8)]
    assert [h for h, _ in default] == content_hashes(tokens, 2, TPB)
    assert block_keys(tokens, 2, TPB, block_hash=len) == [(16, packed(1, 2, 3, 4)), (16, packed(5, 6, 7, 8))]
    assert block_keys(tokens, 0, TPB) == []


def test_common_prefix_counts_tokens_not_bytes():
    a = pack_tokens([1, 2, 3, 4]).tobytes()
    assert common_prefix_tokens(a, pack_tokens([1, 2, 3, 4]).tobytes()) == 4
    assert common_prefix_tokens(a, pack_tokens([1, 2, 9, 4]).tobytes()) == 2
    assert common_prefix_tokens(a, pack_tokens([1 + 256, 2, 3, 4]).tobytes()) == 0  # same low byte, other token
    assert common_prefix_tokens(a, pack_tokens([1, 2]).tobytes()) == 2


@pytest.mark.parametrize("bad", [-1, 1 << 32, 1.0])
def test_tokens_the_tree_cannot_key_are_refused(bad):
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens([1, bad, 2])


def test_a_packed_token_array_is_checked_too():
    from tensorrt_llm._torch.pyexecutor.llm_request import TOKEN_TYPECODE

    assert pack_tokens(array(TOKEN_TYPECODE, [3, 4])).tolist() == [3, 4]
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens(array(TOKEN_TYPECODE, [3, -4]))


# ---- lookup and commit ----------------------------------------------------------------
def test_a_committed_chain_matches_from_the_root_and_from_where_a_walk_stopped():
    owner = Owner()
    keys = [key([1, 2, 3, 4]), key([5, 6, 7, 8]), key([9, 10, 11, 12])]
    chain = owner.commit(keys)
    tree = owner.tree
    assert tree.match(keys) == chain
    assert tree.match(keys[:2] + [key([0, 0, 0, 1])]) == chain[:2]  # stops at the first miss
    assert tree.match(keys, chain[0], start=1) == chain[1:]  # a walk resumed below its last block
    assert [b.parent for b in chain] == [tree.root, chain[0], chain[1]]
    assert [b.serial for b in chain] == [1, 2, 3] and tree.serial == 3
    assert not owner.merged


def test_a_hash_collision_never_matches_other_tokens():
    owner = Owner()
    a = owner.commit([key([1, 1, 1, 1], block_hash=7)])
    b = owner.commit([key([2, 2, 2, 2], block_hash=7)])  # the same bucket, other content: a sibling
    tree = owner.tree
    assert tree.match([key([1, 1, 1, 1], block_hash=7)]) == a
    assert tree.match([key([2, 2, 2, 2], block_hash=7)]) == b
    assert tree.match([key([3, 3, 3, 3], block_hash=7)]) == []
    assert len(tree.root.children[7]) == 2


def test_a_duplicate_commit_is_replaced_by_the_node_and_the_owner_merges_it():
    """Two sequences computed the same prefix: the second's blocks become the first's nodes,
    its blocks go to ``merge``, and what follows the shared part is linked below the node."""
    owner = Owner()
    first = owner.commit([key([1, 2, 3, 4]), key([5, 6, 7, 8])])
    second = owner.blocks(3)
    dups = list(second)
    owner.tree.commit_chain(second, 0, [key([1, 2, 3, 4]), key([5, 6, 7, 8]), key([9, 9, 9, 9])])
    assert second[:2] == first and second[2] is dups[2]
    assert owner.merged == [(first[0], dups[0]), (first[1], dups[1])]
    assert second[2].parent is first[1] and owner.tree.serial == 3  # a merged block gets no serial


def test_partial_match_takes_the_earliest_committed_child_with_an_index_built_late():
    """A parent's first-token index is built when partial matching first asks, from children
    kept by hash: it must still list them in commit order, and commits and drops after it is
    built must keep it up to date. A host-only child is never a partial source."""
    owner = Owner()
    tree = owner.tree
    a1 = owner.commit([key([5, 1, 1, 1], block_hash=1)])[0]
    b1 = owner.commit([key([5, 6, 9, 9], block_hash=2)])[0]
    a2 = owner.commit([key([5, 6, 7, 7], block_hash=1)])[0]  # shares a1's bucket: by hash it comes before b1
    query = packed(5, 6, 0, 0)
    assert tree.root.by_first is None
    assert tree.match_partial(None, query) == (b1, 2)  # b1 and a2 tie: b1 was committed first
    b1.ref_count = 0
    tree.drop(b1)
    assert tree.match_partial(None, query) == (a2, 2)
    c = owner.commit([key([5, 6, 0, 7], block_hash=3)])[0]
    assert tree.match_partial(None, query) == (c, 3)
    c.block_id = None  # offloaded: partial reuse copies from primary memory only
    assert tree.match_partial(None, query) == (a2, 2)
    assert tree.match_partial(None, packed(7, 6, 0, 0)) == (None, 0)
    assert tree.match_partial(a1, query) == (None, 0)  # a leaf has no children to copy from
    assert a1.in_tree


# ---- dropping -------------------------------------------------------------------------
def test_drop_takes_a_subtree_out_and_hands_every_node_to_the_owner():
    owner = Owner()
    tree = owner.tree
    trunk = owner.commit([key([1, 1, 1, 1]), key([2, 2, 2, 2])])
    left = owner.commit([key([3, 3, 3, 3])], trunk)[-1]
    right = owner.commit([key([4, 4, 4, 4])], trunk)[-1]
    for block in (*trunk, left, right):
        block.ref_count = 0
    tree.drop(trunk[1])
    assert owner.released[0] == (trunk[1], False)  # the evicted block first, its descendants after it
    assert {id(b) for b, descendant in owner.released[1:] if descendant} == {id(left), id(right)}
    assert all(not b.in_tree and b.parent is None and b.children is None for b, _ in owner.released)
    assert tree.match([key([1, 1, 1, 1]), key([2, 2, 2, 2])]) == trunk[:1]
    assert trunk[0].children == {}
    owner.released.clear()
    tree.drop(trunk[0])  # a leaf now
    assert owner.released == [(trunk[0], False)] and tree.root.children == {}


def test_drop_refuses_a_referenced_block_or_descendant():
    owner = Owner()
    chain = owner.commit([key([1, 1, 1, 1]), key([2, 2, 2, 2])])
    with pytest.raises(AssertionError, match="referenced"):
        owner.tree.drop(chain[1])
    chain[0].ref_count = 0  # a child held without its parent: a bug the drop reports
    with pytest.raises(AssertionError, match="held without its parent"):
        owner.tree.drop(chain[0])
