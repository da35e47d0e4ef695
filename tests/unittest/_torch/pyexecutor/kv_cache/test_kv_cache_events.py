"""KV cache events: replayed in order into an independent index, they give exactly the pool's reusable set.

A stateful machine drives a simulated executor (every part real but the model: the real KV
manager, prefix tree, host tier, schedulers; :func:`factories.make_sim_executor`) through
arrivals sharing prefixes, identical repeats, bursts, cancellations, steps, resets of the
prefix cache, and the pauses that ``MAX_UTILIZATION`` makes in small pools, with the host tier
on or off and blocks offloaded ahead. After every rule the events emitted so far are applied
to a :class:`~tests.helpers.kv_event_index.ReplayedIndex` (which refuses what a router could not
apply: an unknown parent, a removal before the children, a gap) and compared with the pool's
tree, both tiers: nothing missed, nothing stale, every block in its tier and place.
:class:`~tests.helpers.invariants.ExecutorChecker` checks the executor's own invariants on the
way. A second machine keeps a buffer of a few events and reads it now and then: what it reads
is in order, and what it lost is counted, exactly.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from tests.helpers.executor_machines import TrafficRules, TrafficState
from tests.helpers.factories import make_config, make_kv_cache_manager, make_request, make_sim_executor, run_alone
from tests.helpers.invariants import ExecutorChecker
from tests.helpers.kv_event_index import ReplayedIndex, describe_difference, pool_index
from tests.helpers.strategies import Setting, examples, kv_settings, request_specs

from tensorrt_llm._torch.pyexecutor.kv_cache.events import (
    AllBlocksCleared,
    BlockMoved,
    BlocksRemoved,
    BlocksStored,
    CacheLevel,
    KVCacheEventBuffer,
    PoolCreated,
    block_hashes,
    chain_hash,
)
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler



def with_events(setting: Setting, policy: str, buffer: int, offload_ahead: int):
    config = setting.config(policy)
    kv = dataclasses.replace(config.kv_cache_config, event_buffer_max_size=buffer, offload_ahead_blocks=offload_ahead)
    return dataclasses.replace(config, kv_cache_config=kv)


class EventsMachine(TrafficRules):
    """Random traffic and resets against one executor whose pool emits events; the replayed
    index equals the pool's reusable set after every rule."""

    overlap = False

    def __init__(self) -> None:
        super().__init__()
        self.index = ReplayedIndex()
        self.resets = 0

    @initialize(setting=kv_settings(max_blocks=20, reuse=True), data=st.data())
    def build(self, setting: Setting, data) -> None:
        self.setting = setting
        ahead = data.draw(st.integers(0, min(setting.host_blocks, setting.num_blocks - 1)), label="offload_ahead")
        config = with_events(setting, "recheck", 1_000_000, ahead)
        self.checker = ExecutorChecker(make_sim_executor(config, overlap=self.overlap))

    @property
    def kv(self):
        return self.checker.executor.kv_cache_manager

    @rule(data=st.data(), size=st.integers(2, 5))
    def burst(self, data, size: int) -> None:
        for _ in range(size):
            self.arrive(data)

    @rule(steps=st.integers(1, 8))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.checker.step()

    @rule()
    def reset(self) -> None:
        held = any(node.ref_count for node in self.kv.pool.tree.root.iter_children())
        done = self.checker.executor.reset_prefix_cache()
        assert done == (not held), f"reset {'refused' if held else 'done'} with the index {'held' if held else 'free'}"
        if done:
            assert not pool_index(self.kv.pool) and self.kv.pool.num_cached == self.kv.pool.num_host_cached == 0
            self.resets += 1

    @invariant()
    def replayed_index_is_the_pools(self) -> None:
        if self.checker is None:
            return
        self.index.apply(self.kv.events.take())
        actual = pool_index(self.kv.pool)
        assert self.index.blocks == actual, describe_difference(self.index.blocks, actual)

    def teardown(self) -> None:
        if self.checker is None:
            return
        self.checker.drain()
        self.replayed_index_is_the_pools()
        counts = self.kv.events.counts()
        assert counts.dropped == 0 and counts.emitted == self.index.next_id
        assert self.index.created == (self.setting.num_blocks, self.setting.host_blocks)
        pool = self.kv.pool
        for happened, what in ((pool.num_offloads, "offloaded"), (pool.num_onboards, "onboarded"),
                               (pool.num_evictions, "evicted"), (self.resets, "reset"),
                               (any(r.counters.pauses for r in self.checker.submitted.values()), "paused")):
            if happened:
                event(f"events: {what}")


