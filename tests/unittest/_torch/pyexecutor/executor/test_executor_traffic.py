"""Mixed traffic end to end, and reuse transparency against the no-cache reference.

* 200 requests (shared prefixes, cancellations, invalid ones) through ``LLM`` and the real
  torch model under the default ``recheck``: every request ends with output or a clear
  error, no iteration overshoots, the pool is clean after the drain. The same traffic on
  the simulated engine under ``none`` counts the iterations upstream would have crashed on.
* Greedy float64 outputs with block reuse on (partial or not, with a host tier, under each
  token-budget policy) equal reuse off and a plain full-sequence forward of the same model.
"""

import random
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from tests.helpers import factories
from tests.helpers.factories import make_config, make_sim_executor
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.llmapi import KvCacheConfig, RequestError

VOCAB = 512  # the tiny model's


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the traffic --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrival:
    prompt: list[int]
    max_tokens: int
    cancel: bool  # aborted once the executor has run GAP iterations past its burst


TRAFFIC = dict(
    tokens_per_block=8,
    max_num_tokens=64,  # forces chunking: prompts run up to 200 tokens
    num_blocks=48,  # tight: 384 tokens for up to a dozen requests in flight
    max_seq_len=512,
    enable_chunked_prefill=True,
)
GAP = 8  # executor iterations between bursts


def llm_options():
    """TRAFFIC as ``LLM`` keywords (the sim takes it through ``make_config``)."""
    options = {k: v for k, v in TRAFFIC.items() if k not in ("tokens_per_block", "num_blocks")}
    kv = KvCacheConfig(tokens_per_block=TRAFFIC["tokens_per_block"], num_blocks=TRAFFIC["num_blocks"])
    return dict(options, kv_cache_config=kv)


INVALID = [[], [1, 2, 5000], [3] * 600]  # empty, outside the vocabulary, longer than max_seq_len


def mixed_traffic(seed=3, n=200):
    """Bursts of requests: half extend one of six shared documents, half are unrelated."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(40, 160))] for _ in range(6)]
    arrivals = []
    for _ in range(n):
        if rng.random() < 0.5:
            doc = rng.choice(docs)
            prompt = doc[: rng.randrange(len(doc) // 2, len(doc) + 1)]
            prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
        else:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 200))]
        arrivals.append(Arrival(prompt, rng.randrange(1, 9), cancel=rng.random() < 0.08))
    bursts, start = [], 0
    while start < n:
        size = rng.randrange(1, 8)
        bursts.append(arrivals[start : start + size])
        start += size
    for i, prompt in enumerate(INVALID):  # a few invalid requests ride along in some bursts
        bursts[5 + 7 * i].append(Arrival(prompt, 4, cancel=False))
    return bursts


def run_sim_traffic(policy):
    """The traffic on the simulated engine, stepped: returns the checker (drained)."""
    executor = make_sim_executor(make_config(token_budget_policy=policy, **TRAFFIC))
    checker = ExecutorChecker(executor)
    for burst in mixed_traffic():
        requests = [LlmRequest(input_token_ids=a.prompt, max_new_tokens=a.max_tokens) for a in burst]
        for request in requests:
            checker.submit(request)
        for _ in range(GAP):
            checker.step()
        for arrival, request in zip(burst, requests):
            if arrival.cancel:
                checker.cancel(request.request_id)
    checker.drain()
    return checker


def overshoots(stats):
    return [s.overshoot for s in stats if s.overshoot]


class IterationWatch:
    """Counts the executor's iterations (an iteration listener) so that a test can wait for
    more of them without polling for each one."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.count = 0
        self._changed = threading.Condition()
        executor.add_iteration_listener(self._counted)

    def _counted(self, stats) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def _idle(self) -> bool:
        health = self.executor.health()
        return health.active_requests == 0 and health.queued_requests == 0

    def wait(self, iterations: int, timeout: float = 60.0) -> None:
        """Until ``iterations`` more have run, or the executor has nothing left to do."""
        deadline = time.monotonic() + timeout
        with self._changed:
            target = self.count + iterations
            # an idle loop publishes nothing more: look again every 50 ms for that
            while self.count < target and not self._idle():
                assert time.monotonic() < deadline, f"the executor ran no {iterations} iterations in {timeout} s (hung?)"
                self._changed.wait(0.05)


