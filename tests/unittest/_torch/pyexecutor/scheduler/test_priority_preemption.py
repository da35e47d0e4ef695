"""Priority preemption on the real torch engine (tiny-random, float64): outputs do not change.

Low-priority requests fill the KV pool and decode; high-priority requests arrive and cannot be
admitted, so they preempt low-priority ones. A preempted request's computed blocks are
committed and released: with a host tier the allocations that follow push them there and the
resumption onboards them (only the last, partial block is recomputed); without one, what was
evicted is recomputed. Either way every request's greedy output equals a recomputation of the
whole sequence with no KV cache at all (``forward_full``), and the invariant checker (budget,
clean deferrals, KV integrity, nothing lost) and the priority oracle hold at every step.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.factories import greedy_reference, make_config, make_request, served_model
from test_priority_stateful import PriorityChecker

from tensorrt_llm._torch.pyexecutor.config import SchedulerConfig
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TPB = 4


@pytest.fixture(scope="module")
def model():
    return served_model("tiny-random", dtype="float64")


def _executor(model, *, host_blocks: int, cooldown: int = 2, overlap: bool = False):
    config = make_config(max_num_tokens=32, max_batch_size=8, tokens_per_block=TPB, num_blocks=36, max_seq_len=128,
                         scheduler_config=SchedulerConfig(waiting_queue_policy="priority", enable_preemption=True,
                                                          preemption_cooldown_iterations=cooldown))
    kv = dataclasses.replace(config.kv_cache_config,
                             host_cache_size=host_blocks * TPB * model.config.kv_bytes_per_token)
    config = dataclasses.replace(config, kv_cache_config=kv, disable_overlap_scheduler=not overlap)
    return create_py_executor(config, model=model)


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % 400 for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("host_blocks", [64, 0], ids=["host tier: onboarded", "no host tier: recomputed"])
def test_preempted_requests_generate_what_they_would_have_unpreempted(model, host_blocks, overlap):
    executor = _executor(model, host_blocks=host_blocks, overlap=overlap)
    assert executor.overlap == overlap
    checker = PriorityChecker(executor, order=PriorityOrder(executor.config.scheduler_config.priority_aging_rate),
                              cooldown=2)
    low = [make_request(_prompt(40, i), max_new_tokens=24, priority=0.1, arrival_time=1.0 + i) for i in range(3)]
    high = [make_request(_prompt(12, 10 + i), max_new_tokens=6, priority=0.9, arrival_time=10.0 + i) for i in range(3)]
    for request in low:
        checker.submit(request)
    for _ in range(8):  # two low-priority requests hold the pool and decode
        checker.step()
    for request in high:
        checker.submit(request)
    checker.drain()
    assert checker.num_preemptions > 0
    preempted = [r for r in low if r.counters.preemptions]
    assert preempted and not any(r.counters.preemptions for r in high)
    if host_blocks:
        assert sum(r.counters.onboarded_tokens for r in preempted) > 0
        # only a partial last block (and positions an earlier preemption had not computed) are redone
        assert all(r.counters.recomputed_tokens < TPB * r.counters.preemptions for r in preempted)
    else:
        assert sum(r.counters.recomputed_tokens for r in preempted) > 0
    for request in low + high:
        assert checker.tokens[request.request_id] == greedy_reference(model, list(request.input_token_ids),
                                                                      request.max_new_tokens), request
    # the high-priority requests finished before every low-priority one that was still running
    assert max(r.finish_time for r in high) < min(r.finish_time for r in preempted)
