"""Stateful property test of the executor loop (DESIGN.md §3, invariants 1-6).

A :class:`hypothesis.stateful.RuleBasedStateMachine` drives a simulated executor
(:func:`factories.make_sim_executor`: every part real except the model) with a random
configuration — small pools for eviction pressure, host tier on or off, chunked prefill
on or off, either capacity policy, either chunking policy, budgets down to one block —
through arrivals (prompts sharing prefixes, identical repeats, extensions, beam search,
draft tokens, first-draft requests), bursts, steps and cancellations.
:class:`invariants.ExecutorChecker` checks every step; the teardown drains the executor
and checks liveness and the leak oracle.

``claim`` (claim-then-charge) is held to the same invariants as ``recheck``. The same
machine runs under ``fit`` and ``none`` with the invariants they promise
(everything but no-overshoot): they keep requests, progress and the pool intact and
only break the budget.
"""

from __future__ import annotations

import itertools

from tests.helpers.factories import make_request, make_sim_executor
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from tests.helpers.invariants import ExecutorChecker
from tests.helpers.strategies import Prompt, RequestSpec, Setting, examples, kv_settings, request_specs

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError


class ExecutorMachine(RuleBasedStateMachine):
    """Arrivals, bursts, steps and cancellations against one executor; invariants after every step."""

    policy = "recheck"
    overlap = False  # the overlap scheduler over an engine that completes later

    def __init__(self) -> None:
        super().__init__()
        self.setting: Setting | None = None
        self.checker: ExecutorChecker | None = None
        self.earlier: list[Prompt] = []
        self.ids = itertools.count()

    @initialize(setting=kv_settings(max_blocks=24))
    def build(self, setting: Setting) -> None:
        self.setting = setting
        self.checker = ExecutorChecker(make_sim_executor(setting.config(self.policy), overlap=self.overlap))

    def _submit(self, spec: RequestSpec) -> None:
        self.earlier.append(spec.prompt)
        self.checker.submit(spec.build(next(self.ids)))

    @rule(data=st.data())
    def arrive(self, data) -> None:
        self._submit(data.draw(request_specs(self.setting, tuple(self.earlier)), label="request"))

    @rule(data=st.data())
    def arrive_identical(self, data) -> None:
        if not self.earlier:
            return self.arrive(data)
        prompt = data.draw(st.sampled_from(self.earlier), label="repeat of")
        self._submit(RequestSpec(prompt, max_new_tokens=data.draw(st.integers(1, 4), label="max_new_tokens")))

    @rule(data=st.data(), size=st.integers(2, 6))
    def burst(self, data, size: int) -> None:
        for _ in range(size):
            self.arrive(data)

    @rule()
    def step(self) -> None:
        self.checker.step()

    @rule(steps=st.integers(2, 12))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.checker.step()

    @rule(data=st.data())
    def cancel(self, data) -> None:
        if not self.checker.submitted:
            return
        request_id = data.draw(st.sampled_from(sorted(self.checker.submitted)), label="cancel")
        self.checker.cancel(request_id)

    def teardown(self) -> None:
        if self.checker is None:
            return
        self.checker.drain()
        for request_id, response in self.checker.final.items():
            error = response.error or ""
            # by design a request fails only when it could never be served, or (policies
            # without safety) when its batch overshot
            assert not error or error.startswith(InvalidRequestError.__name__) or "max_num_tokens" in error, (
                f"request {request_id} failed: {error}"
            )
            if self.policy in ("recheck", "claim"):
                assert "should be less than or equal to max_num_tokens" not in error, error
        requests = self.checker.submitted.values()
        pool = self.checker.executor.kv_cache_manager.pool
        for happened, what in (
            (self.checker.num_budget_deferrals, "budget deferrals"),
            (self.checker.num_capacity_deferrals, "capacity deferrals"),
            (any(r.counters.pauses for r in requests), "a request paused"),
            (any(r.is_cancelled for r in requests), "a request cancelled"),
            (pool.num_evictions, "blocks evicted"),
            (pool.num_offloads, "blocks offloaded"),
            (pool.num_onboards, "blocks onboarded"),
            (any(r.error and "max_num_tokens (" in r.error for r in requests), "a batch overshot"),
        ):
            if happened:
                event(f"{self.policy}: {what}")