def test_mixed_traffic_through_llm_under_recheck():
    started = time.monotonic()
    handles, rejected = [], []
    with LLM("tiny-random", dtype="float32", **llm_options()) as llm:
        watch = IterationWatch(llm.executor)
        for burst in mixed_traffic():
            submitted = []
            for arrival in burst:
                try:
                    handle = llm.generate_async(arrival.prompt, SamplingParams(max_tokens=arrival.max_tokens))
                except ValueError as error:  # invalid: refused before anything is queued
                    rejected.append(str(error))
                    continue
                handles.append((arrival, handle))
                submitted.append((arrival, handle))
            watch.wait(GAP)
            for arrival, handle in submitted:
                if arrival.cancel:
                    handle.abort()
        finals = {}
        for arrival, handle in handles:
            try:
                finals[handle.request_id] = handle.result(timeout=60)
            except RequestError as error:  # must not happen under recheck; reported below
                finals[handle.request_id] = error
    stats = llm.iteration_stats  # the executor thread has stopped: a complete record

    assert len(rejected) == len(INVALID)
    for message, fragment in zip(rejected, ("prompt is empty", "outside the vocabulary", "exceeds max_seq_len")):
        assert fragment in message
    errors = [f for f in finals.values() if isinstance(f, RequestError)]
    assert not errors, errors[:3]
    num_cancelled = 0
    for arrival, handle in handles:
        completion = finals[handle.request_id].outputs[0]
        if completion.finish_reason == "cancelled":
            assert arrival.cancel
            num_cancelled += 1
        else:
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == arrival.max_tokens
    assert len(handles) == 200

    assert llm.executor.load().kv.num_held == 0  # drained: every block free or cached
    assert overshoots(stats) == [], overshoots(stats)
    assert max(s.forward_tokens for s in stats) <= TRAFFIC["max_num_tokens"]
    assert sum(s.reuse_claimed_tokens for s in stats) > 0
    deferrals = sum(s.num_budget_deferrals for s in stats)
    print(
        f"\nLLM recheck: {len(stats)} iterations, 0 overshoots, {deferrals} budget deferrals,"
        f" {num_cancelled} cancelled, {len(rejected)} rejected, {time.monotonic() - started:.1f} s"
    )


def test_mixed_traffic_on_the_sim_engine_none_overshoots_recheck_does_not():
    upstream = run_sim_traffic("none")  # runs on after each overshoot: the batch fails, the loop goes on
    ours = run_sim_traffic("recheck")

    upstream_overshoots = overshoots(upstream.executor.iteration_stats)
    failed = sum(1 for r in upstream.final.values() if r.error and "TokenBudgetExceeded" in r.error)
    report = (
        f"sim, same traffic: none overshot in {len(upstream_overshoots)} of"
        f" {len(upstream.executor.iteration_stats)} iterations (by {upstream_overshoots} tokens,"
        f" failing {failed} requests); recheck: 0, with"
        f" {sum(s.num_budget_deferrals for s in ours.executor.iteration_stats)} budget deferrals"
    )
    print("\n" + report)
    assert len(upstream_overshoots) >= 1, report
    assert overshoots(ours.executor.iteration_stats) == [], report
    assert not [r for r in ours.final.values() if r.error and "InvalidRequestError" not in r.error], report
    invalid = [r for r in ours.final.values() if r.error]
    assert len(invalid) == len(INVALID)


# ---- reuse transparency (float64, greedy) -------------------------------------------
TPB = 8
MAX_TOKENS = 5
MODEL = LlamaConfig(dtype="float64")


