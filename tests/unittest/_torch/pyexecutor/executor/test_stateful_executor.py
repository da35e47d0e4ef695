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

from hypothesis import settings

from tests.helpers.executor_machines import ExecutorMachine
from tests.helpers.factories import make_request, make_sim_executor
from tests.helpers.invariants import ExecutorChecker
from tests.helpers.strategies import examples

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError


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
