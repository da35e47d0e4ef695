"""PrefixReuse: match (the estimate and the shared blocks), claim (pins, at most prompt_len - 1
tokens, partial blocks), take (all or nothing, onboarding, the partial copy), release, forget,
the commit of computed blocks, and PrefixIndex's kept walks.

``PrefixReuse`` is driven alone over a real :class:`BlockPool` whose storage records the moves
it is asked for; sequences are :class:`HeldBlocks` made by hand, as ``SequenceBlocks`` would
make them. Every test ends with the pool's leak oracle.
"""

from array import array

import pytest
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_reuse import PrefixIndex, PrefixReuse
from tensorrt_llm._torch.pyexecutor.kv_cache.sequence_blocks import HeldBlocks
from tensorrt_llm._torch.pyexecutor.kv_cache.values import NO_MATCH, PrefixMatch
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

TPB = 4


class Moves:
    """A storage that records what the pool asks of it (no tensors)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def copy_block(self, src: int, dst: int) -> None:
        self.log.append(("copy", src, dst))

    def offload(self, block_id: int, host_id: int) -> None:
        self.log.append(("offload", block_id, host_id))

    def onboard(self, host_id: int, block_id: int) -> None:
        self.log.append(("onboard", host_id, block_id))


def reuse(num_blocks=16, host_blocks=0, *, partial=True, enabled=True, started=None) -> PrefixReuse:
    """``started``: the ids of requests that hold blocks (a set the test keeps)."""
    pool = BlockPool(num_blocks, host_blocks, storage=Moves())
    return PrefixReuse(pool, TPB, enabled=enabled, partial=partial, block_hash=None,
                       started=set() if started is None else started)


def prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % 499 for i in range(n)]


def computed(reuse: PrefixReuse, tokens: list[int]) -> tuple[object, HeldBlocks]:
    """A request whose whole prompt was computed in fresh blocks and committed (still held)."""
    request = make_request(tokens)
    blocks = reuse.pool.allocate_many(-(-len(tokens) // TPB))
    held = HeldBlocks(blocks, num_committed=0, num_computed=len(tokens))
    reuse.commit_blocks([(request, held)])
    return request, held


def cached(reuse: PrefixReuse, tokens: list[int]) -> list:
    """``tokens`` computed, committed and released: its full blocks stay cached. Returns them."""
    request, held = computed(reuse, tokens)
    reuse.pool.release(held.blocks)
    reuse.forget(request)
    return held.blocks[: len(tokens) // TPB]


def pool_state(pool: BlockPool) -> tuple:
    return pool.num_free, pool.num_cached, pool.num_host_cached, [id(b) for b in pool.lru_blocks()]


# ---- match --------------------------------------------------------------------------------
def test_match_counts_every_matching_full_block_and_the_ones_started_requests_hold():
    r = reuse()
    base = prompt(12, seed=1)
    _, held = computed(r, base)  # 3 full blocks, held by a started request
    assert r.match(make_request(base)) == PrefixMatch(12, 2)  # a claim stops at 11 tokens: 2 blocks
    assert r.match(make_request(base + [7])) == PrefixMatch(12, 3)
    r.pool.release(held.blocks[2:])  # the third block is now only cached
    assert r.match(make_request(base + [7])) == PrefixMatch(12, 2)  # held blocks are a prefix of the chain
    r.pool.release(held.blocks[:2])
    assert r.match(make_request(base + [7])) == PrefixMatch(12, 0)
    r.pool.check_integrity()


@pytest.mark.parametrize("why", ["started", "prompt_logprobs", "reuse off"])
def test_match_is_empty_where_reuse_cannot_apply(why):
    started: set[int] = set()
    r = reuse(enabled=why != "reuse off", started=started)
    tokens = prompt(8, seed=2)
    cached(r, tokens)
    kwargs = {"sampling_config": SamplingConfig(prompt_logprobs=1)} if why == "prompt_logprobs" else {}
    request = make_request(tokens + [3], **kwargs)
    if why == "started":  # the manager never claims for a started request: match alone is asked
        started.add(request.request_id)
    assert r.match(request) == NO_MATCH and not r.can_shift(request)
    if why != "started":
        claim = r.claim(request)
        assert claim.reused == 0 and claim.pinned == []
    r.forget(request)
    r.pool.check_integrity()


# ---- claim and release -----------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, partial, reused", [(8, False, 4), (8, True, 7), (9, False, 8), (12, True, 8)])
def test_a_claim_stops_at_the_last_prompt_token_and_pins_what_it_reuses(prompt_len, partial, reused):
    r = reuse(partial=partial)
    base = prompt(8, seed=3)
    blocks = cached(r, base)
    tokens = (base + prompt(8, seed=4))[:prompt_len]
    request = make_request(tokens)
    assert r.match(request).reusable_tokens == 8  # the estimate: every matching full block
    before = pool_state(r.pool)
    claim = r.claim(request)
    assert claim.reused == reused and not r.can_shift(request)
    assert r.claim(request) is claim  # an outstanding claim is handed back, not taken twice
    assert all(b.ref_count == 1 for b in claim.pinned) and claim.chain == blocks[: len(claim.chain)]
    r.pool.check_integrity(claim.pinned)
    r.release(claim)
    assert pool_state(r.pool) == before and all(b.ref_count == 0 for b in blocks)
    r.release(claim)  # a second release changes nothing
    assert pool_state(r.pool) == before
    r.pool.check_integrity()


def test_forget_releases_an_outstanding_claim():
    r = reuse()
    tokens = prompt(8, seed=5)
    cached(r, tokens)
    request = make_request(tokens + [1])
    before = pool_state(r.pool)
    r.claim(request)
    r.forget(request)
    assert pool_state(r.pool) == before and not r.claims
    r.pool.check_integrity()


# ---- take --------------------------------------------------------------------------------
def test_take_onboards_the_host_blocks_and_copies_the_partial_block():
    r = reuse(num_blocks=4, host_blocks=4)
    tokens = prompt(8, seed=6)
    first, second = cached(r, tokens)
    r.pool.offload_until(r.pool.num_blocks)  # both move to the host tier
    assert first.block_id is None and second.block_id is None
    first_host = first.host_id
    request = make_request(tokens[:4] + tokens[4:7] + [0])  # the first block whole, 3 tokens of the second
    claim = r.claim(request)
    assert claim.chain == [first] and claim.partial is None  # a host block is never a partial source
    taken = r.take(claim, total=2, shared_total=2)
    blocks, beam_blocks, onboarded = taken
    assert blocks[0] is first and first.block_id is not None and onboarded == 1 and beam_blocks == []
    assert r.pool.num_onboards == 1 and r.pool.storage.log[-1] == ("onboard", first_host, first.block_id)
    assert not r.claims
    r.pool.release(blocks)
    r.pool.check_integrity()

    r2 = reuse()
    cached(r2, tokens)
    request = make_request(tokens[:7] + [0])
    claim = r2.claim(request)
    assert claim.reused == 7 and claim.partial is not None
    blocks, _, _ = r2.take(claim, total=2, shared_total=2)
    assert r2.pool.storage.log[-1] == ("copy", claim.partial.block_id, blocks[1].block_id)
    assert claim.partial.ref_count == 0  # the source goes back to the cache once copied
    r2.pool.release(blocks)
    r2.pool.check_integrity()


def test_take_is_all_or_nothing():
    r = reuse(num_blocks=4)
    tokens = prompt(8, seed=7)
    cached(r, tokens)
    request = make_request(tokens + prompt(12, seed=8))  # 5 blocks: the pool has 4
    before = pool_state(r.pool)
    claim = r.claim(request)
    assert r.take(claim, total=5, shared_total=5) is None
    assert pool_state(r.pool) == before and not r.claims  # the claim was released
    r.pool.check_integrity()


# ---- commit ------------------------------------------------------------------------------
def test_generated_blocks_are_keyed_as_a_prompt_would_be():
    """Blocks of generated tokens, committed a forward at a time, match a later prompt that
    holds the same tokens; sequences committed together key as they would one at a time."""
    r = reuse()
    sequences = []
    for seed in (9, 10):
        request, held = computed(r, prompt(6, seed))  # one full prompt block, two tokens into the next
        for token in prompt(6, seed + 100):
            request.add_new_token(token)
        held.blocks += r.pool.allocate_many(2)
        held.table = [b.block_id for b in held.blocks]
        held.num_computed = len(request.tokens) - 1  # 11: two more full blocks
        sequences.append((request, held))
    r.commit_blocks(sequences)  # both at once: one keying pass
    for request, held in sequences:
        assert held.num_committed == 2 and held.table == [b.block_id for b in held.blocks]
        later = make_request(list(request.tokens[:8]) + [5])
        assert r.index.chain(later.request_id, later.prompt_len, r.prompt_keys(later)) == held.blocks[:2]
        r.forget(later)
        r.pool.release(held.blocks)
        r.forget(request)
    r.pool.check_integrity()


# ---- a walk kept across iterations ----------------------------------------------------
def test_a_kept_walk_sees_through_a_reused_block_object():
    """PrefixIndex resumes a waiting request's walk. Its blocks may leave the tree and their
    objects come back holding other content: the resumed walk must still equal a fresh one."""

    def keys(seed: int, n: int) -> list[tuple[int, bytes]]:
        blocks = [array("I", range((seed + i) * TPB, (seed + i + 1) * TPB)).tobytes() for i in range(n)]
        return [(hash(b), b) for b in blocks]  # any hash: the tree verifies every hit against the tokens

    pool = BlockPool(4)
    index = PrefixIndex(pool.tree)
    wanted = keys(0, 2)
    x = pool.allocate_many(2)
    pool.tree.commit_chain(x, 0, wanted)
    pool.release(x)
    assert index.chain(1, 8, wanted) == x
    taken = pool.allocate_many(4)  # both of x are evicted (no host tier) and handed out again
    assert {id(b) for b in x} <= {id(b) for b in taken}
    pool.tree.commit_chain(taken, 0, keys(50, 4))  # ... and re-enter the tree as other blocks
    assert all(b.in_tree for b in x)
    assert index.chain(1, 8, wanted) == pool.tree.match(wanted) == []
    pool.release(taken)
    y = pool.allocate_many(2)
    pool.tree.commit_chain(y, 0, wanted)  # the prompt's content is computed again
    assert index.chain(1, 8, wanted) == pool.tree.match(wanted) == y
    pool.release(y)
    pool.check_integrity()