def greedy_reference(model, prompt, max_tokens=MAX_TOKENS):
    return factories.greedy_reference(model, prompt, max_tokens)


def unaligned(prompt, rng):
    """Avoid a block-aligned prompt: fully cached, it is the whole-prompt hit that ``none`` and
    ``fit`` may overshoot on (tested elsewhere), which would fail this test for the wrong reason."""
    return prompt + [rng.randrange(1, VOCAB)] if len(prompt) % TPB == 0 else prompt


@pytest.fixture(scope="module")
def conversation():
    """Waves of prompts sharing prefixes, with their reference outputs.

    Wave 1 caches a document; wave 2 extends it at several depths (full and partial block
    matches) next to an unrelated long prompt; wave 3 continues wave-2 conversations with
    their own outputs (reuse of blocks that hold generated tokens).
    """
    rng = random.Random(11)
    model = LlamaForCausalLM(MODEL)
    words = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    doc = words(45)
    waves = [[doc]]
    waves.append([unaligned(doc[:29] + words(6), rng), unaligned(doc + words(9), rng), words(100), doc[:21] + words(3)])
    reference = {tuple(p): greedy_reference(model, p) for p in waves[0] + waves[1]}
    third = [unaligned(p + reference[tuple(p)] + words(4), rng) for p in waves[1][:2]]
    third.append(unaligned(doc + words(2), rng))
    waves.append(third)
    reference.update({tuple(p): greedy_reference(model, p) for p in third})
    return waves, reference


def host_cache_size(num_blocks):
    model = LlamaForCausalLM(MODEL)
    block_shape = model.kv_cache_shape(1, TPB)[1:]
    return num_blocks * KVCacheStorage.bytes_per_block(MODEL.num_layers, block_shape, torch.float64)


VARIANTS = {
    "reuse-off": dict(enable_block_reuse=False, num_blocks=64),
    "partial-reuse": dict(enable_partial_reuse=True, num_blocks=64),
    "no-partial-reuse": dict(enable_partial_reuse=False, num_blocks=64),
    "host-tier": dict(num_blocks=20, host_cache_size=host_cache_size(48)),
}


@pytest.mark.parametrize("policy", ["none", "trim", "fit", "recheck"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_match_the_reference(conversation, variant, policy):
    waves, reference = conversation
    with LLM(
        MODEL,
        max_num_tokens=32,
        enable_chunked_prefill=True,
        token_budget_policy=policy,
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, **VARIANTS[variant]),
    ) as llm:
        for wave in waves:
            outputs = llm.generate(wave, SamplingParams(max_tokens=MAX_TOKENS))
            for prompt, output in zip(wave, outputs):
                assert output.outputs[0].token_ids == reference[tuple(prompt)], (variant, policy, len(prompt))
    stats = llm.iteration_stats
    claimed = sum(s.reuse_claimed_tokens for s in stats)
    kv = llm.executor.load().kv
    if variant == "reuse-off":
        assert claimed == 0
    else:
        assert claimed > 0, "no reuse happened: the test would prove nothing"
    if variant == "host-tier":
        assert kv.num_offloads > 0 and kv.num_onboards > 0
    assert all(s.error is None for s in stats)


def test_paused_requests_resume_with_the_reference_output():
    """MAX_UTILIZATION pauses the latest request when blocks run out; it recomputes its
    prompt and generated tokens as context (reusing its own cached blocks) and continues."""
    rng = random.Random(12)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (13, 22, 9)]
    with LLM(
        MODEL,
        max_num_tokens=32,
        enable_chunked_prefill=True,
        capacity_scheduler_policy="MAX_UTILIZATION",
        kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=24),
    ) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24))
    assert sum(s.num_paused_requests for s in llm.iteration_stats) > 0, "the pool was expected to run out"
    model = factories.served_model(MODEL)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == greedy_reference(model, prompt, 24)