class ClaimExecutorMachine(ExecutorMachine):
    policy = "claim"


class FitExecutorMachine(ExecutorMachine):
    policy = "fit"


class NoneExecutorMachine(ExecutorMachine):
    policy = "none"


class OverlapRecheckExecutorMachine(ExecutorMachine):
    overlap = True


class OverlapClaimExecutorMachine(ExecutorMachine):
    policy = "claim"
    overlap = True


class OverlapNoneExecutorMachine(ExecutorMachine):
    policy = "none"
    overlap = True


STATEFUL = settings(max_examples=examples(1, 250), stateful_step_count=50)

TestRecheckExecutor = ExecutorMachine.TestCase
TestRecheckExecutor.settings = STATEFUL
TestClaimExecutor = ClaimExecutorMachine.TestCase
TestClaimExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 2, 100))
TestFitExecutor = FitExecutorMachine.TestCase
TestFitExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 60))
TestNoneExecutor = NoneExecutorMachine.TestCase
TestNoneExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 60))
# The same machines under the overlap scheduler (DESIGN.md §7: every invariant holds under it).
TestOverlapRecheckExecutor = OverlapRecheckExecutorMachine.TestCase
TestOverlapRecheckExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 2, 150))
TestOverlapClaimExecutor = OverlapClaimExecutorMachine.TestCase
TestOverlapClaimExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 60))
TestOverlapNoneExecutor = OverlapNoneExecutorMachine.TestCase
TestOverlapNoneExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 60))


# ---- hangs this machine found, pinned down ------------------------------------------------


def test_a_request_filling_the_pool_finishes_despite_a_partial_match():
    """Partial reuse pinned its copy source and the request, needing every block, waited forever."""
    checker = ExecutorChecker(
        make_sim_executor(tokens_per_block=4, num_blocks=3, max_num_tokens=64, enable_chunked_prefill=False)
    )
    checker.submit(make_request(list(range(1, 6)), max_new_tokens=1))  # leaves [1, 2, 3, 4] cached
    checker.drain()
    checker.submit(make_request([1, 2, 3, *range(50, 58)], max_new_tokens=1))  # 3 blocks; 3 tokens match
    checker.drain()
    assert not checker.final[max(checker.final)].error


def test_a_last_chunk_that_can_never_fit_with_its_drafts_is_refused_not_hung():
    """A whole-unit last chunk plus its drafts exceeded max_num_tokens: never scheduled, and FCFS
    kept every context request behind it waiting too."""
    checker = ExecutorChecker(make_sim_executor(tokens_per_block=5, max_num_tokens=5, num_blocks=8))
    stuck = make_request(prompt_len=10, max_new_tokens=1)
    stuck.py_draft_tokens = [7, 7, 7]  # last chunk: 5 tokens + 3 drafts > 5
    behind = make_request(prompt_len=2, max_new_tokens=1)
    checker.submit(stuck)
    checker.submit(behind)
    checker.drain()
    assert checker.final[stuck.request_id].error.startswith(InvalidRequestError.__name__)
    assert not checker.final[behind.request_id].error


def test_a_paused_request_that_no_longer_fits_a_forward_fails_instead_of_blocking_the_queue():
    """MAX_UTILIZATION paused a request; its generated tokens made its context longer than
    max_num_tokens, which without chunked prefill it could never be scheduled with again."""
    checker = ExecutorChecker(
        make_sim_executor(
            tokens_per_block=3,
            num_blocks=4,
            max_num_tokens=9,
            enable_chunked_prefill=False,
            enable_block_reuse=False,
            capacity_scheduler_policy="MAX_UTILIZATION",
        )
    )
    first = make_request(prompt_len=1, max_new_tokens=4)
    paused = make_request(prompt_len=7, max_new_tokens=4)  # paused with 3 tokens generated: 10 > 9
    checker.submit(first)
    checker.submit(paused)
    checker.drain()
    assert paused.counters.pauses == 1
    assert "exceeds max_num_tokens" in checker.final[paused.request_id].error
    assert not checker.final[first.request_id].error
