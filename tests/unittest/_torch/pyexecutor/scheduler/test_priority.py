"""Per-request priority: the order, each decision that follows it, the configuration surface.

Unit cases pin each rule down by hand; the property tests (hypothesis) check the re-check's
priority rules on random batches and the order against effective priorities at random times.
The stateful executor machines with priorities are in ``test_priority_stateful.py``; the
starvation bound in ``test_priority_starvation.py``; preemption's outputs on the real engine
in ``test_priority_preemption.py``.
"""

from __future__ import annotations

import logging

import pytest
from tests.helpers.factories import make_config, make_kv_cache_manager, make_request, make_sim_executor
from hypothesis import example, given
from hypothesis import strategies as st
from tests.helpers.invariants import check_priority_recheck

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, SchedulerConfig, WaitingQueuePolicy
from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.scheduler.preemption import choose_victims
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder, priority_class
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk
from tensorrt_llm._torch.pyexecutor.scheduler import make_scheduler
from tensorrt_llm._torch.pyexecutor.budget.policies import token_budget_policy_for
from tensorrt_llm._torch.pyexecutor.budget.recheck import recheck_by_priority

PRIORITY = SchedulerConfig(waiting_queue_policy="priority", priority_aging_rate=0.0)


# ---- the order ------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 100)), min_size=2, max_size=8),
       st.floats(0, 0.5), st.floats(0, 1000))
# Two effective priorities 1.5e-10 apart on either side of a rounding boundary of the 9th decimal:
# the key ties them (it rounds its arrival-time form), rounding each at ``now`` does not.
@example(requests=[(0.0, 0.0), (0.0, 1.2377142830418393), (1.467113136790132e-10, 0.0)], rate=0.125, later=0.0)
def test_the_key_orders_as_effective_priorities_do_at_any_time(requests, rate, later):
    order = PriorityOrder(rate)
    built = [make_request(prompt_len=4, priority=p, arrival_time=a) for p, a in requests]
    now = max(a for _, a in requests) + later
    by_key = order.sorted(built)
    # The oracle: at `now`, effective priorities never increase along the key's order, up to the
    # key's own resolution (it rounds to 1e-9, so requests within that of each other are ties that
    # arrival and id decide) and the float error of computing `rate * (now - arrival)`.
    effective = [order.effective_priority(r, now) for r in by_key]
    tolerance = 1e-9 + 1e-15 * (1 + rate * now)
    assert all(a >= b - tolerance for a, b in zip(effective, effective[1:])), list(zip(by_key, effective))


def test_aging_lets_an_old_low_priority_request_pass_newer_high_priority_ones():
    order = PriorityOrder(0.1)
    old = make_request(prompt_len=4, priority=0.0, arrival_time=1.0)
    newer = make_request(prompt_len=4, priority=0.9, arrival_time=5.0)  # within (1 - 0)/0.1 = 10 s: ahead
    late = make_request(prompt_len=4, priority=1.0, arrival_time=12.0)  # past the horizon: behind
    assert order.sorted([old, newer, late]) == [newer, old, late]
    assert order.horizon(0.0) == pytest.approx(10.0)


def test_priority_classes_follow_the_configured_bounds():
    default = SchedulerConfig()
    assert [priority_class(p, default) for p in (0.0, 0.49, 0.5, 0.51, 1.0)] == ["low", "low", "normal", "high", "high"]
    wide = SchedulerConfig(priority_low_below=0.3, priority_high_above=0.7)
    assert [priority_class(p, wide) for p in (0.2, 0.3, 0.7, 0.8)] == ["low", "normal", "normal", "high"]


def test_a_priority_outside_the_unit_interval_is_refused_naming_it():
    for bad in (-0.1, 1.5, "high", True, float("nan")):
        with pytest.raises(InvalidRequestError, match="priority must be a number in"):
            make_request(prompt_len=4, priority=bad)


# ---- configuration ----------------------------------------------------------------------------


