"""The device sampling pass inside the executor: tiny-random in float64 on the CPU engine.

- A seeded request draws the same tokens (and log-probabilities) alone, beside other requests,
  and with the overlap scheduler on or off.
- Sampled, penalized and logprobs requests stay under the overlap scheduler: they get an
  in-flight placeholder, their next forward is built before their token reaches the host.
- Greedy requests batched with sampled ones keep the tokens they produce alone (the reference
  greedy decode, ``forward_full``): one pass, greedy rows unchanged.
- Greedy decoding with penalties and ``min_tokens`` equals a reference that applies the host
  sampler's float64 processors to ``forward_full``'s logits, with overlap on and off: the
  penalties count the token still in flight on the device.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.factories import greedy_reference, make_config
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.sampling.logits_processors import apply_penalties, forbid_end_before_min_tokens
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm.llmapi.llm_utils import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt_of(length: int, seed: int) -> list[int]:
    """Token ids inside tiny-random's vocabulary (512), distinct per seed."""
    return [1 + (seed * 131 + i * 37) % 500 for i in range(length)]


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-random", dtype="float64").model


def run(model, requests: list[LlmRequest], *, overlap: bool) -> ExecutorChecker:
    config = make_config(max_num_tokens=256, max_seq_len=128, tokens_per_block=8, num_blocks=96,
                         disable_overlap_scheduler=not overlap)
    checker = ExecutorChecker(create_py_executor(config, model=model))
    for request in requests:
        checker.submit(request)
    checker.drain()
    for request in requests:
        assert checker.final[request.request_id].error is None
    return checker


def together(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Submit every prompt before waiting for any (they share batches); each one's first output."""
    handles = [llm.generate_async(prompt, p) for prompt, p in zip(prompts, params)]
    return [handle.result().outputs[0] for handle in handles]


SAMPLED = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, seed=77, frequency_penalty=0.4, logprobs=2)


def test_a_seed_draws_the_same_tokens_alone_beside_others_and_under_overlap():
    with LLM("tiny-random", dtype="float64", max_num_tokens=256, disable_overlap_scheduler=True) as llm:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=77, frequency_penalty=0.4,
                                logprobs=2)
        alone = llm.generate(prompt_of(9, 1), params).outputs[0]
        mates = [prompt_of(5 + i, 10 + i) for i in range(5)]
        others = SamplingParams(max_tokens=12, temperature=0.7, seed=3, presence_penalty=0.5)
        batch = together(llm, [*mates[:2], prompt_of(9, 1), *mates[2:]], [others, others, params, others, others, others])
    with LLM("tiny-random", dtype="float64", max_num_tokens=256, disable_overlap_scheduler=False) as llm:
        overlapped = together(llm, [prompt_of(9, 1), *mates], [params, *[others] * 5])
    assert len(set(alone.token_ids)) > 3  # it draws
    for output in (batch[2], overlapped[0]):
        assert output.token_ids == alone.token_ids
        # the logits of other batch shapes differ in their last bits: the values, not the ids, are approximate
        assert [[i for i, _ in e.top] for e in output.logprobs] == [[i for i, _ in e.top] for e in alone.logprobs]
        for got, want in zip(output.logprobs, alone.logprobs):
            assert (got.logprob, *(v for _, v in got.top)) == pytest.approx((want.logprob, *(v for _, v in want.top)),
                                                                            abs=1e-12)


