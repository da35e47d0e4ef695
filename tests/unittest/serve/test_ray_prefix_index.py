"""The Ray Serve router's prefix index and routing rule, without Ray: the index rebuilt from KV
events answers what each replica's own blocks answer, and the rule keeps load within its bound."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.kv_cache.events import ROOT_HASH, chain_hash
from tensorrt_llm.llmapi import LLM, KvCacheConfig, SamplingParams
from tensorrt_llm.serve.ray_serve.prefix_index import EventError, PrefixIndex, request_keys
from tensorrt_llm.serve.ray_serve.routing import LoadBound, prefix_aware_choice, round_robin_choice

TPB = 4  # tokens per block


class FakePool:
    """One replica's reusable blocks as an engine's prefix tree holds them (parent before child;
    a block leaves with its subtree), emitting upstream's event dicts with the engine's chained
    block hashes."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # engine hash -> (parent hash, tokens)
        self.events: list[dict] = []

    def store(self, prompt: list[int]) -> None:
        """Commit the prompt's full blocks (those already held are found, not stored again)."""
        parent, new, first_parent = None, [], None
        for i in range(len(prompt) // TPB):
            tokens = tuple(prompt[i * TPB:(i + 1) * TPB])
            found = next((h for h, (p, t) in self.blocks.items() if p == parent and t == tokens), None)
            if found is None:
                if not new:
                    first_parent = parent
                found = chain_hash(ROOT_HASH if parent is None else parent, array("I", tokens).tobytes())
                self.blocks[found] = (parent, tokens)
                ids = list(tokens) if found % 2 else [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                                      for t in tokens]  # both token forms an event may carry
                new.append({"type": "stored_block", "block_hash": found, "tokens": ids})
            parent = found
        if new:
            self._emit({"type": "stored", "parent_hash": first_parent, "blocks": new})

    def evict(self, victim: int) -> None:
        """Drop ``victim`` and its subtree, children first."""
        doomed = [victim]
        for h in doomed:
            doomed += [c for c, (p, _) in self.blocks.items() if p == h]
        for h in doomed:
            del self.blocks[h]
        self._emit({"type": "removed", "block_hashes": list(reversed(doomed))})

    def clear(self) -> None:
        """A reset of the prefix cache: one removal of every block (as ``LLM`` reports it)."""
        self._emit({"type": "removed", "block_hashes": sorted(self.blocks)})
        self.blocks.clear()

    def cached_prefix(self, prompt: list[int]) -> int:
        """Leading full blocks of ``prompt`` this pool holds (what the engine would reuse)."""
        parent, depth = None, 0
        for i in range(len(prompt) // TPB):
            tokens = tuple(prompt[i * TPB:(i + 1) * TPB])
            found = next((h for h, (p, t) in self.blocks.items() if p == parent and t == tokens), None)
            if found is None:
                break
            parent, depth = found, depth + 1
        return depth

    def _emit(self, data: dict) -> None:
        self.events.append({"event_id": len(self.events), "data": data})


def test_a_stored_chain_matches_block_by_block_and_a_removal_cuts_it():
    index, pool = PrefixIndex(), FakePool()
    prompt = list(range(1, 14))  # three full blocks and one token
    pool.store(prompt)
    index.apply("r1", pool.events)
    keys = request_keys(prompt, TPB)
    assert len(keys) == 3
    assert index.match(keys) == {"r1": 3}
    assert index.match(request_keys(prompt[:8] + [99, 98, 97, 96], TPB)) == {"r1": 2}
    assert index.match(keys, ["r1", "r2"]) == {"r1": 3, "r2": 0}
    second = [h for h, (p, _) in pool.blocks.items() if p is not None and pool.blocks[p][0] is None][0]
    pool.evict(second)
    index.apply("r1", pool.events[1:])
    assert index.match(keys) == {"r1": 1}
    index.check_integrity()


def test_equal_blocks_under_different_parents_are_different_nodes():
    index, pool = PrefixIndex(), FakePool()
    pool.store([1, 2, 3, 4, 5, 6, 7, 8])
    index.apply("r1", pool.events)
    assert index.match(request_keys([9, 9, 9, 9, 5, 6, 7, 8], TPB)) == {"r1": 0}


def test_a_new_pool_holds_nothing():
    index, pool = PrefixIndex(), FakePool()
    pool.store(list(range(1, 9)))
    index.apply("r", pool.events + [{"event_id": 9, "data": {"type": "created", "num_blocks_per_cache_level": [8, 0]}}])
    assert index.match(request_keys(list(range(1, 9)), TPB)) == {"r": 0}


def test_a_reset_and_forget_drop_everything_a_replica_held():
    index, a, b = PrefixIndex(), FakePool(), FakePool()
    for pool in (a, b):
        pool.store(list(range(1, 9)))
    index.apply("a", a.events)
    index.apply("b", b.events)
    keys = request_keys(list(range(1, 9)), TPB)
    assert index.match(keys) == {"a": 2, "b": 2}
    a.clear()
    index.apply("a", a.events[-1:])
    assert index.match(keys) == {"a": 0, "b": 2}
    index.forget("b")
    assert index.match(keys) == {"a": 0}
    assert index.num_blocks("b") == 0
    index.check_integrity()


def test_the_keys_a_router_computes_are_the_hashes_the_engine_emits():
    """A real executor (the simulated engine: the pool and its events are real) serves a prompt;
    the index fed its events matches the prompt's full blocks, computed from the ids alone."""
    with LLM("tiny-random", simulated_engine={"step_s": 0.0, "context_token_s": 0.0},
             kv_cache_config=KvCacheConfig(tokens_per_block=TPB, num_blocks=64, event_buffer_max_size=256)) as llm:
        prompt = list(range(1, 20))  # four full blocks and three tokens
        llm.generate(prompt, SamplingParams(max_tokens=2))
        index = PrefixIndex()
        index.apply("r", llm.get_kv_cache_events(timeout=1))
        assert index.match(request_keys(prompt, TPB)) == {"r": 4}
        assert index.match(request_keys(prompt[:8] + [7, 7, 7, 7], TPB)) == {"r": 2}


def test_a_malformed_event_is_refused_by_name():
    with pytest.raises(EventError, match="unknown event type 'moved'"):
        PrefixIndex().apply("r", [{"event_id": 0, "data": {"type": "moved"}}])
    with pytest.raises(EventError, match="replica r: cannot apply event"):
        PrefixIndex().apply("r", [{"event_id": 0, "data": {"type": "removed"}}])


_ops = st.lists(st.tuples(st.sampled_from(["store", "evict", "clear"]), st.integers(0, 2),
                          st.lists(st.integers(1, 3), min_size=0, max_size=14)), max_size=40)


@given(_ops, st.lists(st.lists(st.integers(1, 3), max_size=14), min_size=1, max_size=5))
def test_the_index_rebuilt_from_events_matches_each_replicas_own_blocks(ops, probes):
    """Random stores, evictions and resets on three replicas, events applied in order (in several
    batches): every probe's match is what each replica's pool would reuse, and the tree has no
    dead branches. Tokens come from a 3-letter alphabet so prefixes are shared often."""
    pools = [FakePool() for _ in range(3)]
    index, applied = PrefixIndex(), [0, 0, 0]
    for step, (op, which, tokens) in enumerate(ops):
        pool = pools[which]
        if op == "store":
            pool.store(tokens)
        elif op == "evict" and pool.blocks:
            pool.evict(sorted(pool.blocks)[len(tokens) % len(pool.blocks)])
        elif op == "clear":
            pool.clear()
        if step % 3 == 0:  # apply in batches, as the replicas push them
            for r, p in enumerate(pools):
                index.apply(f"r{r}", p.events[applied[r]:])
                applied[r] = len(p.events)
    for r, p in enumerate(pools):
        index.apply(f"r{r}", p.events[applied[r]:])
    index.check_integrity()
    for probe in probes:
        expected = {f"r{r}": p.cached_prefix(probe) for r, p in enumerate(pools)}
        assert index.match(request_keys(probe, TPB), expected) == expected, probe


# ---- the routing rule -------------------------------------------------------------------------


def test_the_longest_cached_prefix_wins_within_the_load_bound():
    bound, rng = LoadBound(max_load_gap=2), random.Random(0)
    decision = prefix_aware_choice(["a", "b", "c"], {"a": 1, "b": 5}, {"a": 0, "b": 2, "c": 0}, bound, rng)
    assert decision.reason == "prefix" and decision.ranked[0] == ["b"] and decision.matched_blocks == 5
    assert sorted(decision.ranked[1]) == ["a", "c"]  # the fallback: power of two over the rest
    # b is 3 over the least loaded: skipped, and a's shorter prefix wins
    decision = prefix_aware_choice(["a", "b", "c"], {"a": 1, "b": 5}, {"a": 0, "b": 3, "c": 0}, bound, rng)
    assert decision.ranked[0] == ["a"]


def test_no_cached_prefix_is_power_of_two_over_the_eligible():
    rng = random.Random(0)
    decision = prefix_aware_choice(["a", "b", "c", "d"], {}, {"d": 9}, LoadBound(max_load_gap=4), rng)
    assert decision.reason == "balance" and len(decision.ranked) == 1
    assert len(decision.ranked[0]) == 2 and "d" not in decision.ranked[0]


def test_max_in_flight_caps_a_replica_and_a_full_cluster_still_gets_a_choice():
    rng = random.Random(0)
    bound = LoadBound(max_load_gap=100, max_in_flight=4)
    decision = prefix_aware_choice(["a", "b"], {"a": 9}, {"a": 4, "b": 1}, bound, rng)
    assert decision.ranked[0] == ["b"]
    decision = prefix_aware_choice(["a", "b"], {"a": 9}, {"a": 5, "b": 4}, bound, rng)
    assert decision.ranked[0] == ["b"]  # both at the cap: the least loaded


@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.lists(st.integers(0, 8), min_size=6, max_size=6),
       st.integers(0, 6), st.integers(0, 2**32 - 1))
def test_the_first_choice_is_never_beyond_the_bound(loads, matches, gap, seed):
    names = [f"r{i}" for i in range(len(loads))]
    load, matched = dict(zip(names, loads)), dict(zip(names, matches))
    decision = prefix_aware_choice(names, matched, load, LoadBound(max_load_gap=gap), random.Random(seed))
    for replica in decision.ranked[0]:
        assert load[replica] - min(loads) <= gap
        if decision.reason == "prefix":
            eligible = [n for n in names if load[n] - min(loads) <= gap]
            assert matched[replica] == max(matched[n] for n in eligible)


def test_round_robin_takes_turns_in_id_order():
    firsts = [round_robin_choice(["b", "a", "c"], turn).ranked[0] for turn in range(4)]
    assert firsts == [["a"], ["b"], ["c"], ["a"]]


def test_the_load_bound_refuses_bad_values_by_name():
    with pytest.raises(ValueError, match="max_load_gap"):
        LoadBound(max_load_gap=-1)
    with pytest.raises(ValueError, match="max_in_flight"):
        LoadBound(max_in_flight=0)
