"""``SamplingParams.n`` / ``best_of`` in the LLM API: one executor request per sample, the later
ones submitted once the first has computed the prompt; every sample ends, whatever happens."""

from __future__ import annotations

import time

import pytest

from tensorrt_llm.llmapi import LLM, KvCacheConfig, SamplingParams

PROMPT = [1 + (i * 37) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    with LLM("tiny-random", dtype="float64", max_seq_len=128, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=64)) as llm:
        yield llm


def test_samples_draw_with_seed_plus_index_and_greedy_samples_agree(llm):
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=40))
    alone = [llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i)).outputs[0].token_ids
             for i in range(3)]
    assert [c.token_ids for c in sampled.outputs] == alone and sampled.generated_tokens == 18
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, n=2))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_aborting_before_the_fan_out_ends_every_sample(llm):
    handle = llm.generate_async(PROMPT, SamplingParams(max_tokens=30, n=4, temperature=1.0))
    handle.abort()  # sample 0 may or may not have started; samples 1..3 were never submitted
    output = handle.result(timeout=60)
    assert output.finished and {c.finish_reason for c in output.outputs} <= {"cancelled", "length"}
    assert output.outputs[1].finish_reason == "cancelled"  # unsubmitted, or cancelled at once (a race)
    deadline = time.monotonic() + 30
    while llm.executor.has_work:  # the cancelled sample leaves the executor, its blocks freed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    kv = llm.executor.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free + kv.pool.num_cached == kv.pool.num_blocks


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=17), dict(n=2, best_of=1), dict(n=True), dict(best_of=2.0)])
def test_sample_counts_out_of_range_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