def test_sampled_penalized_and_logprobs_requests_stay_overlapped(tiny_model):
    config = make_config(max_num_tokens=256, max_seq_len=128, tokens_per_block=8, num_blocks=64,
                         disable_overlap_scheduler=False)
    executor = create_py_executor(config, model=tiny_model)
    requests = [LlmRequest(input_token_ids=prompt_of(6, i), max_new_tokens=8, sampling_config=c)
                for i, c in enumerate([SAMPLED, SamplingConfig(temperature=0.9), SamplingConfig(logprobs=0),
                                       SamplingConfig(repetition_penalty=1.3, min_tokens=4)])]
    assert all(executor.model_engine.can_pick(r) for r in requests)
    for request in requests:
        executor.enqueue_request(request)
    executor.step()  # the prompts: each request's first token is in flight
    assert all(r.tokens[-1] == IN_FLIGHT_TOKEN_ID for r in requests)
    executor.step()  # its next forward launched before the first token came back: two placeholders
    assert all(list(r.tokens[-2:]) == [r.tokens[-2], IN_FLIGHT_TOKEN_ID] and r.tokens[-2] >= 0 for r in requests)
    executor.run_until_idle()
    assert all(r.num_generated_tokens == 8 and min(r.tokens) >= 0 for r in requests)


def test_greedy_requests_beside_sampled_ones_keep_their_own_tokens(tiny_model):
    greedy = [LlmRequest(input_token_ids=prompt_of(7 + i, 20 + i), max_new_tokens=10) for i in range(3)]
    sampled = [LlmRequest(input_token_ids=prompt_of(8, 30 + i), max_new_tokens=10,
                          sampling_config=SamplingConfig(temperature=1.2, top_p=0.8, seed=i, logprobs=1)) for i in range(3)]
    for overlap in (False, True):
        checker = run(tiny_model, [greedy[0], sampled[0], greedy[1], sampled[1], sampled[2], greedy[2]], overlap=overlap)
        for request in greedy:
            assert checker.tokens[request.request_id] == greedy_reference(tiny_model, request.input_token_ids, 10)
        greedy = [LlmRequest(input_token_ids=r.input_token_ids, max_new_tokens=10) for r in greedy]
        sampled = [LlmRequest(input_token_ids=r.input_token_ids, max_new_tokens=10, sampling_config=r.sampling_config)
                   for r in sampled]


def penalized_reference(model, prompt: list[int], config: SamplingConfig, max_tokens: int, end_id: int) -> list[int]:
    """Greedy decoding over ``forward_full`` with the host sampler's float64 processors."""
    request = LlmRequest(input_token_ids=prompt, max_new_tokens=max_tokens, sampling_config=config, end_id=end_id)
    with torch.inference_mode():
        for _ in range(max_tokens):
            row = model.forward_full(torch.tensor(request.tokens.tolist()))[-1].double()  # (vocab,)
            apply_penalties(row, config, request)
            forbid_end_before_min_tokens(row, config, request)
            token = int(row.argmax())
            request.add_new_token(token)
            if token == end_id:
                break
    return request.output_token_ids


def test_greedy_with_penalties_and_min_tokens_matches_the_host_processors(tiny_model):
    configs = [SamplingConfig(repetition_penalty=1.8), SamplingConfig(frequency_penalty=1.5, presence_penalty=0.7),
               SamplingConfig(repetition_penalty=0.6, frequency_penalty=-0.5, min_tokens=6)]
    prompts = [prompt_of(6, 40 + i) + prompt_of(3, 40 + i) for i in range(3)]  # repeated ids: penalties bite
    expected = []
    for prompt, config in zip(prompts, configs):
        end_id = greedy_reference(tiny_model, prompt, 3)[2]  # a likely id: min_tokens has something to forbid
        expected.append((end_id, penalized_reference(tiny_model, prompt, config, 14, end_id)))
    assert any(tokens != greedy_reference(tiny_model, prompt, len(tokens))
               for prompt, (_, tokens) in zip(prompts, expected))  # the penalties change the decode
    for overlap in (False, True):
        requests = [LlmRequest(input_token_ids=p, max_new_tokens=14, sampling_config=c, end_id=e)
                    for p, c, (e, _) in zip(prompts, configs, expected)]
        checker = run(tiny_model, requests, overlap=overlap)
        assert [checker.tokens[r.request_id] for r in requests] == [tokens for _, tokens in expected]
