"""Beam search through the real engine, checked against references that share none of its parts.

The engine's beam search runs every beam as a sequence of its own over the paged KV cache (one
block table per beam, prompt blocks shared, copy-on-write, forks), in batches with other
requests, and scores on the host. The references below recompute every beam's whole sequence
with ``forward_full`` (no cache, no batch) and rank candidates with their own few lines:

* a plain beam search, written from upstream's rules (``beam_search`` module docstring): it
  must return the same beams, in the same order, with the same cumulative log-probabilities;
* with ``beam_width`` equal to the vocabulary size, over two steps, an exhaustive search over
  every two-token continuation: beam search then keeps every first token and ranks every pair,
  so its beams must be the best sequences of all, scored the same way.

The model is tiny-random in float64 with a small vocabulary, so that end tokens are often among
the best candidates (the finished-hypothesis paths run) and paged and dense forwards differ by
rounding alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch
from tests.helpers.factories import make_config, make_kv_cache_manager, make_request, run_alone

from tensorrt_llm._torch.distributed.multi_rank_executor import _Validator
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import (
    CapacitySchedulerPolicy,
    ExecutorConfig,
    FaultInjectionConfig,
    KvCacheConfig,
    SpeculativeConfig,
)
from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tensorrt_llm.llmapi.llm import LLM, SamplingParams
from tensorrt_llm.mapping import Mapping

VOCAB = 8
MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64", vocab_size=VOCAB, seed=3)
TOL = 1e-9  # float64: paged and dense forwards differ by summation order only

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(MODEL)


@functools.lru_cache(maxsize=None)
def next_logprobs(sequence: tuple[int, ...]) -> tuple[float, ...]:
    """log-softmax of the logits after ``sequence``: the whole sequence recomputed, no KV cache."""
    with torch.inference_mode():
        logits = model().forward_full(torch.tensor(sequence, dtype=torch.long))[-1]  # (vocab,)
    return tuple(torch.log_softmax(logits.double(), dim=-1).tolist())


def greedy_reference(prompt: tuple[int, ...], steps: int) -> list[int]:
    """Greedy decoding, every step recomputed from scratch."""
    tokens, sequence = [], tuple(prompt)
    for _ in range(steps):
        logprobs = next_logprobs(sequence)
        tokens.append(max(range(VOCAB), key=lambda t: logprobs[t]))
        sequence += (tokens[-1],)
    return tokens


def penalized(cum: float, length: int, length_penalty: float) -> float:
    return cum if length_penalty == 0 or length == 1 else cum / length**length_penalty


def reference_beam_search(prompt, width, max_new, ends, length_penalty=0.0, early_stopping=1, returned=None):
    """Upstream's beam search, one candidate list per step, every beam recomputed from scratch.
    Returns [(tokens, cum_logprob)] best first."""
    returned = width if returned is None else returned
    live = [((), 0.0)]
    finished: list[tuple[tuple[int, ...], float]] = []
    stopped_early = False
    for _ in range(max_new):
        candidates = []
        for beam, (tokens, cum) in enumerate(live):
            for token, logprob in enumerate(next_logprobs(tuple(prompt) + tokens)):
                candidates.append((cum + logprob, beam, token))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: 2 * width]
        survivors = []
        for rank, (cum, beam, token) in enumerate(candidates):
            tokens = live[beam][0] + (token,)
            if token in ends:
                if rank >= width:
                    continue
                score = penalized(cum, len(tokens), length_penalty)
                if len(finished) == width:
                    scores = [penalized(c, len(t), length_penalty) for t, c in finished]
                    if score < min(scores):
                        if early_stopping:
                            break
                        continue
                    finished.pop(scores.index(min(scores)))
                finished.append((tokens, cum))
            else:
                survivors.append((tokens, cum))
            if len(survivors) == width:
                break
        length = len(live[0][0]) + 1
        if len(finished) == width:
            if early_stopping == 1:
                stopped_early = True
            else:
                horizon = max_new if early_stopping == 2 and length_penalty > 0 else length
                best = penalized(candidates[0][0], horizon, length_penalty)
                stopped_early = min(penalized(c, len(t), length_penalty) for t, c in finished) >= best
        live = survivors
        if stopped_early or not live:
            break
    pool = finished if stopped_early else finished + live
    ranked = sorted(pool, key=lambda h: -penalized(h[1], len(h[0]), length_penalty))
    return ranked[:returned]


def serve(requests: list[LlmRequest], *, tokens_per_block: int, max_num_tokens: int = 64, reuse: bool = True,
          chunked: bool = False, blocks: int = 256, on_model: LlamaForCausalLM | None = None, **options):
    """Run ``requests`` together through a torch executor (over ``on_model``, by default the CPU
    reference's model); their final responses by request id, and the executor."""
    config = ExecutorConfig(
        max_num_tokens=max_num_tokens, max_batch_size=16, max_seq_len=128, enable_chunked_prefill=chunked,
        kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=blocks * tokens_per_block,
                                      enable_block_reuse=reuse),
        **options,
    )
    executor = create_py_executor(config, model=on_model or model())
    final = {}
    for request in requests:
        executor.enqueue_request(request, lambda r, response: final.__setitem__(r.request_id, response)
                                 if response.finished else None)
    executor.run_until_idle()
    executor.kv_cache_manager.check_integrity()
    assert executor.kv_cache_manager.pool.stats().num_held == 0, "blocks still held after the drain"
    return final, executor


