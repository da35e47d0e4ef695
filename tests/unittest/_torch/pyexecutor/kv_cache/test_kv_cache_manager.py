"""KVCacheManager: reuse estimate vs claim, partial reuse, LRU eviction, host tier,
hash collisions, all-or-nothing allocation and the leak oracle.

The tests play the scheduler and the engine by hand: a chunk is scheduled as a one-request
batch and allocated by ``prepare_resources`` (:func:`factories.prepare_alone`), "computed"
by moving the request past it and calling ``commit``. Where tensors matter, the manager is built
for the real model and block contents are written and read directly.
"""

import random
from array import array

import pytest
import torch
from tests.helpers.factories import make_batch, make_config, make_request, make_sim_executor, prepare_alone
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.kv_cache.values import KVAllocation
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk

TPB = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # some managers hold real K/V tensors


# ---- helpers ------------------------------------------------------------------------
def manager(num_blocks=16, *, partial=True, host_blocks=0, block_hash=None) -> KVCacheManager:
    """Bookkeeping-only manager (it knows no token budget: allocation alone is under test)."""
    config = KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=partial)
    return KVCacheManager(config, num_blocks=num_blocks, num_host_blocks=host_blocks, block_hash=block_hash)


FLOAT64_MODEL = LlamaConfig(dtype="float64")


def tensor_manager(num_blocks=16, *, partial=True, host_blocks=0, block_hash=None, offload_ahead=0) -> KVCacheManager:
    """A manager with real K/V tensors shaped for the float64 tiny model."""
    model = LlamaForCausalLM(FLOAT64_MODEL)
    block_shape = model.kv_cache_shape(1, TPB)[1:]
    bytes_per_block = KVCacheStorage.bytes_per_block(FLOAT64_MODEL.num_layers, block_shape, torch.float64)
    kv_config = KvCacheConfig(
        tokens_per_block=TPB,
        num_blocks=num_blocks,
        enable_partial_reuse=partial,
        host_cache_size=host_blocks * bytes_per_block,
        offload_ahead_blocks=offload_ahead,
    )
    config = ExecutorConfig(max_num_tokens=256, enable_chunked_prefill=True, kv_cache_config=kv_config)
    kv = create_kv_cache_manager(config, model=model, block_hash=block_hash)
    assert kv.pool.num_host_blocks == host_blocks
    return kv


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def allocate(kv, request, chunk=None) -> KVAllocation:
    """Schedule ``chunk`` tokens (default: the rest of the prompt) and run prepare_resources."""
    return prepare_alone(kv, request, chunk)


def compute(kv, request) -> None:
    """Play the engine: the rest of the prompt (allocated whole) now holds computed KV."""
    batch = make_batch([request])
    request.complete_context_chunk(request.prompt_len)
    kv.commit(batch)


def cache_prompt(kv, prompt):
    """Prefill ``prompt`` and free it: its full blocks stay cached. Returns the block table it had."""
    request = make_request(prompt)
    allocate(kv, request)
    assert kv.is_allocated(request)
    table = kv.block_table(request)
    compute(kv, request)
    kv.free(request)
    return table


def hold(kv, prompt):
    """Allocate ``prompt`` and keep its blocks."""
    request = make_request(prompt)
    allocate(kv, request)
    assert kv.is_allocated(request), "the test expected this allocation to succeed"
    return request


def estimate(kv, prompt) -> int:
    return kv.match(make_request(prompt)).reusable_tokens


def pools(storage):
    return (*storage.k_cache, *storage.v_cache)


def read_block(storage, block_id) -> torch.Tensor:
    return torch.stack([pool[block_id] for pool in pools(storage)])  # (2 * layers, tpb, kv_heads, head_dim)


def read_host_block(storage, host_id) -> torch.Tensor:
    return torch.stack([pool[host_id] for pool in (*storage.k_host, *storage.v_host)])


