"""The sampler's filters against transformers' own logits warpers (an independent implementation).

``min_p`` keeps the tokens at least ``min_p`` times as likely as the likeliest, after temperature:
the same distribution as transformers' ``MinPLogitsWarper`` over the temperature-scaled logits,
alone and after top-k (the two commute: both keep a logit threshold below the largest). Top-p then
takes the smallest prefix of what is left, renormalised, as vLLM applies them. A request sampled
with ``min_p`` never draws a token the filter removed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.sampling.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

transformers = pytest.importorskip("transformers")


def _reference(logits: torch.Tensor, temperature: float, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    scores = (logits / temperature)[None]  # (1, vocab): transformers' warpers take a batch
    if top_k:
        scores = transformers.TopKLogitsWarper(top_k)(None, scores)
    if min_p:
        scores = transformers.MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k, min_p", [(0, 0.05), (0, 0.3), (7, 0.1), (0, 1.0), (20, 0.0)])
def test_min_p_and_top_k_match_transformers(temperature, top_k, min_p):
    generator = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(257, generator=generator, dtype=torch.float64) * 3
    ours = TorchSampler._filtered_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, min_p=min_p))
    reference = _reference(logits, temperature, top_k, min_p)
    assert torch.allclose(ours, reference, atol=1e-12, rtol=0), (ours - reference).abs().max()
    if min_p:
        kept = ours > 0
        assert kept[logits.argmax()] and kept.sum() < logits.numel()  # the likeliest stays; some go


def test_top_p_after_min_p_takes_a_prefix_of_what_is_left():
    logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64))
    # min_p 0.2 leaves 0.40, 0.25, 0.15, 0.10 (0.9 in all); top_p 0.7 of that is 0.63: the first two reach it
    probs = TorchSampler._filtered_probs(logits, SamplingConfig(temperature=1.0, min_p=0.2, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.40, 0.25, 0, 0, 0, 0], dtype=torch.float64) / 0.65)


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan"), "0.1"])
def test_min_p_outside_zero_one_is_refused(min_p):
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingConfig(temperature=1.0, min_p=min_p)


def test_beam_search_refuses_min_p():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(beam_width=2, min_p=0.1)


def test_sampled_tokens_pass_the_min_p_filter(one_torch_thread):
    """tiny-random in float64, sampled at temperature 1.5: every token drawn under min_p 0.2 has
    at least 0.2 times the probability of that step's likeliest (read back from logprobs)."""
    llm = LLM(model="tiny-random", dtype="float64", max_num_tokens=128)
    try:
        params = SamplingParams(max_tokens=24, temperature=1.5, min_p=0.2, seed=7, logprobs=1)
        for output in llm.generate([[1, 5, 9, 14, 3], [2, 7, 7, 30]], params):
            completion = output.outputs[0]
            assert len(completion.token_ids) == 24
            assert [entry.token for entry in completion.logprobs] == list(completion.token_ids)
            for entry in completion.logprobs:
                best = entry.top[0][1]  # the likeliest token's log-probability
                # logprobs are the model's (before temperature): the filter's ratio is taken after it
                assert (entry.logprob - best) / 1.5 >= math.log(0.2) - 1e-9, entry
    finally:
        llm.shutdown()
