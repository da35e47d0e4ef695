"""Whatever one request's sampling carries fails that request alone.

- A sampler that raises for one request of a batch (a seed the generator cannot take, forced
  past ``SamplingConfig``'s validation) fails that request; the greedy requests batched with
  it finish with the tokens they produce alone (tiny-random, float64, stepped by hand so the
  batch is known).
- ``SamplingConfig`` refuses what the sampler cannot honour (seeds outside [0, 2**64),
  non-finite temperatures), so the Python API cannot reach that failure.
- Sampling probabilities stay finite for every accepted temperature, subnormal ones included;
  below ``GREEDY_BELOW_TEMPERATURE`` sampling is greedy; seeds in [2**63, 2**64) sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.factories import greedy_reference, make_config
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import GREEDY_BELOW_TEMPERATURE, SamplingConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.sampling.sampler import TorchSampler
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_utils import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12


def prompt_of(length: int, seed: int) -> list[int]:
    """Token ids inside tiny-random's vocabulary (512), distinct per seed."""
    return [1 + (seed * 131 + i * 37) % 500 for i in range(length)]


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-random", dtype="float64").model


def unservable_seed_config() -> SamplingConfig:
    """Sampling at temperature 1 with a seed past 64 bits, as a bug past the edge's validation
    would hand it to the sampler: ``torch.Generator.manual_seed`` raises on it."""
    config = SamplingConfig(temperature=1.0, seed=7)
    object.__setattr__(config, "seed", 2**64)  # frozen: only a bypass gets it there
    return config


def test_a_sampling_failure_fails_its_request_alone(tiny_model):
    config = make_config(max_num_tokens=256, max_seq_len=128, tokens_per_block=8, num_blocks=64)
    executor = create_py_executor(config, model=tiny_model)
    checker = ExecutorChecker(executor)
    greedy = [LlmRequest(input_token_ids=prompt_of(8 + 3 * i, seed=i), max_new_tokens=MAX_TOKENS) for i in range(4)]
    bad = LlmRequest(input_token_ids=prompt_of(9, seed=9), max_new_tokens=MAX_TOKENS,
                     sampling_config=unservable_seed_config())
    for request in (greedy[0], greedy[1], bad, greedy[2], greedy[3]):
        checker.submit(request)
    checker.drain()

    first = checker.iterations[0].stats
    assert first.num_context_requests == 5 and first.error is None  # one batch, and it did not fail
    failed = checker.final[bad.request_id]
    assert failed.error is not None and failed.error.startswith("SamplingError: ")
    assert "Overflow" in failed.error and checker.tokens[bad.request_id] == []
    for request in greedy:
        response = checker.final[request.request_id]
        assert response.error is None
        assert checker.tokens[request.request_id] == greedy_reference(tiny_model, request.input_token_ids, MAX_TOKENS)
    assert executor.num_failed_batches == 0


@pytest.mark.parametrize("seed", [2**64, -1, -(2**63) - 1, True, "1", 1.0])
def test_sampling_config_refuses_seeds_outside_64_bits(seed):
    with pytest.raises(ValueError, match="seed must be an integer in \\[0, 2\\*\\*64\\)"):
        SamplingConfig(temperature=1.0, seed=seed)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1e-300, True, "1"])
def test_sampling_config_refuses_temperatures_it_cannot_sample_at(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=temperature)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-308, 1e-6, GREEDY_BELOW_TEMPERATURE, 0.5, 2.0, 1e308])
def test_probabilities_are_finite_at_every_accepted_temperature(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=generator, dtype=torch.float64) * 30 + 1e4  # (vocab,)
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9)):
        probs = TorchSampler._filtered_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9)
        if temperature < 1e-300:  # all the mass on the largest logit
            assert int(torch.argmax(probs)) == int(torch.argmax(logits)) and float(probs.max()) == 1.0


def test_tiny_temperatures_are_greedy_and_large_seeds_sample():
    assert SamplingConfig(temperature=GREEDY_BELOW_TEMPERATURE / 2).is_greedy
    assert not SamplingConfig(temperature=GREEDY_BELOW_TEMPERATURE).is_greedy
    with LLM("tiny-random", dtype="float64", max_seq_len=64, kv_cache_config=KvCacheConfig(num_blocks=32)) as llm:
        prompt = prompt_of(10, seed=3)
        greedy = llm.generate(prompt, SamplingParams(max_tokens=6)).outputs[0].token_ids
        for temperature in (5e-324, 1e-310, 1e-308):
            params = SamplingParams(max_tokens=6, temperature=temperature, seed=1)
            assert llm.generate(prompt, params).outputs[0].token_ids == greedy
        for seed in (2**63, 2**64 - 1):
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
            first = llm.generate(prompt, params).outputs[0].token_ids
            assert len(first) == 6 and llm.generate(prompt, params).outputs[0].token_ids == first
        with pytest.raises(ValueError, match="seed"):
            llm.generate_async(prompt, SamplingParams(temperature=1.0, seed=2**64))