def test_scheduler_config_groups_the_policies_and_the_flat_keywords_stay_aliases():
    config = ExecutorConfig(capacity_scheduler_policy="MAX_UTILIZATION")
    assert config.scheduler_config.capacity_scheduler_policy.value == "MAX_UTILIZATION"
    config = ExecutorConfig(scheduler_config={"context_chunking_policy": "EQUAL_PROGRESS", "waiting_queue_policy": "priority"})
    assert config.context_chunking_policy.value == "EQUAL_PROGRESS"  # the alias reads the nested value
    assert config.scheduler_config.waiting_queue_policy is WaitingQueuePolicy.PRIORITY
    # an alias at its default defers to a nested value that is not
    config = ExecutorConfig(capacity_scheduler_policy="GUARANTEED_NO_EVICT",
                            scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"})
    assert config.capacity_scheduler_policy.value == "MAX_UTILIZATION"
    import dataclasses

    assert dataclasses.replace(config, max_batch_size=3).scheduler_config == config.scheduler_config
    with pytest.raises(ValueError, match="unknown keys"):
        ExecutorConfig(scheduler_config={"waiting_queue_polcy": "priority"})
    with pytest.raises(ValueError, match="needs waiting_queue_policy='priority'"):
        SchedulerConfig(enable_preemption=True)
    with pytest.raises(ValueError, match="waiting_queue_policy must be one of"):
        SchedulerConfig(waiting_queue_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_rate"):
        SchedulerConfig(priority_aging_rate=-1)
    with pytest.raises(ValueError, match="low_priority_max_num_tokens"):
        SchedulerConfig(waiting_queue_policy="priority", low_priority_max_num_tokens=0)


def test_the_generated_surface_has_the_new_keys_and_refuses_unknown_ones():
    from tensorrt_llm.llmapi.config_fields import from_mapping, walk
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    keys = {spec.path for spec in walk(LlmArgs)}
    for key in ("scheduler_config.waiting_queue_policy", "scheduler_config.enable_preemption",
                "scheduler_config.preemption_cooldown_iterations", "scheduler_config.priority_aging_rate",
                "scheduler_config.priority_low_below", "scheduler_config.priority_high_above",
                "scheduler_config.low_priority_max_num_tokens", "capacity_scheduler_policy"):
        assert key in keys, key
    args = from_mapping(LlmArgs, {"scheduler_config": {"waiting_queue_policy": "priority", "enable_preemption": True}})
    assert args.executor.scheduler_config.enable_preemption
    with pytest.raises(ValueError, match="scheduler_config.nope"):
        from_mapping(LlmArgs, {"scheduler_config": {"nope": 1}})


def test_the_serve_command_line_takes_the_scheduler_keys():
    import argparse

    from tensorrt_llm.llmapi.config_fields import add_arguments, overrides_from_args
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    parser = argparse.ArgumentParser()
    add_arguments(parser, LlmArgs)
    args = parser.parse_args(["--scheduler_config.waiting_queue_policy", "priority",
                              "--scheduler_config.enable_preemption"])
    assert overrides_from_args(args, LlmArgs) == {"scheduler_config": {"waiting_queue_policy": "priority",
                                                                       "enable_preemption": True}}
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduler_config.waiting_queue_policy", "lifo"])


def test_under_fcfs_priorities_are_accepted_ignored_and_said_so_once(caplog):
    executor = make_sim_executor(make_config())
    with caplog.at_level(logging.INFO, logger="tensorrt_llm._torch.pyexecutor.iteration.admission"):
        for i in range(3):
            executor.enqueue_request(make_request(prompt_len=8, priority=0.9, max_new_tokens=2))
        executor.run_until_idle()
    said = [r for r in caplog.records if "accepted and ignored" in r.message]
    assert len(said) == 1


# ---- admission ------------------------------------------------------------------------------


def _scheduler(config: ExecutorConfig, kv):
    return make_scheduler(config, kv, token_budget_policy_for(config))


def test_capacity_admits_by_priority_and_nobody_overtakes_the_first_that_does_not_fit():
    config = make_config(num_blocks=12, max_num_tokens=256, scheduler_config=PRIORITY)
    kv = make_kv_cache_manager(config)
    low = make_request(prompt_len=16, max_new_tokens=4, priority=0.1, arrival_time=1.0)  # 5 blocks
    big = make_request(prompt_len=36, max_new_tokens=4, priority=0.5, arrival_time=2.0)  # 10 blocks
    high = make_request(prompt_len=16, max_new_tokens=4, priority=0.9, arrival_time=3.0)  # 5 blocks
    scheduled = _scheduler(config, kv).schedule_request([low, big, high])
    # high first (5 of 12 blocks); big does not fit what is left, so low, behind it, waits too
    assert scheduled.context_requests == [high]
    fcfs = make_config(num_blocks=12, max_num_tokens=256)
    scheduled = _scheduler(fcfs, make_kv_cache_manager(fcfs)).schedule_request([low, big, high])
    assert scheduled.context_requests == [low]


def test_micro_batch_gives_the_budget_to_contexts_by_priority():
    config = make_config(num_blocks=64, max_num_tokens=16, tokens_per_block=4, scheduler_config=PRIORITY)
    kv = make_kv_cache_manager(config)
    low = make_request(prompt_len=16, priority=0.1, arrival_time=1.0)
    high = make_request(prompt_len=16, priority=0.9, arrival_time=2.0)
    scheduled = _scheduler(config, kv).schedule_request([low, high])
    assert [(c.request, c.size) for c in scheduled.context_chunks] == [(high, 16)]


# ---- the re-check under priority ---------------------------------------------------------------


def test_recheck_cuts_then_defers_the_lowest_priority_first():
    order = PriorityOrder(0.0)
    high = make_request(prompt_len=32, priority=0.9)
    mid = make_request(prompt_len=32, priority=0.5)
    low = make_request(prompt_len=32, priority=0.1)
    chunks = [ContextChunk.of(r, 16) for r in (low, mid, high)]  # scheduler order need not be rank order
    decision = recheck_by_priority([], [], chunks, 40, order.key, reuse_can_shift=False, cut_unit=4, tokens_per_block=4)
    assert decision.chunks[high.request_id].size == 16 and decision.chunks[mid.request_id].size == 16
    assert decision.chunks[low.request_id].size == 8  # cut: the lowest gives way first
    decision = recheck_by_priority([], [], chunks, 34, order.key, reuse_can_shift=False, cut_unit=16, tokens_per_block=4)
    assert [r for r, _ in decision.deferred] == [low]  # not even a unit of 16 fits: deferred
    check_priority_recheck(decision, chunks, [], order.key)


def test_a_request_owing_a_deferral_keeps_its_smallest_step_and_no_higher_one_runs_uncut_past_a_deferral():
    order = PriorityOrder(0.0)
    owing = make_request(prompt_len=32, priority=0.1)
    owing.record_budget_deferral()
    high = make_request(prompt_len=32, priority=0.9)
    mid = make_request(prompt_len=8, priority=0.5)
    chunks = [ContextChunk.of(high, 32), ContextChunk.of(mid, 8), ContextChunk.of(owing, 16)]
    decision = recheck_by_priority([], [], chunks, 36, order.key, reuse_can_shift=False, cut_unit=4, tokens_per_block=4)
    assert decision.chunks[owing.request_id].size == 4  # its reserved unit
    assert decision.chunks[high.request_id].size == 32
    assert [r for r, _ in decision.deferred] == [mid]  # mid's 8 do not fit the 0 left over high and the reserve
    check_priority_recheck(decision, chunks, [], order.key)


@st.composite
def _priority_batches(draw):
    unit = draw(st.sampled_from((1, 4, 8)))
    chunks, later = [], []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, 48))
        request = make_request(prompt_len=prompt, priority=draw(st.sampled_from((0.1, 0.5, 0.9))),
                               arrival_time=float(draw(st.integers(0, 5))))
        if draw(st.booleans()):
            request.record_budget_deferral()
        size = draw(st.integers(1, prompt))
        (later if draw(st.integers(0, 3)) == 0 else chunks).append(ContextChunk.of(request, size))
    # the scheduler charged every request that owes a deferral its full cost: that much fits
    owed = sum(c.cost(reuse_can_shift=True) for c in (*later, *chunks) if c.request.py_budget_deferred)
    budget = draw(st.integers(max(1, owed), owed + 96))
    return unit, later, chunks, budget


