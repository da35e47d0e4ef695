"""Priority with several ranks: the ranks take the same priority decisions, outputs do not change.

``LLM(tensor_parallel_size=2, check_decisions=True)`` under ``waiting_queue_policy="priority"``
with preemption: low-priority requests fill the KV pool, high-priority ones arrive and preempt
them. Rank 0 broadcasts each request's priority with its arrival time, the order reads no
clock, so every rank schedules, cuts, defers and preempts alike: the per-iteration decision
digest (which records every batch, deferral and pause) agrees on every iteration, or the group
would fail. Every output equals the single-rank run without priority.
"""

import time

import pytest
from tests.helpers.scenarios import prompt

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

OPTIONS = dict(dtype="float64", max_num_tokens=24, enable_chunked_prefill=True, max_seq_len=128,
               kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=30))
LOW = [list(prompt(0, 24 + 4 * i, i, 4)) for i in range(3)]
HIGH = [list(prompt(1, 8, 10 + i, 2)) for i in range(3)]
LOW_TOKENS, HIGH_TOKENS = 20, 4


def test_tensor_parallel_ranks_agree_on_priority_decisions_and_outputs_do_not_change():
    with LLM("tiny-random", **OPTIONS) as llm:
        expected_low = [o.outputs[0].token_ids for o in llm.generate(LOW, SamplingParams(max_tokens=LOW_TOKENS))]
        expected_high = [o.outputs[0].token_ids for o in llm.generate(HIGH, SamplingParams(max_tokens=HIGH_TOKENS))]
    llm = LLM("tiny-random", tensor_parallel_size=2, check_decisions=True,
              scheduler_config={"waiting_queue_policy": "priority", "enable_preemption": True,
                                "preemption_cooldown_iterations": 2}, **OPTIONS)
    try:
        low = [llm.generate_async(p, SamplingParams(max_tokens=LOW_TOKENS), priority=0.1) for p in LOW]
        deadline = time.monotonic() + 60
        while llm.executor.load().running < 2:
            assert time.monotonic() < deadline, "the low-priority requests never started"
            time.sleep(0.01)
        high = [llm.generate_async(p, SamplingParams(max_tokens=HIGH_TOKENS), priority=0.9) for p in HIGH]
        assert [h.result().outputs[0].token_ids for h in high] == expected_high
        assert [h.result().outputs[0].token_ids for h in low] == expected_low
        assert llm.health().healthy
        preempted = sum(stats.num_preempted_requests for stats in llm.iteration_stats)
        assert preempted > 0, "no preemption happened: the test shows nothing"
    finally:
        llm.shutdown()