def beam_request(prompt, width, max_new, *, end_id=None, stops=(), **config) -> LlmRequest:
    return LlmRequest(list(prompt), max_new_tokens=max_new, beam_width=width, end_id=end_id,
                      stop_token_ids=tuple(stops), sampling_config=SamplingConfig(**config))


def assert_same_beams(response, expected, context: str) -> None:
    assert response.error is None, f"{context}: {response.error}"
    got = [(h.tokens, h.cum_logprob) for h in response.beams]
    assert [t for t, _ in got] == [t for t, _ in expected], f"{context}: beams {got} != reference {expected}"
    for (_, cum), (_, ref) in zip(got, expected):
        assert abs(cum - ref) < TOL, f"{context}: cumulative log-probability {cum} != reference {ref}"
    assert list(response.new_token_ids) == list(got[0][0]), "the response's tokens are the best beam's"


PROMPTS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7), (5, 1, 1), (2, 6, 3, 3, 1, 4, 4, 6, 0)]


@pytest.mark.parametrize("tokens_per_block", [1, 4, 16])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_beams_equal_a_search_that_recomputes_every_beam(tokens_per_block, width):
    """Several beam requests (prompts sharing a prefix, an end token in the vocabulary) served
    together equal the reference, beam for beam, score for score."""
    requests = [beam_request(p, width, 6, end_id=7, num_return_sequences=width) for p in PROMPTS]
    final, _ = serve(requests, tokens_per_block=tokens_per_block)
    for prompt, request in zip(PROMPTS, requests):
        expected = reference_beam_search(prompt, width, 6, {7})
        assert_same_beams(final[request.request_id], expected, f"prompt {prompt}, {width} beams")


@pytest.mark.parametrize(
    "length_penalty,early_stopping", [(0.0, 0), (1.0, 1), (1.0, 0), (2.0, 2), (-0.5, 2), (0.5, 1)]
)
def test_length_penalty_and_early_stopping_follow_upstream(length_penalty, early_stopping):
    width, stops = 3, (6, 7)
    requests = [
        beam_request(p, width, 7, stops=stops, length_penalty=length_penalty, early_stopping=early_stopping,
                     num_return_sequences=2)
        for p in PROMPTS
    ]
    final, _ = serve(requests, tokens_per_block=4)
    for prompt, request in zip(PROMPTS, requests):
        expected = reference_beam_search(prompt, width, 7, set(stops), length_penalty, early_stopping, returned=2)
        assert_same_beams(final[request.request_id], expected, f"prompt {prompt} lp={length_penalty} es={early_stopping}")


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_beams_with_chunked_prefill_plain_requests_and_reuse(overlap):
    """Chunked prompts, plain greedy requests in the same batches (picked one forward ahead under
    the overlap scheduler; a beam request never is), a prefix cached by an earlier request: the
    beams are the reference's, and the greedy requests are greedy."""
    prompt = tuple(itertools.islice(itertools.cycle((1, 4, 2, 5, 3)), 23))
    warm = LlmRequest(list(prompt[:16]), max_new_tokens=2, end_id=None)
    requests = [beam_request(prompt, 3, 5), LlmRequest(list(prompt[:9]), max_new_tokens=5),
                beam_request(prompt[:17], 2, 4, end_id=0)]
    final, executor = serve([warm, *requests], tokens_per_block=4, max_num_tokens=8, chunked=True,
                            disable_overlap_scheduler=not overlap)
    assert executor.overlap is overlap
    assert_same_beams(final[requests[0].request_id], reference_beam_search(prompt, 3, 5, set()), "chunked")
    assert_same_beams(final[requests[2].request_id], reference_beam_search(prompt[:17], 2, 4, {0}), "end id 0")
    assert final[requests[1].request_id].error is None
    assert requests[1].output_token_ids == greedy_reference(prompt[:9], 5)