@given(_priority_batches(), st.booleans())
def test_recheck_by_priority_keeps_the_budget_and_the_priority_rules(batch, shift):
    unit, later, first, budget = batch
    order = PriorityOrder(0.0)
    decision = recheck_by_priority([], later, first, budget, order.key, reuse_can_shift=shift, cut_unit=unit,
                                   tokens_per_block=unit)
    check_priority_recheck(decision, first, later, order.key, reuse_can_shift=shift)


# ---- preemption --------------------------------------------------------------------------------


def test_choose_victims_takes_strictly_lower_priority_lowest_first_and_respects_the_cooldown():
    order = PriorityOrder(0.0)
    waiter = make_request(prompt_len=4, priority=0.9, arrival_time=5.0)
    equal = make_request(prompt_len=4, priority=0.9, arrival_time=1.0)
    low = make_request(prompt_len=4, priority=0.1, arrival_time=1.0)
    lower = make_request(prompt_len=4, priority=0.0, arrival_time=2.0)
    resumed = make_request(prompt_len=4, priority=0.0, arrival_time=3.0)
    resumed.counters.resumed_iteration = 8
    credit = {r.request_id: 3 for r in (equal, low, lower, resumed)}.get
    pick = lambda shortfall, iteration=10: choose_victims(  # noqa: E731
        waiter, shortfall, [equal, low, lower, resumed], lambda r: credit(r.request_id), order,
        iteration=iteration, cooldown=4)
    assert pick(3) == [lower]  # the lowest first; `resumed` is in its cooldown (resumed 2 iterations ago)
    assert pick(6) == [lower, low]
    assert pick(7) is None  # even both do not cover it: nobody is paused
    assert pick(7, iteration=12) == [resumed, lower, low]  # its cooldown is over; it arrived last of the lowest


def test_llm_generate_takes_one_priority_or_one_per_prompt(one_torch_thread):
    from tensorrt_llm.llmapi import LLM, KvCacheConfig, SamplingParams

    with LLM("tiny-random", dtype="float64", max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=64),
             scheduler_config=SchedulerConfig(waiting_queue_policy="priority")) as llm:
        params = SamplingParams(max_tokens=3)
        plain = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], params)]
        assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], params, priority=[0.9, 0.1])] == plain
        assert llm.generate_async([1, 2, 3], params, priority=1.0).result().outputs[0].token_ids == plain[0]
        with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
            llm.generate([[1, 2, 3], [4, 5, 6]], params, priority=[0.9])
        with pytest.raises(ValueError, match="priority must be a number in"):
            llm.generate([1, 2, 3], params, priority=2)
