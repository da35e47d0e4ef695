"""BlockPool: block objects built once and reused, reference counts, LRU order, the host tier.

The pool is driven by hand (allocate, commit, release) with real packed block contents; the
steady-decode tests drive it through a real executor with the simulated engine. Every test
ends with the pool's leak oracle (``check_integrity``).
"""

import random
import sys
from array import array

import pytest
from tests.helpers.factories import make_request, make_sim_executor

from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool, KVBlock

TPB = 4


def content(seed: int, n: int = 1) -> list[bytes]:
    """``n`` distinct packed blocks of ``TPB`` tokens (what the prefix tree keys)."""
    return [array("I", range((seed + i) * TPB, (seed + i + 1) * TPB)).tobytes() for i in range(n)]


def keys(blocks: list[bytes]) -> list[tuple[int, bytes]]:
    return [(hash(b), b) for b in blocks]  # any hash: the tree verifies every hit against the tokens


def commit(pool: BlockPool, seed: int, n: int) -> list[KVBlock]:
    """``n`` fresh blocks committed as one chain from the root, still held."""
    chain = pool.allocate_many(n)
    assert len(chain) == n
    pool.tree.commit_chain(chain, 0, keys(content(seed, n)))
    return chain


# ---- objects built once -----------------------------------------------------------------
def test_a_slot_gets_its_object_on_first_use_and_keeps_it():
    pool = BlockPool(8)
    assert pool.num_block_objects == 0  # nothing built up front: a large pool costs nothing until used
    first = pool.allocate_many(5)
    assert [b.block_id for b in first] == [0, 1, 2, 3, 4] and pool.num_block_objects == 5
    pool.release(first)
    again = pool.allocate_many(8)  # the three never-used slots first, then the released ones in order
    assert [b.block_id for b in again] == [5, 6, 7, 4, 3, 2, 1, 0]
    assert {id(b) for b in again} >= {id(b) for b in first}, "a released slot's object is handed out again"
    assert pool.num_block_objects == 8 and all(b.ref_count == 1 and not b.in_tree for b in again)
    pool.check_integrity(again)


def test_released_blocks_are_blank_and_unreferenced():
    pool = BlockPool(4)
    chain = commit(pool, 0, 2)
    private = pool.allocate_many(1)[0]
    pool.release([private])
    assert private.ref_count == 0 and not private.in_tree and private.host_id is None
    pool.release(chain)
    pool.allocate_many(4)  # the two cached blocks are evicted (no host tier: dropped) and handed out again
    assert all(not b.in_tree and b.parent is None and b.children is None for b in chain)
    assert pool.num_block_objects == 4


def test_allocate_and_release_build_nothing_once_every_slot_was_used():
    """The steady path: a held block returned and a fresh one taken, over and over, allocates
    no Python object (a block is an object with a dozen fields: one per step would show)."""
    pool = BlockPool(16, 8)
    held = [commit(pool, 10 * i, 2) for i in range(4)]
    for chain in held:
        pool.release(chain)  # cached: the next allocations evict them, into the host tier
    blocks = pool.allocate_many(16)
    pool.release(blocks)
    built = pool.num_block_objects
    before = sys.getallocatedblocks()
    for _ in range(2000):
        block = pool.allocate_many(1)[0]
        pool.release([block])
        pair = pool.allocate_many(2)
        pool.release(pair)
    assert sys.getallocatedblocks() - before < 50, "objects allocated per block on the steady path"
    assert pool.num_block_objects == built
    pool.check_integrity()


# ---- reference counts -------------------------------------------------------------------
def test_reference_counts_and_the_three_sets():
    pool = BlockPool(6)
    chain = commit(pool, 0, 3)
    pool.incref_all([chain[0]])  # a second holder of the root block
    pool.release(chain)
    assert (pool.num_free, pool.num_cached) == (3, 2) and chain[0].ref_count == 1
    pool.check_integrity([chain[0]])
    pool.release([chain[0]])
    assert (pool.num_free, pool.num_cached, pool.stats().num_held) == (3, 3, 0)
    with pytest.raises(AssertionError, match="unreferenced"):
        pool.release([chain[0]])
    pool.incref_all(chain)  # a claim pins the whole prefix at once: nothing of it stays evictable
    assert pool.num_cached == 0 and pool.available == 3
    pool.release(chain)
    pool.check_integrity()


def test_a_duplicate_commit_hands_its_slot_back_and_shares_the_canonical_block():
    pool = BlockPool(4)
    first = commit(pool, 0, 2)
    second = pool.allocate_many(2)
    dup_ids = [b.block_id for b in second]
    pool.tree.commit_chain(second, 0, keys(content(0, 2)))  # the same content, computed concurrently
    assert second == first and all(b.ref_count == 2 for b in first)
    assert pool.num_free == 2 and {b.block_id for b in first}.isdisjoint(dup_ids)
    pool.release(first)
    pool.release(second)
    pool.check_integrity()


