"""KV cache events with several ranks: what rank 0 reports under TP, every rank under attention DP.

Under tensor parallelism every rank takes the same decisions, so rank 0's pool speaks for all:
the events of ``LLM(tensor_parallel_size=2)`` are exactly those of one rank, for the same
requests. Under attention DP each rank has its own pool: every rank's events come, each with
its ``attention_dp_rank``, numbered from its own ``created``, and replayed per rank they make a
consistent index (every stored parent known, every removal of a block held).
"""

from collections import defaultdict

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.kv_cache.events import block_hashes

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

TPB = 4
OPTIONS = dict(max_num_tokens=64, max_seq_len=64,
               kv_cache_config={"tokens_per_block": TPB, "num_blocks": 12, "event_buffer_max_size": 1000})
PROMPTS = [list(range(1, 14)), list(range(1, 9)) + [70, 71, 72, 73, 74], list(range(100, 141)), list(range(1, 14))]


def run(llm: LLM) -> list[dict]:
    events = []
    for prompt in PROMPTS:  # one at a time: the same schedule whatever the ranks
        llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        events += llm.get_kv_cache_events(2)
    return events


def test_tensor_parallel_events_are_the_single_ranks():
    with LLM("tiny-random", **OPTIONS) as llm:
        expected = run(llm)
    with LLM("tiny-random", tensor_parallel_size=2, **OPTIONS) as llm:
        got = run(llm)
    assert got == expected
    kinds = {e["data"]["type"] for e in got}
    assert {"created", "stored", "removed"} <= kinds and all("attention_dp_rank" not in e for e in got)


def test_attention_dp_events_come_from_every_rank_each_consistent():
    with LLM("tiny-random", tensor_parallel_size=2, enable_attention_dp=True, **OPTIONS) as llm:
        handles = [llm.generate_async(p, SamplingParams(max_tokens=2, ignore_eos=True)) for p in PROMPTS * 2]
        for handle in handles:
            handle.result()
        events, more = [], llm.get_kv_cache_events(2)
        while more:
            events += more
            more = llm.get_kv_cache_events(0.5)
    by_rank = defaultdict(list)
    for event in events:
        by_rank[event["attention_dp_rank"]].append(event)
    assert set(by_rank) == {0, 1}
    for rank, stream in by_rank.items():
        assert [e["event_id"] for e in stream] == list(range(len(stream))), f"rank {rank}: a gap"
        assert stream[0]["data"]["type"] == "created"
        held: dict[int, list[int]] = {}
        for event in stream[1:]:
            data = event["data"]
            if data["type"] == "stored":
                parent = data["parent_hash"]
                assert parent is None or parent in held, f"rank {rank}: stored under an unknown parent"
                for block in data["blocks"]:
                    tokens = [t["token_id"] for t in block["tokens"]]
                    prefix = (held[parent] if parent is not None else []) + tokens
                    assert block["block_hash"] == block_hashes(prefix, TPB)[-1], "not the chained hash of its tokens"
                    held[block["block_hash"]] = prefix
                    parent = block["block_hash"]
            elif data["type"] == "removed":
                for block_hash in data["block_hashes"]:
                    assert held.pop(block_hash, None) is not None, f"rank {rank}: removed a block it did not hold"