class OverlapEventsMachine(EventsMachine):
    overlap = True


class DroppedEventsMachine(TrafficState):
    """A buffer of a few events, read now and then: what is read comes in order, what is
    lost is counted, and reading never changes what the pool does."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    @initialize(setting=kv_settings(max_blocks=16, reuse=True), size=st.integers(1, 6))
    def build(self, setting: Setting, size: int) -> None:
        self.setting = setting
        self.checker = ExecutorChecker(make_sim_executor(with_events(setting, "recheck", size, 0)))

    @rule(data=st.data())
    def arrive(self, data) -> None:
        self._submit(data.draw(request_specs(self.setting, tuple(self.earlier)), label="request"), data)

    @rule(steps=st.integers(1, 6))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.checker.step()

    @rule(most=st.integers(1, 4))
    def take(self, most: int) -> None:
        events = self.checker.executor.kv_cache_manager.events
        self.read += [record.event_id for record in events.take(0, max_events=most)]

    @invariant()
    def losses_are_counted(self) -> None:
        if self.checker is None:
            return
        events = self.checker.executor.kv_cache_manager.events
        counts = events.counts()
        assert self.read == sorted(set(self.read)), "events read out of order"
        assert len(events) <= events.max_size
        assert counts.emitted == len(self.read) + len(events) + counts.dropped
        waiting = [r.event_id for r in events.take(0)]  # (they are read now: counted as read)
        self.read += waiting
        # the ones lost are the oldest unread at each overflow: every id read is above every id lost before it
        assert counts.dropped == counts.emitted - len(self.read)

    def teardown(self) -> None:
        if self.checker is not None:
            self.checker.drain()
            if self.checker.executor.kv_cache_manager.events.counts().dropped:
                event("events dropped")


STATEFUL = settings(max_examples=examples(1 / 2, 80), stateful_step_count=40)
TestEvents = EventsMachine.TestCase
TestEvents.settings = STATEFUL
TestOverlapEvents = OverlapEventsMachine.TestCase
TestOverlapEvents.settings = settings(STATEFUL, max_examples=examples(1 / 4, 40))
TestDroppedEvents = DroppedEventsMachine.TestCase
TestDroppedEvents.settings = settings(STATEFUL, max_examples=examples(1 / 4, 40))


# ---- the hash -----------------------------------------------------------------------------


def test_the_identity_hash_is_the_documented_one_and_needs_no_process_state():
    """The same in a fresh interpreter (no salt, no state), pinned, and computable from tokens
    alone with nothing but hashlib (docs/scale-out.md's snippet)."""
    import hashlib
    from array import array

    def documented(tokens, tpb):
        out, parent = [], 0
        for i in range(0, len(tokens) - tpb + 1, tpb):
            digest = hashlib.blake2b(parent.to_bytes(8, "little") + array("I", tokens[i : i + tpb]).tobytes(),
                                     digest_size=8).digest()
            parent = int.from_bytes(digest, "little")
            out.append(parent)
        return out

    tokens = list(range(100, 110))
    ours = block_hashes(tokens, 4)
    assert ours == documented(tokens, 4) and len(ours) == 2  # full blocks only
    code = "from tensorrt_llm._torch.pyexecutor.kv_cache.events import block_hashes; print(block_hashes(list(range(100, 110)), 4))"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == str(ours)
    assert ours == [8211499403980216429, 11882373147257216364]  # a restart gives the same


def test_the_same_block_under_two_prefixes_has_two_identities():
    """The tree's content hash is per block; a router's node identity must not be."""
    a, b = [1, 2, 3, 4] + [9, 9, 9, 9], [5, 6, 7, 8] + [9, 9, 9, 9]
    assert block_hashes(a, 4)[1] != block_hashes(b, 4)[1]
    assert chain_hash(0, bytes(16)) != chain_hash(1, bytes(16))


# ---- what the pool tells, case by case ----------------------------------------------------


def events_of(kv) -> list:
    return [record.event for record in kv.events.take()]


def kv_with_events(**overrides):
    config = make_config(**overrides)
    kv = dataclasses.replace(config.kv_cache_config, event_buffer_max_size=1000)
    return make_kv_cache_manager(dataclasses.replace(config, kv_cache_config=kv))


def test_moves_between_tiers_are_told_with_the_block_and_its_parent():
    kv = kv_with_events(tokens_per_block=4, num_blocks=4, host_blocks=4, enable_chunked_prefill=False)
    sampler = SyntheticSampler(1000)
    first = make_request(list(range(1, 10)), max_new_tokens=1)
    assert run_alone(kv, first, sampler)
    kv.free(first)
    assert isinstance(events_of(kv)[0], PoolCreated)
    hashes = block_hashes(list(range(1, 9)), 4)
    other = make_request(list(range(50, 63)), max_new_tokens=1)  # 4 blocks: evicts both cached ones to the host
    assert run_alone(kv, other, sampler)
    moved = [e for e in events_of(kv) if isinstance(e, BlockMoved)]
    assert {(m.block.block_hash, m.source, m.destination) for m in moved} == {
        (h, CacheLevel.GPU, CacheLevel.HOST) for h in hashes}
    assert next(m for m in moved if m.block.block_hash == hashes[1]).parent_hash == hashes[0]
    kv.free(other)
    again = make_request(list(range(1, 10)), max_new_tokens=1)  # onboards them
    assert run_alone(kv, again, sampler)
    back = [(e.block.block_hash, e.destination) for e in events_of(kv) if isinstance(e, BlockMoved)
            and e.source is CacheLevel.HOST]
    assert back == [(hashes[0], CacheLevel.GPU), (hashes[1], CacheLevel.GPU)]


def test_a_dropped_subtree_is_removed_descendants_first():
    kv = kv_with_events(tokens_per_block=2, num_blocks=4, enable_chunked_prefill=False)
    sampler = SyntheticSampler(1000)
    first = make_request([1, 2, 3, 4, 5], max_new_tokens=1)
    assert run_alone(kv, first, sampler)
    kv.free(first)
    stored = [e for e in events_of(kv) if isinstance(e, BlocksStored)]
    assert [b.block_hash for e in stored for b in e.blocks] == block_hashes([1, 2, 3, 4], 2)
    big = make_request(list(range(20, 27)), max_new_tokens=1)  # 4 blocks: drops both (no host tier)
    assert run_alone(kv, big, sampler)
    removed = [h for e in events_of(kv) if isinstance(e, BlocksRemoved) for h in e.block_hashes]
    assert removed == list(reversed(block_hashes([1, 2, 3, 4], 2)))


def test_reset_is_refused_while_a_request_holds_cached_blocks():
    kv = kv_with_events(tokens_per_block=2, num_blocks=8)
    sampler = SyntheticSampler(1000)
    running = make_request([1, 2, 3, 4, 5], max_new_tokens=4)
    assert run_alone(kv, running, sampler)  # its two full prompt blocks are committed, and held
    events_of(kv)
    assert not kv.reset_prefix_cache() and events_of(kv) == [] and pool_index(kv.pool)
    kv.free(running)
    assert kv.reset_prefix_cache()
    (cleared,) = events_of(kv)
    assert isinstance(cleared, AllBlocksCleared) and set(cleared.block_hashes) == set(block_hashes([1, 2, 3, 4], 2))
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_blocks


def test_events_off_cost_nothing_and_emit_nothing():
    kv = make_kv_cache_manager(make_config(tokens_per_block=2, num_blocks=8))
    assert kv.events is None and kv.pool.events is None and kv.pool.tree.events is None
    request = make_request([1, 2, 3, 4, 5], max_new_tokens=1)
    assert run_alone(kv, request, SyntheticSampler(1000))
    assert all(node.event_hash == 0 for node in kv.pool.tree.root.iter_children())  # nothing computed for events


def test_a_full_buffer_drops_the_oldest_and_counts_them():
    buffer = KVCacheEventBuffer(2)
    for i in range(5):
        buffer.emit(PoolCreated((i, 0)))
    taken = buffer.take()
    assert [r.event_id for r in taken] == [3, 4] and buffer.counts() == (5, 3)
    assert buffer.take(0.01) == []  # nothing waits: it waited 10 ms, then answered
    with pytest.raises(ValueError, match="at least 1 event"):
        KVCacheEventBuffer(0)