def test_a_whole_vocabulary_of_beams_equals_an_exhaustive_search_over_two_steps():
    """beam_width = vocabulary size, two steps, no end token: the beams are the best two-token
    continuations of all VOCAB**2, in order, with their scores (length penalty 1: all have length 2)."""
    prompt = (3, 1, 4, 1, 5)
    request = beam_request(prompt, VOCAB, 2, length_penalty=1.0)
    final, _ = serve([request], tokens_per_block=4)
    exhaustive = []
    for first, second in itertools.product(range(VOCAB), repeat=2):
        cum = next_logprobs(prompt)[first] + next_logprobs(prompt + (first,))[second]
        exhaustive.append(((first, second), cum))
    exhaustive.sort(key=lambda h: -penalized(h[1], 2, 1.0))
    response = final[request.request_id]
    assert_same_beams(response, exhaustive[:VOCAB], "exhaustive")
    best = response.beams[0]
    assert best.score(1.0) == pytest.approx(penalized(exhaustive[0][1], 2, 1.0), abs=TOL)
    assert math.isclose(best.cum_logprob, max(c for _, c in exhaustive), abs_tol=TOL)


# ---- the beams survive what the executor does to a request ------------------------------------


def test_beams_start_over_after_a_pause_or_a_failed_forward():
    """A beam search paused for memory (MAX_UTILIZATION, a pool too small for all) or whose
    forward failed starts again from its prompt and returns the reference's beams."""
    requests = [beam_request(p, 3, 6, end_id=7) for p in PROMPTS]
    final, executor = serve(
        requests, tokens_per_block=2, blocks=24, capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
        fault_injection=FaultInjectionConfig(forward_error_every=7), max_forward_retries=20,
    )
    assert sum(r.counters.pauses + r.counters.forward_retries for r in requests) > 0, "nothing started over: the test tests nothing"
    for prompt, request in zip(PROMPTS, requests):
        assert_same_beams(final[request.request_id], reference_beam_search(prompt, 3, 6, {7}), f"prompt {prompt}")


def test_speculative_decoding_leaves_beam_requests_alone():
    """With speculation on, a beam request runs without drafts (upstream refuses drafts with beams)
    and returns the reference's beams; a greedy request beside it is speculated on."""
    beams = beam_request(PROMPTS[0], 2, 5, end_id=7)
    greedy = LlmRequest(list(PROMPTS[1]) * 2, max_new_tokens=6)
    final, _ = serve([beams, greedy], tokens_per_block=4, speculative_config=SpeculativeConfig(max_draft_len=2))
    assert beams.max_draft_len == 0 and greedy.max_draft_len == 2
    assert_same_beams(final[beams.request_id], reference_beam_search(PROMPTS[0], 2, 5, {7}), "speculation on")


@pytest.mark.parametrize(
    "request_options, config, problem",
    [
        (dict(max_draft_len=2), {}, "beam search with draft tokens"),
        ({}, dict(temperature=0.8), "temperature, top_k, top_p and min_p do not apply"),
        ({}, dict(top_p=0.5), "temperature, top_k, top_p and min_p do not apply"),
        ({}, dict(min_p=0.1), "temperature, top_k, top_p and min_p do not apply"),
        ({}, dict(logprobs=1, repetition_penalty=1.2), "does not support logprobs, penalties"),
        ({}, dict(num_return_sequences=3), "num_return_sequences 3 exceeds the beam width 2"),
    ],
)
def test_what_beam_search_cannot_honour_is_refused_by_name(request_options, config, problem):
    _, executor = serve([], tokens_per_block=4)
    request = LlmRequest([1, 2, 3], max_new_tokens=2, beam_width=2, sampling_config=SamplingConfig(**config),
                         **request_options)
    with pytest.raises(InvalidRequestError, match=problem):
        executor.validate(request)


def test_several_ranks_refuse_beam_search_by_name():
    config = make_config(max_seq_len=128)
    validator = _Validator(MODEL, config, Mapping(world_size=2, rank=0, tp_size=2))
    validator(LlmRequest([1, 2, 3], max_new_tokens=2))  # one beam: served
    with pytest.raises(InvalidRequestError, match="beam search runs with one rank only"):
        validator(LlmRequest([1, 2, 3], max_new_tokens=2, beam_width=2))


# ---- the LLM API ------------------------------------------------------------------------------


def test_llm_returns_the_n_best_beams():
    """``use_beam_search`` with ``best_of`` beams returns the ``n`` best; ``beam_width`` alone, one."""
    prompt = list(PROMPTS[3])
    with LLM(MODEL, max_seq_len=64, max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4)) as llm:
        searched = llm.generate(prompt, SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=5,
                                                       length_penalty=1.0, early_stopping=0, end_id=7))
        one = llm.generate(prompt, SamplingParams(beam_width=3, max_tokens=5, end_id=7))
    expected = reference_beam_search(prompt, 3, 5, {7}, length_penalty=1.0, early_stopping=0, returned=2)
    assert [(c.index, tuple(c.token_ids)) for c in searched.outputs] == [(i, t) for i, (t, _) in enumerate(expected)]
    for completion, (tokens, cum) in zip(searched.outputs, expected):
        assert completion.cumulative_logprob == pytest.approx(cum, abs=TOL)
        assert completion.finish_reason == ("stop" if tokens[-1] == 7 else "length")
    assert [tuple(c.token_ids) for c in one.outputs] == [reference_beam_search(prompt, 3, 5, {7}, returned=1)[0][0]]


