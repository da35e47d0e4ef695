"""The built-in default scenario: reproducible, multi-turn prefix reuse, block-aligned repeats."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from benchmarks.replay.scenario import ScenarioConfig, ScenarioRequest, default_scenario
from benchmarks.replay.traces import Trace


@lru_cache(maxsize=None)
def _scenario(**overrides) -> Trace:
    return default_scenario(ScenarioConfig(**overrides))


@lru_cache(maxsize=None)
def _tokens(seed: int = 0) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r.prompt_token_ids()) for r in _scenario(seed=seed).requests)


def test_shape_and_defaults():
    trace = _scenario()
    config = ScenarioConfig()
    assert trace.format == "scenario"
    assert len(trace.requests) == config.num_requests == 400
    assert [r.request_index for r in trace.requests] == list(range(400))
    assert all(isinstance(r, ScenarioRequest) for r in trace.requests)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


def test_deterministic_in_seed():
    assert default_scenario() == _scenario()
    assert default_scenario().requests[5].prompt_token_ids().tolist() == list(_tokens()[5])
    other = _scenario(seed=1)
    assert other != _scenario()
    assert _tokens(1)[0] != _tokens(0)[0]


def test_lengths_and_tokens_within_bounds():
    config = ScenarioConfig()
    trace = _scenario()
    for request, tokens in zip(trace.requests, _tokens()):
        assert len(tokens) == request.input_len
        assert config.system_prompt_len_min < request.input_len <= config.max_prompt_len
        assert config.output_len_min <= request.output_len <= config.output_len_max
        assert min(tokens) >= 1 and max(tokens) < config.vocab_size
    lengths = sorted(r.input_len for r in trace.requests)
    assert 2000 <= lengths[len(lengths) // 2] <= 5000  # "a few thousand tokens"
    outputs = sorted(r.output_len for r in trace.requests)
    assert outputs[len(outputs) // 2] < sum(outputs) / len(outputs)  # skewed towards short


def test_next_turn_extends_previous_prompt():
    trace = _scenario()
    tokens = _tokens()
    last_turn: dict[int, int] = {}  # conversation -> index of its latest request
    checked = 0
    for request in trace.requests:
        previous = last_turn.get(request.conversation_id)
        if previous is not None and request.regenerate_of is None:
            before = trace.requests[previous]
            assert request.turn == before.turn + 1
            prompt, prev_prompt = tokens[request.request_index], tokens[previous]
            # previous prompt + its synthetic answer of output_len tokens + a new user message
            assert prompt[: len(prev_prompt)] == prev_prompt
            assert len(prompt) > len(prev_prompt) + before.output_len
            checked += 1
        last_turn[request.conversation_id] = request.request_index
    assert checked > 100


def test_system_prompts_shared_across_conversations():
    config = ScenarioConfig()
    trace = _scenario()
    tokens = _tokens()
    firsts = [tokens[r.request_index] for r in trace.requests if r.turn == 1 and r.regenerate_of is None]
    prefixes = {t[: config.system_prompt_len_min] for t in firsts}
    assert 1 < len(prefixes) <= config.num_system_prompts
    assert len(firsts) > 2 * config.num_system_prompts  # so some conversations share one


def test_block_aligned_exact_resubmissions():
    config = ScenarioConfig()
    trace = _scenario()
    tokens = _tokens()
    repeats = [r for r in trace.requests if r.regenerate_of is not None]
    assert 0.04 * len(trace.requests) <= len(repeats) <= 0.12 * len(trace.requests)
    for request in repeats:
        original = trace.requests[request.regenerate_of]
        assert original.arrival_s <= request.arrival_s and original.request_index < request.request_index
        assert tokens[request.request_index] == tokens[original.request_index]
        assert request.input_len % config.tokens_per_block == 0
    # an identical prompt never appears by accident
    first_seen: dict[tuple[int, ...], int] = {}
    for request in trace.requests:
        key = tokens[request.request_index]
        if key in first_seen:
            assert request.regenerate_of == first_seen[key]
        else:
            assert request.regenerate_of is None
            first_seen[key] = request.request_index


def test_reuse_is_interleaved_with_unrelated_requests():
    trace = _scenario()
    gaps = []
    for request in trace.requests:
        if request.turn > 1 and request.regenerate_of is None:
            previous = max(r.request_index for r in trace.requests[: request.request_index]
                           if r.conversation_id == request.conversation_id)
            gaps.append(request.request_index - previous - 1)
    gaps.sort()
    assert gaps[len(gaps) // 2] >= 20  # tens of other requests arrive between reuses


@pytest.mark.parametrize("qps", [7.0, 2.0, 20.0])
def test_mean_arrival_rate_matches_qps(qps):
    trace = _scenario(qps=qps)
    span = trace.requests[-1].arrival_s
    assert (len(trace.requests) - 1) / span == pytest.approx(qps, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace.requests, trace.requests[1:])]
    assert max(gaps) > 3 / qps and min(gaps) < 0.1 / qps  # bursts and lulls, not a fixed pace


def test_other_block_sizes_and_vocab():
    trace = _scenario(tokens_per_block=64, vocab_size=64, num_requests=150)
    repeats = [r for r in trace.requests if r.regenerate_of is not None]
    assert repeats and all(r.input_len % 64 == 0 for r in repeats)
    assert max(max(r.prompt_token_ids()) for r in trace.requests[:20]) < 64


def test_notes_state_parameters_in_one_line():
    trace = _scenario()
    params = trace.notes[0]
    assert params.startswith("default scenario: ") and "\n" not in params
    for field in dataclasses.fields(ScenarioConfig):
        assert f"{field.name}=" in params
    assert trace.notes[1].startswith("scenario realised: ")


def test_config_validated():
    with pytest.raises(ValueError):
        ScenarioConfig(qps=0.0)
    with pytest.raises(ValueError):
        ScenarioConfig(vocab_size=10)
    with pytest.raises(ValueError):
        ScenarioConfig(max_prompt_len=1000)