# ---- LRU ----------------------------------------------------------------------------------
def test_eviction_takes_the_least_recently_released_leaves_first():
    pool = BlockPool(6)
    a = commit(pool, 0, 2)
    b = commit(pool, 10, 2)
    pool.release(a)  # a's leaf, then its root: the oldest entries
    pool.release(b)
    assert pool.lru_blocks() == [a[1], a[0], b[1], b[0]]
    pool.allocate_many(pool.num_free + 1)  # one eviction: a's leaf
    assert not a[1].in_tree and a[0].in_tree and pool.num_evictions == 1
    assert pool.lru_blocks() == [a[0], b[1], b[0]]


def test_lru_stays_right_when_a_dropped_block_object_comes_back():
    """A dropped block's stale LRU entry stays in the deque while its object is reused for new
    content: the entry must not count for the new block, whose place is its own release."""
    pool = BlockPool(3)
    old = commit(pool, 0, 1)[0]
    pool.release([old])  # an LRU entry for old
    other = commit(pool, 5, 1)[0]
    taken = pool.allocate_many(2)  # one free slot, then old is evicted: its object comes back
    assert old in taken and not old.in_tree
    pool.release(taken)
    again = commit(pool, 20, 1)[0]  # reused slots' objects re-enter the tree
    pool.release([other])
    pool.release([again])
    assert pool.lru_blocks() == [other, again]
    fresh = pool.allocate_many(pool.num_free + 1)
    assert not other.in_tree and again.in_tree, "eviction followed the releases, not the stale entry"
    pool.check_integrity(fresh)


# ---- host tier ----------------------------------------------------------------------------
def test_offload_keeps_the_block_and_gives_its_slot_a_spare_object():
    pool = BlockPool(2, 2)
    a, b = commit(pool, 0, 2)
    pool.release([a, b])
    fresh = pool.allocate_many(2)  # both evicted into the host tier, leaves first
    assert (a.block_id, b.block_id) == (None, None) and a.host_id is not None and b.in_tree
    assert not ({id(a), id(b)} & {id(f) for f in fresh}), "the host copies keep their objects"
    assert pool.num_offloads == 2 and pool.num_block_objects <= pool.num_blocks + pool.num_host_blocks
    pool.release(fresh)
    pool.incref_all([a, b])  # a claim pins them on the host
    assert pool.onboard(a) and pool.onboard(b)
    assert a.block_id is not None and a.host_id is None and pool.num_onboards == 2
    pool.release([a, b])
    pool.check_integrity()


def test_a_full_host_tier_drops_its_oldest_block_and_reuses_its_object():
    pool = BlockPool(2, 1)
    a = commit(pool, 0, 1)[0]
    pool.release([a])
    b = commit(pool, 10, 1)[0]  # the free slot
    pool.release([b])
    taken = pool.allocate_many(2)  # a goes to the host (the tier's one slot), then b pushes it out
    assert not a.in_tree and b.in_tree and b.block_id is None
    assert pool.num_block_objects <= 3
    pool.release(taken)
    pool.check_integrity()


def test_random_churn_keeps_the_pool_whole_and_the_objects_bounded():
    rng = random.Random(7)
    pool = BlockPool(12, 6)
    held: list[list[KVBlock]] = []
    for step in range(600):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 4)
            if pool.available >= n:
                chain = pool.allocate_many(n)
                pool.tree.commit_chain(chain, 0, keys(content(rng.randrange(8) * 10, n)))
                held.append(chain)
        elif op < 0.8 and held:
            pool.release(held.pop(rng.randrange(len(held))))
        elif held:  # pin something cached or on the host, as a claim would, and onboard it
            candidates = [b for b in pool.lru_blocks() + pool.host.lru_blocks() if b.parent is pool.tree.root]
            if candidates:
                block = rng.choice(candidates)
                pool.incref_all([block])
                if block.block_id is None and not pool.onboard(block):
                    pool.release([block])
                    continue
                held.append([block])
        pool.check_integrity([b for chain in held for b in chain])
        assert pool.num_block_objects <= pool.num_blocks + pool.num_host_blocks, f"step {step}"


# ---- through the executor ----------------------------------------------------------------
@pytest.mark.parametrize("host_blocks", [0, 16])
def test_steady_decode_builds_no_block_objects(host_blocks):
    """A real executor (simulated engine) decodes long enough to use every slot and evict; from
    then on its pool builds no block object, and never more than one per slot."""
    executor = make_sim_executor(num_blocks=48, host_blocks=host_blocks, max_num_tokens=64, max_batch_size=8)
    pool = executor.kv_cache_manager.pool
    rng = random.Random(3)

    def submit(count: int) -> None:
        for _ in range(count):
            shared = [7] * 8 if rng.random() < 0.5 else []  # some prompts share a prefix: reuse and eviction
            executor.enqueue_request(make_request(shared + [rng.randrange(1, 900) for _ in range(12)],
                                                  max_new_tokens=rng.randint(8, 40)))

    submit(6)
    for _ in range(150):  # warm up: the pool's first pass over its slots
        if len(executor.active_requests) < 6:
            submit(2)
        executor.step()
    assert pool.num_evictions > 0 and pool.num_free < pool.num_blocks
    built = pool.num_block_objects
    for _ in range(300):
        if len(executor.active_requests) < 6:
            submit(2)
        executor.step()
        assert pool.num_block_objects <= pool.num_blocks + pool.num_host_blocks
    assert pool.num_block_objects == built, "steady decode built block objects"
    executor.run_until_idle()
    executor.kv_cache_manager.check_integrity()