def write_random(storage, block_ids, seed) -> dict[int, torch.Tensor]:
    """Play the engine with tensors: give each block distinct content; returns it by block id."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for block_id in block_ids:
        for pool in pools(storage):
            pool[block_id].copy_(torch.randn(pool[block_id].shape, generator=gen, dtype=pool.dtype))
        written[block_id] = read_block(storage, block_id).clone()
    return written


# ---- estimate vs claim --------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len, partial, estimated, claimed",
    [
        (8, False, 8, 4),  # whole-prompt hit: the estimate counts the last block, the claim stops at 7
        (8, True, 8, 7),  # partial reuse copies 3 tokens of the last block
        (9, False, 8, 8),  # one token past the cached blocks: estimate and claim agree
        (12, True, 8, 8),  # a tail of one unmatched block: nothing partial to copy
        (6, True, 4, 5),  # partial reuse claims more than the estimate counted
    ],
)
def test_reuse_estimate_vs_claim(prompt_len, partial, estimated, claimed):
    kv = manager(partial=partial)
    base = tokens(12, seed=1)
    cache_prompt(kv, base[:8])
    request = make_request((base[:8] + tokens(8, seed=2))[:prompt_len] if prompt_len > 8 else base[:prompt_len])

    assert kv.match(request).reusable_tokens == estimated
    allocation = allocate(kv, request)

    [claim] = allocation.claims
    assert (claim.estimated_reusable_tokens, claim.reused_tokens) == (estimated, claimed)
    assert request.prepopulated_prompt_len == request.context_current_position == claimed
    [chunk] = allocation.scheduled.context_chunks
    assert (chunk.start, chunk.size, chunk.reused) == (claimed, prompt_len - claimed, claimed)  # the rest runs
    kv.check_integrity()


def test_estimate_is_zero_with_reuse_off_and_once_allocated():
    prompt = tokens(8, seed=3)
    kv = KVCacheManager(KvCacheConfig(tokens_per_block=TPB, enable_block_reuse=False), num_blocks=8)
    cache_prompt(kv, prompt)
    assert kv.pool.num_cached == 0 and estimate(kv, prompt) == 0

    kv = manager()
    cache_prompt(kv, prompt)
    request = make_request(prompt + [7])
    assert kv.match(request).reusable_tokens == 8
    allocate(kv, request)
    assert kv.match(request).reusable_tokens == 0  # an allocated request reuses nothing more


def test_non_last_chunk_window_shifts_and_stays_block_aligned():
    kv = manager()
    prompt = tokens(24, seed=4)
    cache_prompt(kv, prompt[:10] + [0, 0])  # 3 full blocks; the third shares 2 tokens with prompt
    request = make_request(prompt)
    [chunk] = allocate(kv, request, chunk=8).scheduled.context_chunks
    # 8 reused + partial reuse of 2 tokens = 10; the 8-token window shifts to [10, 18) and
    # is floored to the block boundary 16 because it is not the last chunk.
    assert request.context_current_position == chunk.start == 10
    assert chunk.end == 16


def test_partial_reuse_copies_the_matching_part_of_a_block():
    kv = tensor_manager(partial=True)
    base = tokens(8, seed=5)
    source = hold(kv, base)
    source_ids = kv.block_table(source)
    written = write_random(kv.storage, source_ids, seed=0)
    compute(kv, source)
    kv.free(source)

    # Shares block 0 and the first two tokens of block 1.
    request = make_request(base[:6] + tokens(3, seed=6))
    allocate(kv, request)

    assert request.prepopulated_prompt_len == 6
    table = kv.block_table(request)
    assert table[0] == source_ids[0]  # a full match is shared, not copied
    assert table[1] != source_ids[1]  # a partial match is copied into a private block
    copied = read_block(kv.storage, table[1])
    torch.testing.assert_close(copied[:, :2], written[source_ids[1]][:, :2], rtol=0, atol=0)
    # The source block is left cached and unchanged.
    torch.testing.assert_close(read_block(kv.storage, source_ids[1]), written[source_ids[1]], rtol=0, atol=0)
    assert kv.pool.num_cached == 1
    kv.check_integrity()


def test_no_copy_without_partial_reuse():
    kv = tensor_manager(partial=False)
    base = tokens(8, seed=5)
    cache_prompt(kv, base)
    request = make_request(base[:6] + tokens(3, seed=6))
    allocate(kv, request)
    assert request.prepopulated_prompt_len == 4
    assert torch.count_nonzero(read_block(kv.storage, kv.block_table(request)[1])) == 0


# ---- LRU eviction -------------------------------------------------------------------
def test_eviction_takes_leaves_before_their_prefix_root():
    kv = manager(num_blocks=4)
    prompt = tokens(12, seed=7)
    cache_prompt(kv, prompt)  # 3 cached blocks, 1 free
    probe = prompt + [1]
    assert estimate(kv, probe) == 12

    hold(kv, tokens(8, seed=8))  # 1 free + 1 evicted
    assert estimate(kv, probe) == 8  # the deepest block went, the prefix is intact
    hold(kv, tokens(4, seed=9))
    assert estimate(kv, probe) == 4
    hold(kv, tokens(4, seed=10))
    assert estimate(kv, probe) == 0
    assert kv.pool.num_evictions == 3
    kv.check_integrity()


def test_eviction_takes_the_least_recently_used_prefix_first():
    kv = manager(num_blocks=6)
    a, b = tokens(8, seed=11), tokens(8, seed=12)
    cache_prompt(kv, a)
    cache_prompt(kv, b)
    cache_prompt(kv, a + tokens(4, seed=13))  # reuses a's blocks: a is now more recent than b
    assert kv.pool.num_cached == 5 and kv.pool.num_free == 1

    hold(kv, tokens(12, seed=14))  # 1 free + 2 evicted
    assert estimate(kv, b + [1]) == 0
    assert estimate(kv, a + tokens(4, seed=13) + [1]) == 12
    hold(kv, tokens(4, seed=15))  # next: the leaf under a, then a's own leaf
    assert estimate(kv, a + tokens(4, seed=13) + [1]) == 8
    hold(kv, tokens(4, seed=16))
    assert estimate(kv, a + [1]) == 4


def test_lru_keeps_its_order_and_a_bounded_length_under_repeated_pins():
    """The LRU lists drop entries lazily: a block pinned and released over and over leaves
    stale entries behind, which must neither change the eviction order nor pile up."""
    pool = BlockPool(4, 2)
    chain = pool.allocate_many(3)
    content = [array("I", range(i * TPB, (i + 1) * TPB)).tobytes() for i in range(3)]  # packed tokens
    pool.tree.commit_chain(chain, 0, [(hash(t), t) for t in content])
    a, b, c = chain
    pool.release(chain)  # leaves first: c, b, a from oldest
    assert pool.lru_blocks() == [c, b, a]
    for _ in range(1000):  # a hot block, pinned by claim after claim
        pool.incref_all([b])
        pool.release([b])
    assert pool.lru_blocks() == [c, a, b] and pool.num_cached == 3
    assert pool.lru_length <= 2 * pool.num_cached + 64
    fresh = pool.allocate_many(3)  # 1 free slot, then c and a go to the host tier, oldest first
    assert pool.lru_blocks() == [b] and pool.host.lru_blocks() == [c, a]
    assert (a.block_id, c.block_id) == (None, None) and pool.num_host_cached == 2
    pool.incref_all([a])  # a claim pins a host block: it leaves the host list at once
    assert pool.host.lru_blocks() == [c] and pool.num_host_cached == 1
    pool.release([a])
    assert pool.host.lru_blocks() == [c, a]
    pool.check_integrity(fresh)


def test_referenced_blocks_are_never_evicted():
    kv = manager(num_blocks=4)
    prompt = tokens(8, seed=17)
    cache_prompt(kv, prompt)
    user = hold(kv, prompt + tokens(4, seed=18))  # claims both cached blocks, takes 1 free
    shared = kv.block_table(user)[:2]
    assert kv.available_blocks == 1
    hold(kv, tokens(4, seed=19))
    assert kv.available_blocks == 0
    request = make_request(tokens(4, seed=20))
    assert allocate(kv, request).deferred == [request]
    assert kv.block_table(user)[:2] == shared


# ---- host tier ----------------------------------------------------------------------
def test_offload_then_onboard_restores_the_kv():
    kv = tensor_manager(num_blocks=4, host_blocks=4)
    a = tokens(8, seed=21)
    first = hold(kv, a)
    a_ids = kv.block_table(first)
    a_kv = write_random(kv.storage, a_ids, seed=1)
    compute(kv, first)
    kv.free(first)

    b = tokens(16, seed=22)
    second = hold(kv, b)  # 2 free + both of a's blocks evicted to the host tier
    assert kv.pool.num_offloads == 2 and kv.pool.num_host_cached == 2
    b_ids = kv.block_table(second)
    b_kv = write_random(kv.storage, b_ids, seed=2)  # overwrites a's old primary slots
    compute(kv, second)
    kv.free(second)
    assert (kv.pool.num_free, kv.pool.num_cached) == (0, 4)
    assert estimate(kv, a + [1]) == 8  # host blocks still match

    evictions = kv.pool.num_evictions
    request = make_request(a + tokens(4, seed=23))
    allocate(kv, request)

    assert request.prepopulated_prompt_len == 8
    assert kv.pool.num_onboards == 2
    # No free slot: each onboard and the fresh block evicted one of b's cached blocks (to the host).
    assert kv.pool.num_evictions == evictions + 3
    assert (kv.pool.num_cached, kv.pool.num_host_cached) == (1, 3)
    table = kv.block_table(request)
    for block_id, original_id in zip(table[:2], a_ids):
        torch.testing.assert_close(read_block(kv.storage, block_id), a_kv[original_id], rtol=0, atol=0)
    kv.check_integrity()

    # b's offloaded blocks come back intact too.
    kv.free(request)
    again = make_request(b)
    allocate(kv, again)
    assert again.prepopulated_prompt_len == 12  # claim stops at prompt_len - 1: three blocks
    for block_id, original_id in zip(kv.block_table(again)[:3], b_ids):
        torch.testing.assert_close(read_block(kv.storage, block_id), b_kv[original_id], rtol=0, atol=0)
    kv.check_integrity()


def test_without_room_on_the_host_eviction_drops_the_block():
    kv = manager(num_blocks=4, host_blocks=1)
    a = tokens(8, seed=24)
    cache_prompt(kv, a)
    hold(kv, tokens(16, seed=25))
    # The leaf was offloaded, then its prefix root took the only host slot and dropped it.
    assert kv.pool.num_host_cached == 1
    assert estimate(kv, a + [1]) == 4
    kv.check_integrity()


def test_offload_ahead_keeps_the_reserve_free_and_the_moved_blocks_match_from_the_host():
    kv = tensor_manager(num_blocks=8, host_blocks=8, offload_ahead=3)
    a, b = tokens(8, seed=40), tokens(8, seed=41)
    contents = {}
    for prompt, seed in ((a, 5), (b, 6)):
        request = hold(kv, prompt)
        contents[tuple(prompt)] = write_random(kv.storage, kv.block_table(request), seed=seed)
        compute(kv, request)
        kv.free(request)
    assert (kv.pool.num_free, kv.pool.num_cached) == (4, 4)
    assert kv.offload_ahead() == 0, "the reserve is free already: nothing moves"

    held = hold(kv, tokens(12, seed=42))  # takes 3 of the 4 free slots
    table = kv.block_table(held)
    assert kv.pool.num_free == 1 and kv.pool.num_offloads == 0
    assert kv.offload_ahead() == 2
    assert (kv.pool.num_free, kv.pool.num_cached, kv.pool.num_host_cached) == (3, 2, 2)
    assert kv.pool.num_offloads == 2
    assert kv.block_table(held) == table, "held blocks never move"
    kv.check_integrity()

    # a was used first, so its blocks moved (least recently used); they still match, from the host,
    # and come back with their content.
    assert estimate(kv, a + [1]) == 8
    request = make_request(a + [1])
    allocate(kv, request)
    assert request.prepopulated_prompt_len == 8 and kv.pool.num_onboards == 2
    for block_id, original in zip(kv.block_table(request)[:2], contents[tuple(a)].values()):
        torch.testing.assert_close(read_block(kv.storage, block_id), original, rtol=0, atol=0)
    kv.check_integrity()


@pytest.mark.parametrize(
    "num_blocks, host_blocks, ahead, problem",
    [(8, 4, 8, "below the pool's 8 blocks"), (8, 0, 2, "needs a host tier")],
)
def test_offload_ahead_is_refused_where_it_cannot_work(num_blocks, host_blocks, ahead, problem):
    with pytest.raises(ValueError, match=problem):
        tensor_manager(num_blocks=num_blocks, host_blocks=host_blocks, offload_ahead=ahead)


# ---- hash collisions ----------------------------------------------------------------
def test_hash_collisions_never_reuse_the_wrong_kv():
    kv = tensor_manager(block_hash=lambda block: 0)
    a, b = tokens(8, seed=26), tokens(8, seed=27)
    tables, contents = {}, {}
    for name, prompt, seed in (("a", a, 3), ("b", b, 4)):
        request = hold(kv, prompt)
        tables[name] = kv.block_table(request)
        contents.update(write_random(kv.storage, tables[name], seed=seed))
        compute(kv, request)
        kv.free(request)
    assert kv.pool.num_cached == 4  # same hash, different tokens: both cached

    unrelated = tokens(8, seed=28)
    assert estimate(kv, unrelated + [1]) == 0
    request = make_request(b + [1])
    assert kv.match(request).reusable_tokens == 8
    allocate(kv, request)
    assert kv.block_table(request)[:2] == tables["b"]
    for block_id in tables["b"]:
        torch.testing.assert_close(read_block(kv.storage, block_id), contents[block_id], rtol=0, atol=0)

    stranger = make_request(unrelated + [1])
    allocate(kv, stranger)
    assert stranger.prepopulated_prompt_len == 0
    assert not set(kv.block_table(stranger)) & set(tables["a"] + tables["b"])


def test_hash_collisions_with_partial_reuse_match_by_tokens():
    kv = manager(block_hash=lambda block: 0)
    a, b = tokens(4, seed=29), tokens(4, seed=30)
    table_a = cache_prompt(kv, a + [1])
    table_b = cache_prompt(kv, b + [1])
    request = make_request(b[:3] + [499, 498])
    allocate(kv, request)
    assert request.prepopulated_prompt_len == 3
    assert kv.block_table(request)[0] not in (table_a[0], table_b[0])  # a private copy


def test_a_colliding_sibling_still_matches_after_the_first_is_evicted():
    kv = manager(num_blocks=4, block_hash=lambda block: 0)
    a, b = tokens(TPB, seed=32), tokens(TPB, seed=33)
    cache_prompt(kv, a + [1])
    cache_prompt(kv, b + [1])  # same hash as a's block, other tokens: both cached under the root
    assert estimate(kv, a + [1]) == estimate(kv, b + [1]) == TPB
    held = hold(kv, tokens(2 * TPB + 1, seed=34))  # 3 blocks: evicts the oldest cached one, a's
    assert kv.pool.num_evictions == 1
    assert estimate(kv, a + [1]) == 0 and estimate(kv, b + [1]) == TPB
    kv.check_integrity()
    kv.free(held)
    request = make_request(b + [1])
    allocate(kv, request)
    assert request.prepopulated_prompt_len == TPB  # b's KV, found by its tokens
    kv.check_integrity()


def test_concurrent_commit_of_the_same_content_keeps_one_copy():
    kv = manager()
    prompt = tokens(8, seed=31)
    first, second = make_request(prompt + [1]), make_request(prompt + [1])
    allocate(kv, first)
    allocate(kv, second)  # nothing cached yet: both compute the same blocks
    compute(kv, first)
    compute(kv, second)
    assert kv.block_table(first)[:2] == kv.block_table(second)[:2]  # the second adopted the first's
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_cached == 2
    kv.check_integrity()


# ---- all-or-nothing allocation ------------------------------------------------------
def counts(kv):
    pool = kv.pool
    return pool.num_free, pool.num_cached, pool.num_host_cached, pool.num_evictions, pool.num_onboards


@pytest.mark.parametrize("shared", [8, 6], ids=["full-blocks", "with-partial"])
def test_allocation_is_all_or_nothing(shared):
    kv = manager(num_blocks=6)
    a = tokens(8, seed=33)
    cache_prompt(kv, a)
    hold(kv, tokens(12, seed=34))  # 1 free, 2 cached
    before = counts(kv)

    # Pins what it shares with a (a partly matching block too), then needs 3 or 4 fresh blocks.
    request = make_request(a[:shared] + [0] * 12)
    allocation = allocate(kv, request)

    assert allocation.deferred == [request]
    assert allocation.scheduled.is_empty and allocation.claims == []
    assert not kv.is_allocated(request)
    assert counts(kv) == before  # nothing stays claimed
    assert all(block.ref_count == 0 for block in kv.pool.lru_blocks() + kv.pool.host.lru_blocks())
    assert (request.context_current_position, request.prepopulated_prompt_len) == (0, 0)
    kv.check_integrity()

    # Releasing the claim kept leaves before roots: the next eviction takes a's leaf only.
    hold(kv, tokens(8, seed=48))  # the free block + 1 eviction
    assert estimate(kv, a + [1]) == 4


def test_host_blocks_to_onboard_count_against_the_pool():
    kv = manager(num_blocks=4, host_blocks=4)
    a = tokens(8, seed=35)
    cache_prompt(kv, a)
    cache_prompt(kv, tokens(16, seed=36))  # a's blocks are offloaded; 4 cached primary
    hold(kv, tokens(4, seed=37))  # evicts one more: 3 primary slots available
    before = counts(kv)
    request = make_request(a + tokens(4, seed=38))  # 2 to onboard + 1 fresh = 3: fits
    allocate(kv, request)
    assert kv.is_allocated(request)

    kv.free(request)
    hold(kv, tokens(4, seed=39))
    bigger = make_request(a + tokens(8, seed=40))  # 2 onboard + 2 fresh > what is left
    before = counts(kv)
    assert allocate(kv, bigger).deferred == [bigger]
    assert counts(kv) == before
    kv.check_integrity()


def test_generation_step_without_a_block_is_deferred_and_keeps_its_blocks():
    kv = manager(num_blocks=3)
    request = make_request(tokens(8, seed=41), max_new_tokens=8)
    allocate(kv, request)
    compute(kv, request)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.add_new_token(5)  # position 8 needs a third block
    hold(kv, tokens(4, seed=42))
    held = kv.block_table(request)

    allocation = kv.prepare_resources(make_batch(generation=[request]))
    assert allocation.deferred == [request] and allocation.scheduled.is_empty
    assert kv.block_table(request) == held
    kv.check_integrity()


def test_one_failed_allocation_leaves_the_others_in_the_batch():
    kv = manager(num_blocks=4)
    small, big = make_request(tokens(8, seed=43)), make_request(tokens(12, seed=44))
    allocation = kv.prepare_resources(make_batch([small, big]))
    assert allocation.scheduled.context_requests == [small]
    assert allocation.deferred == [big]
    assert kv.sequences.num_held_blocks(small) == 2 and not kv.is_allocated(big)
    kv.check_integrity()


# ---- the verbs, one request at a time -----------------------------------------------
def test_allocate_returns_the_chunk_on_its_reused_prefix_or_none():
    """``allocate`` is the one-request verb under ``prepare_resources``: a first chunk comes back
    moved onto the prefix it claimed; a chunk whose blocks cannot be had gets None and leaves
    the pool as it was."""
    kv = manager(num_blocks=6)
    a = tokens(8, seed=61)
    cache_prompt(kv, a)
    request = make_request(a + tokens(4, seed=62))
    got = kv.allocate(ContextChunk.of(request, 12))
    assert got is not None and got.first
    assert (got.chunk.start, got.chunk.size, got.chunk.reused) == (8, 4, 8)
    assert kv.is_allocated(request) and kv.sequences.num_held_blocks(request) == 3

    before = counts(kv)
    too_big = make_request(tokens(16, seed=63))  # 4 blocks, 3 available
    assert kv.allocate(ContextChunk.of(too_big, 16)) is None
    assert counts(kv) == before and not kv.is_allocated(too_big)

    request.complete_context_chunk(12)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.add_new_token(5)  # position 12: a fourth block
    step = kv.allocate(request)
    assert step is not None and step.chunk is None and kv.sequences.num_held_blocks(request) == 4
    kv.check_integrity()


def test_step_needs_list_started_requests_oldest_first():
    kv = manager(num_blocks=16)
    first, second = hold(kv, tokens(8, seed=64)), hold(kv, tokens(4, seed=65))
    needs = kv.step_needs([second, first])
    assert [n.request for n in needs] == [first, second]
    assert [(n.blocks, n.held) for n in needs] == [(0, 2), (0, 1)]  # their prompts are allocated whole
    assert kv.blocks_needed(make_request(tokens(8, seed=66), max_new_tokens=4)) == 3
    kv.check_integrity()


# ---- the leak oracle ----------------------------------------------------------------
def test_drain_leaves_every_block_free_or_cached():
    rng = random.Random(0)
    executor = make_sim_executor(make_config(num_blocks=40, host_blocks=8, max_num_tokens=32))
    checker = ExecutorChecker(executor)
    shared = tokens(24, seed=45)
    for i in range(40):
        prompt = shared[: rng.randrange(4, 24)] + tokens(rng.randrange(1, 20), seed=100 + i)
        checker.submit(make_request(prompt, max_new_tokens=rng.randrange(1, 6)))
        if i % 3 == 0:
            checker.step()
    checker.drain()  # calls check_integrity and checks free + cached == total
    pool = executor.kv_cache_manager.pool
    assert pool.num_free + pool.num_cached == pool.num_blocks
    assert pool.num_cached > 0  # something was kept for reuse
    assert sum(s.reuse_claimed_tokens for s in executor.iteration_stats) > 0


def test_leak_oracle_catches_a_leaked_block():
    kv = manager(num_blocks=4)
    cache_prompt(kv, tokens(8, seed=46))
    kv.check_integrity()
    kv.pool.allocate_many(1)  # taken from the pool, held by no request: neither free, cached nor held
    with pytest.raises(AssertionError, match="leak"):
        kv.check_integrity()


def test_leak_oracle_catches_a_block_in_two_sets():
    kv = manager(num_blocks=4)
    cache_prompt(kv, tokens(8, seed=47))
    with pytest.raises(AssertionError, match="two sets"):  # a cached block that something says it holds
        kv.pool.check_integrity(held_blocks=kv.pool.lru_blocks()[:1])
