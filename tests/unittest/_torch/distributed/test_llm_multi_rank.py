"""``LLM(tensor_parallel_size=2)`` and ``LLM(..., enable_attention_dp=True)``: ranks it starts itself.

The same prompts (shared prefixes, a prompt longer than the budget, an invalid one) give the
same greedy float64 tokens as the single-rank LLM; a cancelled request ends as cancelled; a
rank process that dies ends every request in flight with an error (nothing hangs) and the
health check says so; later submissions are refused. A tied LM head (kept whole on every
rank) and the SmolLM2 checkpoint (each rank reads the GGUF file and keeps its shard) give
the single-rank tokens too; a model whose heads do not split is refused before any rank starts.
"""

import dataclasses
import os
import signal
import time

import pytest
from tests.helpers.decisive import assert_decisive
from tests.helpers.scenarios import prompt

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm.llmapi import KvCacheConfig, RequestError
from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

OPTIONS = dict(
    dtype="float64", max_num_tokens=24, enable_chunked_prefill=True, max_seq_len=128,
    kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=48),
)
PROMPTS = [list(prompt(0, 20 + 4 * i, i, 3)) for i in range(5)] + [list(prompt(1, 40, 0, 5))]


@pytest.fixture(scope="module")
def single_rank_outputs():
    with LLM("tiny-random", **OPTIONS) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=5))]


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tensor parallel", "attention DP"])
def test_llm_on_two_ranks_generates_what_one_rank_does(single_rank_outputs, attention_dp):
    llm = LLM("tiny-random", tensor_parallel_size=2, enable_attention_dp=attention_dp, **OPTIONS)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=5))
        assert [out.outputs[0].token_ids for out in outputs] == single_rank_outputs
        assert all(out.outputs[0].finish_reason == "length" for out in outputs)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([1, 2, 9999])
        streamed = list(llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=5)))
        assert streamed[-1].outputs[0].token_ids == single_rank_outputs[0]
        cancelled = llm.generate_async(PROMPTS[1], SamplingParams(max_tokens=80))
        cancelled.abort()
        assert cancelled.result(timeout=60).outputs[0].finish_reason == "cancelled"
        health = llm.health()
        assert health.alive and health.ranks == 2 and health.iterations > 0, health
        assert llm.iteration_stats and all(s.forward_tokens <= OPTIONS["max_num_tokens"] for s in llm.iteration_stats)

        # A rank process dies mid-generation: the request in flight ends with an error.
        in_flight = [llm.generate_async(p, SamplingParams(max_tokens=80)) for p in PROMPTS[:2]]
        next(iter(in_flight[0]))  # running
        os.kill(llm.executor.rank_pids[1], signal.SIGKILL)
        for handle in in_flight:
            with pytest.raises(RequestError):
                handle.result(timeout=60)
        health = llm.health()
        assert not health.alive and health.last_error, health
        with pytest.raises(ExecutorShutdown):
            llm.generate_async(PROMPTS[0])
    finally:
        llm.shutdown()


def test_a_tied_lm_head_stays_whole_on_every_rank():
    tied = dataclasses.replace(MODEL_PRESETS["tiny-random"], tie_word_embeddings=True, dtype="float64")
    options = {k: v for k, v in OPTIONS.items() if k != "dtype"}
    with LLM(tied, **options) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4))]
    with LLM(tied, tensor_parallel_size=2, **options) as llm:
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4))] == expected


def test_smollm2_on_three_ranks_reads_the_checkpoint_on_each_and_generates_what_one_rank_does():
    """9 query heads and 3 KV heads: 3 ranks each take 3 and 1; 2 ranks are refused at once."""
    prompts, params = ["The capital of France is", "1, 2, 3,"], SamplingParams(max_tokens=6)
    with LLM("smollm2-135m-instruct", max_seq_len=128) as llm:
        references = [out.outputs[0] for out in llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2))]
    for reference in references:  # three ranks sum their shards in another order: float32 moves by ~1e-5
        assert_decisive(reference, "one rank against three")
    expected = [reference.token_ids for reference in references]
    with pytest.raises(ValueError, match=r"cannot run on 2 ranks: num_heads \(9\)"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2, max_seq_len=128)
    with LLM("smollm2-135m-instruct", tensor_parallel_size=3, max_seq_len=128) as llm:
        outputs = llm.generate(prompts, params)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert outputs[0].text.strip().startswith("Paris")  # the tokenizer came from the file's metadata


def test_health_says_when_no_rank_reports_progress_with_requests_in_flight():
    slow = FaultInjectionConfig(slow_forward_every=1, slow_forward_s=1.0)
    with LLM("tiny-random", tensor_parallel_size=2, max_seq_len=128, health_check_timeout_s=0.5,
             fault_injection=slow) as llm:
        time.sleep(0.6)  # idle ranks report nothing: that is no stall
        assert llm.health().healthy, llm.health()
        handle = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 20
        while (health := llm.health()).healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "no rank has reported progress" in health.reason, health
        assert handle.result(timeout=60).outputs[0].finish_reason == "length"
        assert llm.health().healthy  # nothing in flight
