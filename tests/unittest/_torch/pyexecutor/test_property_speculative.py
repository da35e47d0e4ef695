"""Speculative decoding on the real engine: greedy outputs with drafts equal those without.

Each example serves a drawn workload with ``tiny-random`` (float64) through the torch engine
under a drawn token-budget policy, with block reuse, chunked prefill and budget deferrals
forced by a tight budget, and checks after every step, through the shared
:class:`~invariants.ExecutorChecker`, the invariants of DESIGN.md §3 that the policy promises
(the forward cost of drafts and first drafts bounding what ``_prepare_tp_inputs`` built, on a
forward that then really ran), then the drained pool (the leak oracle). Every request's output
must equal greedy decoding with ``forward_full`` (no cache, no drafts), cut at its ``end_id``.

Two drafters: the production n-gram drafter (which tiny-random rarely rewards) and a
*reference* drafter that proposes the true greedy continuation with drawn tokens made wrong,
so that runs of accepted drafts, rejections at every draft position, an ``end_id`` inside an
accepted run and the KV roll-back of rejected positions all happen.

Half the examples run the overlap scheduler: a speculative request is then in the next forward
before its drafts are verified, laid out as if they were all accepted, and moved back over the
rejected ones (``engine``'s module docstring); the outputs must still be greedy decoding's. The
simulated engine (which rejects every draft) runs the same scheduling with drafts against its
own plain run, with the invariants checked after every step.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st
from tests.helpers.invariants import ExecutorChecker
from tests.helpers.strategies import examples
# the model, its greedy reference (forward_full, no cache, no drafts) and the shared documents
from test_property_real_model import MODEL, document, greedy_reference, reference_model

from tensorrt_llm._torch.pyexecutor.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    ExecutorConfig,
    KvCacheConfig,
    SpeculativeConfig,
    TokenBudgetPolicyName,
)
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter, NGramDrafter
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, num_in_flight_tokens
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

MAX_SEQ_LEN = 256

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ReferenceDrafter(Drafter):
    """Proposes the true greedy continuation, except at positions where ``(position * 7 +
    salt) % period == phase`` (a wrong token there; ``salt``: the request's submission index):
    every acceptance length happens. Its :attr:`proposer` does the same from a token history
    alone (an engine drafting a step built in flight), keyed by the prompt the history starts
    with (salt: the prompt's length), so that under overlap too every acceptance length happens."""

    def __init__(self, config: SpeculativeConfig, period: int, phase: int) -> None:
        super().__init__(config, MAX_SEQ_LEN)
        self.period, self.phase = period, phase
        self.continuations: dict[int, tuple[int, tuple[int, ...]]] = {}  # request id -> (salt, prompt + reference)
        self.proposer = _ReferenceProposer(self, config.max_draft_len)

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        salt, full = self.continuations[request.request_id]
        return self.drafts(full, len(request.tokens), max_drafts, salt)

    def drafts(self, full: tuple[int, ...], start: int, max_drafts: int, salt: int) -> list[int]:
        drafts = list(full[start : start + max_drafts])
        for i in range(len(drafts)):
            if ((start + i) * 7 + salt) % self.period == self.phase:
                drafts[i] = (drafts[i] + 1) % MODEL.vocab_size
        return drafts


class _ReferenceProposer:
    """``ReferenceDrafter``'s guesses as a ``DraftProposer`` (on the CPU engine, at resolve time)."""

    def __init__(self, drafter: ReferenceDrafter, max_draft_len: int) -> None:
        self.drafter, self.max_draft_len = drafter, max_draft_len

    def propose(self, tokens, max_drafts: int) -> list[int]:
        history = tuple(int(t) for t in tokens)
        # the reference whose prompt starts the history and which the history still follows (else any)
        fulls = sorted((full for _, full in self.drafter.continuations.values()), key=len, reverse=True)
        matching = [full for full in fulls if full[: len(history)] == history[: len(full)]]
        if not matching:
            return []
        full = matching[0]
        return self.drafter.drafts(full, len(history), min(max_drafts, self.max_draft_len), len(full) % 5)

    def propose_batch(self, history, lengths, room):
        import torch

        proposals = [self.propose(row[:length], limit)
                     for row, length, limit in zip(history.tolist(), lengths.tolist(), room.tolist())]
        drafts = torch.full((len(proposals), self.max_draft_len), -1, dtype=torch.int64)
        for row, proposal in zip(drafts, proposals):
            row[: len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
        return drafts, torch.tensor([len(p) for p in proposals], dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class Workload:
    policy: TokenBudgetPolicyName
    tokens_per_block: int
    max_num_tokens: int
    chunked: bool
    num_blocks: int
    reuse: bool
    partial: bool
    capacity: CapacitySchedulerPolicy
    chunking: ContextChunkingPolicy
    max_draft_len: int
    drafter: str  # "ngram" or "reference"
    period: int
    phase: int
    overlap: bool
    max_concurrency: int | None  # SpeculativeConfig: no drafts above this many active requests
    acceptance: tuple[float, int] | None  # SpeculativeConfig: (acceptance_rate_threshold, window_size)
    warm: tuple[tuple[int, ...], ...]
    burst: tuple[tuple[tuple[int, ...], int, int | None], ...]  # (prompt, max_tokens, end_id index in the reference)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(
            f"Workload({self.policy.value} tpb={self.tokens_per_block} max_num_tokens={self.max_num_tokens}"
            f" chunked={self.chunked} blocks={self.num_blocks} reuse={self.reuse}/{self.partial}"
            f" {self.capacity.value} {self.chunking.value} max_draft_len={self.max_draft_len} {self.drafter}"
            f" wrong at (7p + id) % {self.period} == {self.phase} overlap={self.overlap}"
            f" max_concurrency={self.max_concurrency} acceptance={self.acceptance}"
            f" warm={[len(p) for p in self.warm]} burst={[(len(p), n, e) for p, n, e in self.burst]})"
        )


@st.composite
def workloads(draw) -> Workload:
    tpb = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    max_draft_len = draw(st.integers(1, 4))
    tail = st.lists(st.integers(1, MODEL.vocab_size - 1), max_size=2 * tpb)
    warm = tuple(tuple(document(draw(st.integers(0, 1)), draw(st.integers(1, 4 * tpb)))) for _ in range(draw(st.integers(0, 2))))
    burst = []
    for _ in range(draw(st.integers(1, 5))):
        if warm and draw(st.integers(0, 3)) == 0:  # an identical repeat: a whole-prompt hit
            prompt = draw(st.sampled_from(warm))
        else:
            prompt = tuple(document(draw(st.integers(0, 1)), draw(st.integers(0, 5 * tpb))) + draw(tail)) or (1,)
        max_tokens = draw(st.integers(1, 12))
        end_at = draw(st.none() | st.integers(0, max_tokens - 1))
        burst.append((prompt, max_tokens, end_at))
    longest = max(len(p) + n for p, n, _ in burst)
    longest = max([longest, *(len(p) + 1 for p in warm)])
    if chunked:
        budget = draw(st.integers(max(tpb, 1 + max_draft_len), 4 * tpb + max_draft_len))
    else:  # every prompt, recomputed with its tokens after a pause, fits one forward
        budget = draw(st.integers(longest + max_draft_len, longest + max_draft_len + 3 * tpb))
    need = -(-(longest + max_draft_len) // tpb)
    reuse = draw(st.booleans())
    return Workload(
        policy=draw(st.sampled_from(TokenBudgetPolicyName)),
        tokens_per_block=tpb,
        max_num_tokens=budget,
        chunked=chunked,
        num_blocks=draw(st.integers(need, 3 * need + 4)),
        reuse=reuse,
        partial=reuse and draw(st.booleans()),
        capacity=draw(st.sampled_from(CapacitySchedulerPolicy)),
        chunking=draw(st.sampled_from(ContextChunkingPolicy)),
        max_draft_len=max_draft_len,
        drafter=draw(st.sampled_from(["reference", "reference", "ngram"])),
        period=draw(st.integers(2, 6)),
        phase=draw(st.integers(0, 5)),
        overlap=draw(st.booleans()),
        max_concurrency=draw(st.none() | st.integers(1, 4)),
        acceptance=draw(st.none() | st.tuples(st.sampled_from([0.3, 0.9, 1.0]), st.integers(1, 3))),
        warm=warm,
        burst=tuple(burst),
    )


def expected(prompt: tuple[int, ...], max_tokens: int, end_at: int | None) -> tuple[tuple[int, ...], int | None]:
    """The reference output and the request's end_id (its reference token at ``end_at``)."""
    tokens = greedy_reference(prompt, max_tokens)
    if end_at is None:
        return tokens, None
    end_id = tokens[end_at]
    return tokens[: tokens.index(end_id) + 1], end_id


def serve(workload: Workload) -> tuple[ExecutorChecker, list[tuple[LlmRequest, tuple[int, ...]]]]:
    threshold, window = workload.acceptance or (None, 8)
    spec = SpeculativeConfig(max_draft_len=workload.max_draft_len, max_matching_ngram_size=2,
                             max_concurrency=workload.max_concurrency, acceptance_rate_threshold=threshold,
                             acceptance_rate_window_size=window)
    config = ExecutorConfig(
        max_num_tokens=workload.max_num_tokens,
        max_batch_size=8,
        max_seq_len=MAX_SEQ_LEN,
        enable_chunked_prefill=workload.chunked,
        token_budget_policy=workload.policy,
        capacity_scheduler_policy=workload.capacity,
        context_chunking_policy=workload.chunking,
        disable_overlap_scheduler=not workload.overlap,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=workload.tokens_per_block,
            num_blocks=workload.num_blocks,
            enable_block_reuse=workload.reuse,
            enable_partial_reuse=workload.partial,
        ),
        speculative_config=spec,
    )
    if workload.drafter == "reference":
        drafter: Drafter = ReferenceDrafter(spec, workload.period, workload.phase)
    else:
        drafter = NGramDrafter(spec, MAX_SEQ_LEN)
    checker = ExecutorChecker(create_py_executor(config, model=reference_model(), drafter=drafter))
    _watch_drafts_in_flight(checker)
    submitted = []

    def submit(prompt: tuple[int, ...], max_tokens: int, end_at: int | None) -> None:
        want, end_id = expected(prompt, max_tokens, end_at)
        request = LlmRequest(input_token_ids=list(prompt), max_new_tokens=max_tokens, end_id=end_id)
        if isinstance(drafter, ReferenceDrafter):
            drafter.continuations[request.request_id] = (len(submitted), prompt + greedy_reference(prompt, max_tokens))
        checker.submit(request)
        submitted.append((request, want))

    for prompt in workload.warm:  # one at a time: each is cached before the next
        submit(prompt, 1, None)
        checker.drain()
    for prompt, max_tokens, end_at in workload.burst:
        submit(prompt, max_tokens, end_at)
    checker.drain()
    return checker, submitted


def _watch_drafts_in_flight(checker: ExecutorChecker) -> None:
    """Record (a hypothesis event) when a forward was launched on drafts still in flight."""
    executor = checker.executor
    step = executor.step

    def watched(*args, **kwargs):
        before = {r.request_id: num_in_flight_tokens(r.tokens) for r in executor.active_requests}
        iteration = step(*args, **kwargs)
        if iteration is not None and any(before.get(r.request_id, 0) > 1 for r in iteration.batch.generation_requests):
            event("a forward launched on drafts in flight")
        return iteration

    executor.step = watched


@settings(max_examples=examples(1 / 10, 12))
@given(workload=workloads())
def test_greedy_outputs_with_drafts_equal_greedy_decoding_under_every_policy(workload: Workload):
    checker, submitted = serve(workload)
    stats = checker.executor.iteration_stats  # all of them (overlap: an iteration's come a step later)
    for request, want in submitted:
        got = tuple(checker.tokens[request.request_id])
        response = checker.final[request.request_id]
        note(f"request {request.request_id}: got {got} want {want} error {response.error}")
        if response.error is not None:  # only a policy without safety may fail a batch (its overshoot)
            assert not checker.claims_safety and "max_num_tokens" in response.error, response.error
            event("an unsafe policy overshot")
            continue
        assert got == want, f"request {request.request_id} ({len(request.input_token_ids)}-token prompt)"
    drafts = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_draft_tokens for s in stats)
    assert accepted <= drafts
    if workload.drafter == "reference" and drafts:
        event("reference drafts: some accepted" if accepted else "reference drafts: none accepted")
    if workload.overlap and any(s.num_draft_tokens > s.num_accepted_draft_tokens for s in stats):
        event("overlap: drafts rejected (the next forward moved back)")
    if checker.num_budget_deferrals:
        event("budget deferrals")
    if not checker.executor.drafter.enabled:
        event("speculation turned off part-way")
    if any(s.reuse_claimed_tokens for s in stats):
        event("reuse claimed")


# --------------------------------------------------------------------------- the simulated engine


class _SyntheticDrafter(Drafter):
    """Drafts garbage from a request's length (the synthetic sampler rejects every draft anyway:
    it keeps one token a step); its proposer does the same from a history, for the engine."""

    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        super().__init__(config, max_seq_len)
        self.proposer = _SyntheticProposer(config.max_draft_len)

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        return self.proposer.propose(request.tokens, max_drafts)


class _SyntheticProposer:
    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len

    def propose(self, tokens, max_drafts: int) -> list[int]:
        return [1 + (len(tokens) * 31 + int(tokens[0]) + i) % 997 for i in range(min(max_drafts, self.max_draft_len))]

    def propose_batch(self, history, lengths, room):  # the simulated engine proposes on the host
        raise AssertionError("a host engine drafts one sequence at a time")


@settings(max_examples=examples(1 / 10, 12))
@given(
    specs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=8),
    max_draft_len=st.integers(1, 4),
    tpb=st.integers(1, 8),
    budget=st.integers(8, 48),
    policy=st.sampled_from(TokenBudgetPolicyName),
    max_concurrency=st.none() | st.integers(1, 4),
    blocks_slack=st.integers(0, 40),
)
# two first drafts due in an iteration above max_concurrency: they run as plain steps (2 positions
# for a budget of 2), not padded (4 positions); the checker must count what ran
@example(specs=[(1, 4), (1, 4)], max_draft_len=1, tpb=2, budget=2, policy=TokenBudgetPolicyName.RECHECK,
         max_concurrency=1, blocks_slack=8)
def test_overlap_with_drafts_on_the_simulated_engine_gives_the_plain_tokens(
    specs, max_draft_len, tpb, budget, policy, max_concurrency, blocks_slack
):
    """The simulated engine rejects every draft, so under overlap every forward built on drafts
    in flight moves back over all of them: the tokens equal the plain, unspeculated run's, and
    the invariants hold after every step (the checker's leak oracle after the drain)."""
    from tests.helpers.factories import make_config, make_request, make_sim_executor

    longest = max(p + n for p, n in specs) + max_draft_len
    config = make_config(max_num_tokens=max(budget, tpb, 1 + max_draft_len), tokens_per_block=tpb,
                         num_blocks=-(-longest // tpb) + blocks_slack, token_budget_policy=policy.value)

    def serve(speculative: bool, overlap: bool) -> dict[int, list[int]]:
        spec = SpeculativeConfig(max_draft_len=max_draft_len, max_concurrency=max_concurrency)
        run = dataclasses.replace(config, speculative_config=spec if speculative else None)
        drafter = _SyntheticDrafter(spec, run.max_seq_len) if speculative else None
        executor = make_sim_executor(run, overlap=overlap, drafter=drafter)
        checker = ExecutorChecker(executor)
        _watch_drafts_in_flight(checker)
        for i, (prompt_len, max_new) in enumerate(specs):
            checker.submit(make_request(prompt_len=prompt_len, max_new_tokens=max_new, request_id=5000 + i, seed=i))
        checker.drain()
        for rid, response in checker.final.items():  # an unsafe policy may fail a batch that overshoots
            assert response.error is None or not checker.claims_safety, response.error
        return {rid: tokens for rid, tokens in checker.tokens.items() if checker.final[rid].error is None}

    plain = serve(False, False)
    for overlap in (False, True):
        got = serve(True, overlap)
        for rid, tokens in got.items():
            if rid in plain:
                assert tokens == plain[rid], f"request {rid}, overlap={overlap}"
