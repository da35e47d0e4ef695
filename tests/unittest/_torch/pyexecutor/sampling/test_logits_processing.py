"""Penalties, ``min_tokens``, logprobs and the grammar mask, one function at a time, on rows whose
answer is worked out by hand (the host reference of the engine's device pass); and the sampler's
rules around them (a guided request that cannot go on fails alone; anything that changes the pick
or reads the row is not plain greedy, so the engine's pass serves it)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.factories import make_batch, make_request

from tensorrt_llm._torch.pyexecutor.errors import SamplingError
from tensorrt_llm._torch.pyexecutor.sampling.guided_decoder import Grammar, GrammarCompiler, GuidedDecodingParams
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm._torch.pyexecutor.sampling.logits_processors import (
    apply_penalties,
    forbid_end_before_min_tokens,
    token_logprob,
)
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import ForwardOutput
from tensorrt_llm._torch.pyexecutor.sampling.sampler import TorchSampler

ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def request_with(prompt, output, config, **kwargs):
    request = make_request(prompt, sampling_config=config, max_new_tokens=16, **kwargs)
    for token in output:
        request.add_new_token(token)
    return request


def test_repetition_penalty_scales_every_seen_id_toward_zero_once():
    config = SamplingConfig(repetition_penalty=2.0)
    logits = torch.tensor(ROW, dtype=torch.float64)
    apply_penalties(logits, config, request_with([0, 1, 1], [4, 0], config))  # 0 seen thrice: divided once
    assert logits.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]


def test_frequency_and_presence_penalties_count_the_output_only():
    config = SamplingConfig(frequency_penalty=0.5, presence_penalty=1.5)
    logits = torch.tensor(ROW, dtype=torch.float64)
    apply_penalties(logits, config, request_with([3, 3, 3], [2, 5, 2], config))  # the prompt's 3 is not penalized
    assert logits.tolist() == [2.0, -1.0, 0.5 - 2 * 0.5 - 1.5, 3.0, -2.0, 1.0 - 0.5 - 1.5]


def test_min_tokens_forbids_the_end_ids_until_reached():
    config = SamplingConfig(min_tokens=2)
    request = request_with([1], [4], config, end_id=3, stop_token_ids=(5,))
    logits = torch.tensor(ROW, dtype=torch.float64)
    forbid_end_before_min_tokens(logits, config, request)
    assert logits[3] == logits[5] == -math.inf and logits[0] == 2.0
    request.add_new_token(0)
    logits = torch.tensor(ROW, dtype=torch.float64)
    forbid_end_before_min_tokens(logits, config, request)
    assert logits.tolist() == ROW


def test_token_logprob_is_the_float64_log_softmax_with_the_most_likely_alternatives():
    logits = torch.tensor(ROW, dtype=torch.float32)
    entry = token_logprob(logits, 2, top=2)
    normaliser = math.log(sum(math.exp(x) for x in ROW))
    assert entry.token == 2 and entry.logprob == pytest.approx(0.5 - normaliser, abs=1e-12)
    assert [i for i, _ in entry.top] == [3, 0] and entry.top[0][1] == pytest.approx(3.0 - normaliser, abs=1e-12)


def test_anything_that_changes_the_pick_or_reads_the_row_is_not_plain_greedy():
    assert not make_request([1, 2]).needs_host_logits and SamplingConfig().plain_greedy
    for config in (SamplingConfig(presence_penalty=0.1), SamplingConfig(repetition_penalty=1.1),
                   SamplingConfig(min_tokens=1), SamplingConfig(logprobs=0)):
        assert make_request([1, 2], sampling_config=config).needs_host_logits and not config.plain_greedy
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(min_tokens=-1), dict(logprobs=21), dict(logprobs=True)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


# ---- the grammar mask, with SmolLM2's vocabulary ---------------------------------------------


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, vocab_size=49152, end_ids=smollm2_tokenizer.stop_token_ids)


def test_token_bytes_are_what_the_tokenizer_encodes(smollm2_tokenizer):
    table = smollm2_tokenizer.token_bytes()
    text = 'Héllo wörld 🎉 {"a": [1, 2]}\n\t'
    assert b"".join(table[i] for i in smollm2_tokenizer.encode(text)) == text.encode("utf-8")
    assert table[smollm2_tokenizer.eos_token_id] == b"<|im_end|>"
    assert smollm2_tokenizer.eos_token_id in smollm2_tokenizer.special_token_ids()


def test_the_mask_allows_exactly_the_ids_the_grammar_can_take(compiler, smollm2_tokenizer):
    table = smollm2_tokenizer.token_bytes()
    matcher = compiler.compile(GuidedDecodingParams(regex="[0-9]")).matcher()
    allowed = set(matcher.allowed().nonzero().flatten().tolist())
    assert allowed == {i for i, raw in enumerate(table) if len(raw) == 1 and raw.isdigit()}
    matcher.accept(next(iter(allowed)))
    assert matcher.is_complete
    assert set(matcher.allowed().nonzero().flatten().tolist()) == set(smollm2_tokenizer.stop_token_ids)
    with pytest.raises(ValueError, match="does not accept"):
        compiler.compile(GuidedDecodingParams(regex="[0-9]")).matcher().accept(smollm2_tokenizer.encode("a")[0])


def test_a_grammar_compiled_again_comes_from_the_cache(compiler):
    first = compiler.compile(GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert compiler.compile(GuidedDecodingParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})) is first


def test_a_guided_request_that_cannot_go_on_fails_alone(compiler):
    sampler = TorchSampler()
    broken = Grammar(compiler, source="this is not a grammar", kind="grammar")  # past compile()'s validation
    plain = make_request([1, 2, 3], sampling_config=SamplingConfig(logprobs=1))
    guided = make_request([1, 2, 3], guided_grammar=broken)
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    output = ForwardOutput(logits={plain.request_id: logits[0], guided.request_id: logits[1]})
    tokens = sampler.sample_batch([plain, guided], output)
    assert tokens[0] == [int(torch.argmax(logits[0]))] and len(plain.py_logprobs) == 1
    assert isinstance(tokens[1], SamplingError) and str(guided.request_id) in str(tokens[1])


def test_a_guided_request_gets_its_bitmask_at_launch_and_fails_alone_without_one(compiler, smollm2_tokenizer):
    """The sampler hands the engine each guided request's mask at launch; a matcher that cannot
    give one fails its request when the device pass's token comes back, and no other."""
    sampler = TorchSampler()
    digit = make_request([1, 2, 3], guided_grammar=compiler.compile(GuidedDecodingParams(regex="[0-9]")))
    broken = make_request([1, 2, 3], guided_grammar=Grammar(compiler, source="this is not a grammar", kind="grammar"))
    plain = make_request([4, 5])
    masks = sampler.token_masks(make_batch(generation=[digit, broken, plain]))
    assert set(masks) == {digit.request_id}
    allowed = set(digit.guided_grammar.matcher().allowed().nonzero().flatten().tolist())
    words = masks[digit.request_id]
    assert {32 * w + b for w in range(len(words)) for b in range(32) if (int(words[w]) >> b) & 1} == allowed
    token = min(allowed)
    logits = torch.zeros(3, 49152)
    output = ForwardOutput(logits={r.request_id: logits[i] for i, r in enumerate((digit, broken, plain))},
                           greedy_tokens={digit.request_id: token, broken.request_id: 0, plain.request_id: 7},
                           nonfinite=set(), device_sampled=True)
    answers = sampler.sample_batch([digit, broken, plain], output)
    assert answers[0] == [token] and answers[2] == [7]
    assert isinstance(answers[1], SamplingError) and f"request {broken.request_id}: sampling failed" in str(answers[1])
    # the matcher accepted the device's token: the next mask allows the end ids alone
    words = sampler.token_masks(make_batch(generation=[digit]))[digit.request_id]
    ends = {32 * w + b for w in range(len(words)) for b in range(32) if (int(words[w]) >> b) & 1}
    assert ends == set(smollm2_tokenizer.stop_token_ids)
