"""``LLM.get_kv_cache_events`` / ``get_kv_cache_events_async``: upstream's dicts, from a real model's pool.

tiny-random on the CPU, blocks of 4 tokens. A prompt's full blocks are stored once computed,
each named by the chained hash a router computes from the tokens (``events.block_hashes``);
a second prompt sharing the first's prefix stores only its own blocks, under the last shared
one; a reset removes every block.
"""

from __future__ import annotations

import asyncio

import pytest

from tensorrt_llm._torch.pyexecutor.errors import KVCacheEventsDisabled
from tensorrt_llm._torch.pyexecutor.kv_cache.events import block_hashes
from tensorrt_llm.llmapi import LLM, SamplingParams

TPB = 4
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 3]  # two full blocks and 3 tokens
SHARED = PROMPT[:8] + [7, 7, 7, 7, 8, 8]  # the same two blocks, then a third of its own


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-random", max_seq_len=64, max_num_tokens=64,
             kv_cache_config={"tokens_per_block": TPB, "num_blocks": 64, "event_buffer_max_size": 256}) as llm:
        yield llm


def stored_blocks(events: list[dict]) -> list[tuple[int | None, int, list[int]]]:
    """(parent, hash, token ids) of every stored block, in order."""
    out = []
    for event in events:
        data = event["data"]
        if data["type"] == "stored":
            parent = data["parent_hash"]
            for block in data["blocks"]:
                out.append((parent, block["block_hash"], [t["token_id"] for t in block["tokens"]]))
                assert block["cache_level"] == 0 and block["type"] == "stored_block"
                parent = block["block_hash"]
    return out


def test_events_say_what_the_pool_stored_in_order(llm):
    events = llm.get_kv_cache_events(0)
    assert events[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [64, 0]}
    assert events[0]["event_id"] == 0 and events[0]["window_size"] == 64
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    generated = llm.generate(PROMPT, params).outputs[0].token_ids
    first = llm.get_kv_cache_events(2)
    # 12 positions computed (the prompt, then the first generated token): three full blocks,
    # the third holding a generated token
    sequence = PROMPT + generated[:1]
    hashes = block_hashes(sequence, TPB)
    assert stored_blocks(first) == [(None, hashes[0], PROMPT[:4]), (hashes[0], hashes[1], PROMPT[4:8]),
                                    (hashes[1], hashes[2], sequence[8:12])]
    assert [e["event_id"] for e in first] == list(range(1, 1 + len(first)))

    llm.generate(SHARED, params)
    second = llm.get_kv_cache_events(2)
    shared = block_hashes(SHARED, TPB)
    assert shared[:2] == hashes[:2]  # the same prefix, the same identity
    assert stored_blocks(second) == [(hashes[1], shared[2], SHARED[8:12])]  # under the last shared block
    assert second[0]["event_id"] == first[-1]["event_id"] + 1
    assert llm.get_kv_cache_events(0) == []  # nothing new: nothing waits


def test_reset_removes_every_block_as_upstream_says_it(llm):
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    llm.get_kv_cache_events(1)
    assert llm.reset_prefix_cache()
    (removed,) = llm.get_kv_cache_events(2)
    assert removed["data"]["type"] == "removed"
    assert set(block_hashes(SHARED, TPB)[:3]) < set(removed["data"]["block_hashes"])
    # PROMPT's three blocks (the test above) and SHARED's own third: each once
    assert len(removed["data"]["block_hashes"]) == 4
    assert llm.executor.load().kv.num_cached == 0


def test_async_iterator_yields_events_until_none_come(llm):
    async def main():
        done = asyncio.to_thread(llm.generate, [2, 4, 6, 8, 10, 12], SamplingParams(max_tokens=1))
        seen = []

        async def read():
            async for event in llm.get_kv_cache_events_async(timeout=2):
                seen.append(event)

        await asyncio.gather(done, read())
        return seen

    seen = asyncio.run(main())
    assert stored_blocks(seen) == [(None, block_hashes([2, 4, 6, 8], TPB)[0], [2, 4, 6, 8])]


def test_events_off_is_refused_by_name(one_torch_thread):
    with LLM("tiny-random", max_seq_len=32, kv_cache_config={"tokens_per_block": TPB, "num_blocks": 16}) as llm:
        with pytest.raises(KVCacheEventsDisabled, match="event_buffer_max_size"):
            llm.get_kv_cache_events(0)
        assert llm.executor.kv_cache_event_counts() is None
