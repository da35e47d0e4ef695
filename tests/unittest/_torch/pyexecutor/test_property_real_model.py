"""Invariant 7 with the real model: reuse is transparent (DESIGN.md §3).

Each example draws a workload — block size, budget, pool, host tier, chunking and
capacity policies, prompts built from shared "documents" — and serves it with the real
``LLM(model="tiny-random", dtype="float64")`` under every token-budget policy, with block
reuse off, on, and on with partial reuse. Greedy outputs must equal greedy decoding with
``forward_full`` (one whole sequence, no cache), hence each other.

The workload runs in three phases: warm prompts one at a time (they populate the prefix
tree), then a *probe* alone — the last warm prompt (block-aligned, longer than
``max_num_tokens``) plus a short tail — then a burst of prompts sharing prefixes submitted
together. Upstream's admission charges the probe only its tail; its full cost does not
fit, so with chunked prefill and reuse on the re-check must cut it (or defer it), and the
test asserts it did (``llm.iteration_stats``). Under ``none`` (and the baselines) a batch that overshoots
fails its requests; only completed requests are compared there.
"""

from __future__ import annotations

import dataclasses
import functools
import queue

import pytest
from tests.helpers import factories
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from tests.helpers.strategies import examples

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy, ContextChunkingPolicy, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.errors import RequestError
from tensorrt_llm.llmapi.llm import LLM, SamplingParams

MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")
POLICIES = ("none", "trim", "fit", "recheck", "claim")
REUSE_MODES = {"reuse off": (False, False), "reuse on": (True, False), "partial reuse": (True, True)}
SAFE_POLICIES = ("recheck", "claim")
RESULT_TIMEOUT_S = 60  # a hang (liveness bug) fails the test instead of stalling it


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def reference_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(MODEL)


@functools.lru_cache(maxsize=4096)
def greedy_reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(factories.greedy_reference(reference_model(), prompt, max_tokens))


def document(doc: int, length: int) -> list[int]:
    return [1 + (doc * 7919 + i * 104729 + (i * i) % 11) % (MODEL.vocab_size - 2) for i in range(length)]


@dataclasses.dataclass(frozen=True)
class Workload:
    tokens_per_block: int
    max_num_tokens: int
    enable_chunked_prefill: bool
    num_blocks: int
    host_blocks: int
    offload_ahead: int  # KvCacheConfig.offload_ahead_blocks (with a host tier only)
    capacity_policy: CapacitySchedulerPolicy
    chunking_policy: ContextChunkingPolicy
    max_tokens: int
    warm: tuple[tuple[int, ...], ...]
    probe: tuple[int, ...]
    burst: tuple[tuple[int, ...], ...]

    @property
    def prompts(self) -> list[tuple[int, ...]]:
        return [*self.warm, self.probe, *self.burst]

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(
            f"Workload(tpb={self.tokens_per_block} max_num_tokens={self.max_num_tokens}"
            f" chunked={self.enable_chunked_prefill} blocks={self.num_blocks} host={self.host_blocks}"
            f" ahead={self.offload_ahead}"
            f" {self.capacity_policy.value} {self.chunking_policy.value} max_tokens={self.max_tokens}"
            f" warm={[len(p) for p in self.warm]} probe={len(self.probe)} burst={[len(p) for p in self.burst]})"
        )


@st.composite
def workloads(draw) -> Workload:
    tpb = draw(st.integers(1, 8))
    chunked = draw(st.integers(0, 3)) > 0
    max_tokens = draw(st.integers(1, 5))
    tails = st.lists(st.integers(1, MODEL.vocab_size - 1), max_size=2 * tpb)
    budget = draw(st.integers(tpb, 4 * tpb))
    # the probe's warm prefix: whole blocks, longer than the budget
    warm_len = -(-budget // tpb) * tpb + tpb * draw(st.integers(0, 2))
    warm = [
        tuple(document(draw(st.integers(0, 1)), draw(st.integers(1, warm_len))) + draw(tails))
        for _ in range(draw(st.integers(0, 2)))
    ]
    # warmed last, so nothing allocates between caching the probe's prefix and the probe
    warm.append(tuple(document(0, warm_len)))
    probe = warm[-1] + tuple(draw(st.lists(st.integers(1, MODEL.vocab_size - 1), min_size=1, max_size=min(budget, tpb))))
    burst = []
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.integers(0, 3)) == 0:  # an identical repeat
            burst.append(draw(st.sampled_from([*warm, probe])))
        else:  # a prefix of a document, aligned or not, and a tail
            head = document(draw(st.integers(0, 1)), draw(st.integers(0, warm_len + tpb)))
            burst.append(tuple(head + draw(tails)) or (1,))
    longest = max(map(len, [*warm, probe, *burst]))
    if not chunked:  # every prompt must fit a forward, also recomputed with its tokens after a pause
        budget = draw(st.integers(longest + max_tokens, longest + max_tokens + 2 * tpb))
    need = -(-(longest + max_tokens) // tpb)
    num_blocks = draw(st.integers(need, 3 * need + 4))
    host_blocks = draw(st.integers(0, 8)) if draw(st.booleans()) else 0
    return Workload(
        tokens_per_block=tpb,
        max_num_tokens=budget,
        enable_chunked_prefill=chunked,
        num_blocks=num_blocks,
        host_blocks=host_blocks,
        offload_ahead=draw(st.integers(0, num_blocks - 1)) if host_blocks else 0,
        capacity_policy=draw(st.sampled_from(CapacitySchedulerPolicy)),
        chunking_policy=draw(st.sampled_from(ContextChunkingPolicy)),
        max_tokens=max_tokens,
        warm=tuple(warm),
        probe=probe,
        burst=tuple(burst),
    )


def serve(workload: Workload, policy: str, reuse: bool, partial: bool, overlap: bool = False):
    """Run the three phases on a fresh LLM; returns (outputs or error per prompt, iteration stats, health).
    ``overlap``: the overlap scheduler (``disable_overlap_scheduler=False``)."""
    block_bytes = 2 * MODEL.num_layers * workload.tokens_per_block * MODEL.num_kv_heads * MODEL.head_dim * 8
    llm = LLM(
        MODEL,
        max_num_tokens=workload.max_num_tokens,
        max_seq_len=512,
        max_batch_size=8,
        disable_overlap_scheduler=not overlap,
        enable_chunked_prefill=workload.enable_chunked_prefill,
        token_budget_policy=policy,
        capacity_scheduler_policy=workload.capacity_policy,
        context_chunking_policy=workload.chunking_policy,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=workload.tokens_per_block,
            num_blocks=workload.num_blocks,
            enable_block_reuse=reuse,
            enable_partial_reuse=partial,
            host_cache_size=workload.host_blocks * block_bytes,
            offload_ahead_blocks=workload.offload_ahead,
        ),
    )
    params = SamplingParams(max_tokens=workload.max_tokens)
    results: list[tuple[int, ...] | str] = []

    def wait(handles) -> None:
        for handle in handles:
            try:
                results.append(tuple(handle.result(timeout=RESULT_TIMEOUT_S).outputs[0].token_ids))
            except RequestError as error:
                results.append(error.message)
            except queue.Empty:
                raise AssertionError(f"{policy}: a request never finished (liveness)") from None

    with llm:
        for prompt in workload.warm:  # one at a time: each is cached before the next
            wait([llm.generate_async(prompt, params)])
        wait([llm.generate_async(workload.probe, params)])
        wait([llm.generate_async(prompt, params) for prompt in workload.burst])
        return results, llm.iteration_stats, llm.health()


