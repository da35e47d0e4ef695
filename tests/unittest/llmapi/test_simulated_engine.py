"""``LLM(simulated_engine=...)``: no model runs, everything else does (scheduling, the KV
manager in bookkeeping mode, prefix reuse, the server), and each forward takes in real time what
:class:`LinearForwardTime` says its batch costs."""

from __future__ import annotations

import pytest
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs
from tensorrt_llm._torch.pyexecutor.engine.simulated import LinearForwardTime
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm.commands import serve
from tensorrt_llm.llmapi import LLM, KvCacheConfig, SamplingParams, SimulatedEngineConfig

FAST = SimulatedEngineConfig(step_s=0.0, context_token_s=0.0, context_attention_s=0.0, decode_token_s=0.0,
                             decode_kv_token_s=0.0)


def test_the_forward_time_is_the_formula_of_the_batch():
    """A chunk of 64 positions over a cached prefix of 32, and a decode at sequence length 100:
    every term of the formula, counted once."""
    config = SimulatedEngineConfig(step_s=1.0, context_token_s=10.0, context_attention_s=0.5, decode_token_s=100.0,
                                   decode_kv_token_s=0.25)
    chunk = make_request(prompt_len=96)
    decode = make_request(prompt_len=100)
    decode.state = LlmRequestState.GENERATION_IN_PROGRESS
    inputs = ForwardInputs()
    inputs.append_chunk(chunk, 32, 96, [], True)
    inputs.append_generation([decode])
    pairs = 64 * 32 + 64 * 65 // 2  # the cached prefix, then causal over the chunk
    expected = 1.0 + 10.0 * 64 + 0.5 * pairs + 100.0 * 1 + 0.25 * 100
    assert LinearForwardTime(config)(inputs) == pytest.approx(expected)


@pytest.mark.parametrize("field", ["step_s", "context_token_s", "context_attention_s", "decode_token_s",
                                   "decode_kv_token_s"])
def test_a_negative_or_infinite_cost_is_refused_by_name(field):
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match=f"simulated_engine.{field} must be"):
            SimulatedEngineConfig(**{field: bad})


def test_the_simulated_llm_generates_synthetic_tokens_and_reuses_prefixes():
    """The same prompt twice: equal tokens (the synthetic rule depends on the sequence only), and
    the second claims the first's full blocks from the prefix cache."""
    with LLM("tiny-random", simulated_engine={"step_s": 0.0, "context_token_s": 0.0},
             kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=32)) as llm:
        assert llm.tokenizer is None and llm.config.max_seq_len == 32 * 16  # what the pool holds
        prompt = list(range(1, 49))
        first = llm.generate(prompt, SamplingParams(max_tokens=6))
        second = llm.generate(prompt, SamplingParams(max_tokens=6))
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
        assert len(first.outputs[0].token_ids) == 6
        assert second.cached_tokens >= 32 and first.cached_tokens == 0


def test_a_checkpoint_keeps_its_tokenizer_and_loads_no_weights():
    with LLM("smollm2-135m-instruct", simulated_engine=FAST, max_seq_len=512,
             kv_cache_config=KvCacheConfig(num_blocks=64)) as llm:
        assert llm.tokenizer is not None and llm.model_id == "smollm2-135m-instruct"
        output = llm.generate("Name three colors.", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 3 and isinstance(output.outputs[0].text, str)


def test_what_the_simulated_engine_cannot_do_is_refused():
    with pytest.raises(ValueError, match="one rank"):
        LLM("tiny-random", simulated_engine=FAST, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unknown key 'simulated_engine.step'"):
        LLM("tiny-random", simulated_engine={"step": 1.0})


def test_trtllm_serve_takes_it_as_flags_and_yaml():
    args = serve.build_parser().parse_args(["tiny-random", "--simulated_engine.step_s", "0.002"])
    assert serve.llm_kwargs(args)["simulated_engine"] == SimulatedEngineConfig(step_s=0.002)
