"""``ExecutorClient``: one rank and several stand in for each other, and answer in values."""

import dataclasses

import pytest
from tests.helpers.factories import make_config, make_request, make_sim_executor

from tensorrt_llm._torch.distributed.multi_rank_executor import MultiRankExecutor
from tensorrt_llm._torch.pyexecutor.executor.client import ExecutorClient, Health
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor

MEMBERS = sorted(n for n, v in vars(ExecutorClient).items() if not n.startswith("_") and (callable(v) or isinstance(v, property)))


def test_the_interface_is_what_the_server_and_llm_use():
    assert MEMBERS == [
        "add_iteration_listener", "cancel_request", "enqueue_request", "enqueue_requests", "faults_injected",
        "get_kv_cache_events", "health", "iteration_stats", "iteration_stats_by_rank", "kv_cache_event_counts",
        "load", "reset_prefix_cache", "shutdown", "start", "validate",
    ]


@pytest.mark.parametrize("cls", [PyExecutor, MultiRankExecutor])
def test_both_executors_implement_every_member(cls):
    for name in MEMBERS:
        own = getattr(cls, name, None)
        assert own is not None, f"{cls.__name__} lacks {name}"
        assert isinstance(own, property) == isinstance(vars(ExecutorClient)[name], property), name


def test_one_rank_answers_in_values():
    executor = make_sim_executor(make_config(tokens_per_block=4, num_blocks=16))
    executor.enqueue_requests([(make_request(prompt_len=9, max_new_tokens=2), None) for _ in range(2)])
    load = executor.load()
    assert (load.running, load.waiting, load.kv.num_held) == (0, 2, 0)  # queued, not fetched yet
    executor.step()
    assert executor.load().running == 2 and executor.load().kv.num_held == 6  # 3 blocks each
    executor.run_until_idle()
    health = executor.health()
    assert dataclasses.is_dataclass(health) and health.healthy and health.iterations == 2  # prefill, one decode
    with pytest.raises(dataclasses.FrozenInstanceError):
        health.healthy = False
    assert executor.load().kv.num_held == 0 and executor.faults_injected() == {}
    assert executor.iteration_stats_by_rank() == [(0, s) for s in executor.iteration_stats]


def test_health_serves_the_documented_keys():
    health = Health(True, None, True, 0.0, 3, 1, 0, 0, 0, None)
    assert set(health.to_dict()) >= {"healthy", "reason", "iterations", "active_requests", "failed_batches",
                                     "budget_violations", "last_error"}