def test_sampling_params_refuse_what_beam_search_cannot_honour():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.7)
    with pytest.raises(ValueError, match=r"n \(3\) must be at most the number of beams \(2\)"):
        SamplingParams(beam_width=2, n=3)
    assert SamplingParams(use_beam_search=True, n=3).search_width == 3
    assert SamplingParams(use_beam_search=True, n=1).is_beam_search is False  # one beam: greedy


# ---- the KV cache: shared prompt blocks, copy-on-write, forks, nothing cached from a beam -----


def test_beam_tables_share_prompt_blocks_copy_on_write_and_free_dropped_beams():
    """prompt 10 tokens, 4 per block, 3 beams: the two full prompt blocks are shared by every beam
    and held once; the prompt's partial block is copied for all but one beam; a fork that drops
    a beam frees its own block; beams that share a block copy it before writing; finished, only
    the prompt's full blocks stay cached."""
    config = make_config(tokens_per_block=4, num_blocks=32)
    kv = make_kv_cache_manager(config)
    sampler = SyntheticSampler(VOCAB_SIM)
    request = make_request(list(range(1, 11)), beam_width=3, max_new_tokens=8)
    assert run_alone(kv, request, sampler)  # the prompt, and its first token
    assert kv.sequences.num_held_blocks(request) == 3 + 2  # 3 prompt blocks + 2 set aside for the beams' copies
    assert run_alone(kv, request, sampler)  # the first beam step: each beam writes position 10
    tables = kv.sequences.beam_block_tables(request)
    assert len({tuple(t[:2]) for t in tables}) == 1, f"full prompt blocks are shared: {tables}"
    assert len({t[2] for t in tables}) == 3, f"each beam has its own copy of the partial block: {tables}"
    assert kv.sequences.num_held_blocks(request) == 2 + 3  # = the bound the capacity scheduler counts at this length
    free = kv.pool.num_free
    kv.sequences.fork_beams(request, (0, 0, 1))  # beam 2 dropped; beams 0 and 1 continue old beam 0
    tables = kv.sequences.beam_block_tables(request)
    assert tables[0] == tables[1] and kv.pool.num_free == free + 1 and kv.sequences.num_held_blocks(request) == 2 + 2
    kv.check_integrity()
    assert run_alone(kv, request, sampler)  # position 11: beams 0 and 1 share that block: one copies it
    tables = kv.sequences.beam_block_tables(request)
    assert len({t[2] for t in tables}) == 3 and kv.sequences.num_held_blocks(request) == 5
    assert run_alone(kv, request, sampler)  # position 12: a new block for every beam
    assert [len(t) for t in kv.sequences.beam_block_tables(request)] == [4, 4, 4] and kv.sequences.num_held_blocks(request) == 8
    kv.check_integrity()
    request.state = LlmRequestState.GENERATION_COMPLETE
    kv.free(request)
    kv.check_integrity()
    assert kv.pool.num_cached == 2 and kv.pool.stats().num_held == 0, "only the full prompt blocks are cached"


VOCAB_SIM = 1000


# ---- the ranking of a step's candidates -------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6, 7, 9])
def test_a_step_ranks_candidates_as_a_stable_sort_of_all_would(k):
    """``sampler._best`` (a top-k) returns what a stable descending sort of every (beam, token)
    total puts first: ties at the k-th value included and in index order, -inf padding left out."""
    from tensorrt_llm._torch.pyexecutor.sampling.sampler import _best

    totals = torch.tensor([0.0, -1.0, -1.0, -1.0, float("-inf"), -1.0, -2.0, float("-inf"), -0.5], dtype=torch.float64)
    values, order = torch.sort(totals, descending=True, stable=True)
    expected = [(v, i) for v, i in zip(values[:k].tolist(), order[:k].tolist()) if v > -math.inf]
    assert _best(totals, k) == expected
    generator = torch.Generator().manual_seed(k)
    wide = torch.randn(4 * 5000, generator=generator, dtype=torch.float64).round(decimals=1)  # many ties
    values, order = torch.sort(wide, descending=True, stable=True)
    assert _best(wide, k) == list(zip(values[:k].tolist(), order[:k].tolist()))