@settings(max_examples=examples(1 / 15, 10))
@given(workload=workloads(), mode=st.sampled_from(sorted(REUSE_MODES)))
def test_greedy_outputs_match_forward_full_under_every_policy_and_reuse_mode(workload: Workload, mode: str):
    """Every policy in one drawn reuse mode, and recheck (the fix) in all three; each against forward_full."""
    expected = [greedy_reference(prompt, workload.max_tokens) for prompt in workload.prompts]
    runs = [(policy, mode) for policy in POLICIES] + [("recheck", other) for other in REUSE_MODES if other != mode]
    for policy, run_mode in runs:
        reuse, partial = REUSE_MODES[run_mode]
        results, stats, health = serve(workload, policy, reuse, partial)
        where = f"{policy}, {run_mode}"
        note(f"{where}: {results}")
        for index, (got, want) in enumerate(zip(results, expected)):
            if isinstance(got, str):  # the request failed: only a policy without safety may overshoot
                assert policy not in SAFE_POLICIES and "max_num_tokens" in got, f"{where}: prompt {index} failed: {got}"
                event(f"{policy}: a batch overshot")
                continue
            assert got == want, f"{where}: prompt {index} {workload.prompts[index]} gave {got}, want {want}"
        deferrals = sum(s.num_budget_deferrals for s in stats)
        interventions = deferrals + sum(s.num_budget_cuts for s in stats)
        if policy in SAFE_POLICIES:
            assert health.budget_violations == 0, where
            assert max(s.forward_tokens for s in stats) <= workload.max_num_tokens, where
            if deferrals:
                event(f"{policy}: deferrals happened")
            if interventions > deferrals:
                event(f"{policy}: chunks were cut")
        # The probe's prefix is cached just before it (warmed last), so admission discounts it and
        # its full cost exceeds the budget. Evicting ahead breaks that premise: it moves cached
        # blocks to the host tier after every step, which drops them when the tier is small.
        if policy == "recheck" and reuse and workload.enable_chunked_prefill and not workload.offload_ahead:
            assert interventions >= 1, f"{where}: the probe (full cost > max_num_tokens) was neither cut nor deferred"
        if any(s.num_paused_requests for s in stats):
            event(f"{policy}: a request was paused")
        if any(s.reuse_claimed_tokens for s in stats):
            event(f"{run_mode}: reuse claimed")


@settings(max_examples=examples(1 / 30, 4))
@given(workload=workloads(), mode=st.sampled_from(sorted(REUSE_MODES)))
def test_greedy_outputs_with_overlap_match_forward_full_under_every_policy(workload: Workload, mode: str):
    """The overlap scheduler (n+1 scheduled and prepared before n's tokens reach the host)
    gives every policy the greedy outputs of forward_full, as the plain loop does."""
    expected = [greedy_reference(prompt, workload.max_tokens) for prompt in workload.prompts]
    reuse, partial = REUSE_MODES[mode]
    for policy in POLICIES:
        results, stats, health = serve(workload, policy, reuse, partial, overlap=True)
        where = f"{policy}, {mode}, overlap"
        note(f"{where}: {results}")
        for index, (got, want) in enumerate(zip(results, expected)):
            if isinstance(got, str):
                assert policy not in SAFE_POLICIES and "max_num_tokens" in got, f"{where}: prompt {index} failed: {got}"
                continue
            assert got == want, f"{where}: prompt {index} {workload.prompts[index]} gave {got}, want {want}"
        if policy in SAFE_POLICIES:
            assert health.budget_violations == 0, where
            assert max(s.forward_tokens for s in stats) <= workload.max_num_tokens, where
