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

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

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
          chunked: bool = False, blocks: int = 256):
    """Run ``requests`` together through a torch executor; their final responses, by request id."""
    config = ExecutorConfig(
        max_num_tokens=max_num_tokens, max_batch_size=16, max_seq_len=128, enable_chunked_prefill=chunked,
        kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=blocks * tokens_per_block,
                                      enable_block_reuse=reuse),
    )
    executor = create_py_executor(config, model=model())
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


def test_beams_with_chunked_prefill_plain_requests_and_reuse():
    """Chunked prompts, plain greedy requests in the same batches, a prefix cached by an earlier
    request: the beams are the reference's, and the greedy requests are greedy."""
    prompt = tuple(itertools.islice(itertools.cycle((1, 4, 2, 5, 3)), 23))
    warm = LlmRequest(list(prompt[:16]), max_new_tokens=2, end_id=None)
    serve_first, executor = None, None
    requests = [beam_request(prompt, 3, 5), LlmRequest(list(prompt[:9]), max_new_tokens=5),
                beam_request(prompt[:17], 2, 4, end_id=0)]
    final, executor = serve([warm, *requests], tokens_per_block=4, max_num_tokens=8, chunked=True)
    assert_same_beams(final[requests[0].request_id], reference_beam_search(prompt, 3, 5, set()), "chunked")
    assert_same_beams(final[requests[2].request_id], reference_beam_search(prompt[:17], 2, 4, {0}), "end id 0")
    greedy = []
    sequence = prompt[:9]
    for _ in range(5):
        logprobs = next_logprobs(sequence)
        token = max(range(VOCAB), key=lambda t: logprobs[t])
        greedy.append(token)
        sequence += (token,)
    assert final[requests[1].request_id].error is None
    assert requests[1].output_token_ids == greedy


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
