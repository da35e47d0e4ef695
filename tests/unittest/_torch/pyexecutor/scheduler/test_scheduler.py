"""Two-stage scheduling: upstream's reuse-discounted charge, generation charges per policy,
FCFS / EQUAL_PROGRESS chunking under max_num_tokens, max_batch_size, and the capacity
policies (GUARANTEED_NO_EVICT reserves to completion; MAX_UTILIZATION pauses)."""

import random

import pytest
from tests.helpers.factories import make_config, make_kv_cache_manager, make_policy, make_request, make_sim_executor, prepare_alone
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler import CapacityScheduler, MicroBatchScheduler, SimpleScheduler
from tensorrt_llm._torch.pyexecutor.budget.policies import make_token_budget_policy, reuse_discounted_charge

POLICIES = ["none", "trim", "fit", "recheck"]


class MicroBatch:
    """A micro-batch scheduler as an executor with the config builds it; every context
    candidate holds no blocks, with the reuse estimate given (default 0)."""

    def __init__(self, **config_overrides) -> None:
        config = make_config(**config_overrides)
        self.scheduler = MicroBatchScheduler(config, make_policy(config))

    def schedule(self, candidates, estimates=None):
        reusable = {r.request_id: 0 for r in candidates if r.is_context_init_state}
        reusable.update(estimates or {})
        return self.scheduler.schedule(candidates, reusable)


def chunk_sizes(scheduled, requests):
    """Each request's scheduled chunk size (0 when it is not in the batch)."""
    sizes = {c.request.request_id: c.size for c in scheduled.context_chunks}
    return [sizes.get(r.request_id, 0) for r in requests]


def generation(request, *, tokens=1):
    """Move ``request`` past its context as the executor would (without KV)."""
    request.complete_context_chunk(request.prompt_len)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    for _ in range(tokens):
        request.add_new_token(7)
    return request


def prefill(kv, request):
    """Allocate and 'compute' ``request``'s whole prompt, leaving it in generation."""
    allocation = prepare_alone(kv, request)
    assert kv.is_allocated(request)
    request.complete_context_chunk(request.prompt_len)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.add_new_token(7)
    kv.commit(allocation.scheduled)


# ---- upstream's reuse-discounted charge (DESIGN.md §1) ------------------------------
@pytest.mark.parametrize(
    "chunk, remaining, reusable, charge",
    [
        (8, 20, 0, 8),  # no reuse expected: the chunk
        (8, 20, -4, 8),
        (8, 20, 4, 8),  # 4 + 8 < 20: a non-last chunk shifts, it does not shrink
        (8, 20, 11, 8),  # 19 < 20: still not the last chunk
        (8, 20, 12, 8),  # 12 + 8 == 20: last chunk, remaining - reusable = 8
        (12, 20, 12, 8),
        (20, 20, 16, 4),
        (5, 20, 16, 4),  # the discount can make a charge smaller than the chunk
        (20, 20, 20, 1),  # fully cached: charged 0, floored to 1
        (20, 20, 28, 1),  # an estimate past the prompt never goes negative
        (0, 20, 0, 1),
        (1, 1, 0, 1),
    ],
)
def test_reuse_discounted_charge(chunk, remaining, reusable, charge):
    assert reuse_discounted_charge(chunk, remaining, reusable) == charge


@pytest.mark.parametrize("policy", POLICIES)
def test_context_charge_uses_the_estimate_only_before_allocation(policy):
    config = make_config(token_budget_policy=policy)
    kv = make_kv_cache_manager(config)
    prompt = make_request(prompt_len=16).input_token_ids
    cached = make_request(prompt)
    prefill(kv, cached)
    kv.free(cached)

    request = make_request(prompt + [3, 4])
    assert kv.match(request).reusable_tokens == 16
    budget = make_policy(config)
    assert budget.context_charge(request, 18, 16) == 2  # every policy discounts at first admission
    assert budget.context_charge(request, 18, None) == 18  # once allocated there is nothing to discount

    request.record_budget_deferral()  # a request deferred earlier owes its full cost under recheck
    assert budget.context_charge(request, 18, 16) == (18 if policy == "recheck" else 2)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "beam_width, drafts, first_draft, max_draft_len",
    [(1, 0, False, 0), (3, 0, False, 0), (1, 2, False, 2), (1, 0, True, 4), (1, 2, True, 4)],
    ids=["plain", "beams", "drafts", "first-draft", "first-draft-with-drafts"],
)
def test_generation_charge(policy, beam_width, drafts, first_draft, max_draft_len):
    budget = make_token_budget_policy(policy, 64, enable_chunked_prefill=True, tokens_per_block=4)
    request = generation(
        make_request(prompt_len=5, beam_width=beam_width, max_draft_len=max_draft_len, is_first_draft=first_draft)
    )
    request.py_draft_tokens = [9] * drafts
    if policy == "recheck":
        assert budget.generation_charge(request) == forward_cost(request)
    else:
        assert budget.generation_charge(request) == beam_width + drafts


def test_upstream_undercharges_a_first_draft_request():
    request = generation(make_request(prompt_len=5, max_draft_len=4, is_first_draft=True))
    upstream = make_token_budget_policy("none", 64, enable_chunked_prefill=True, tokens_per_block=4)
    ours = make_token_budget_policy("recheck", 64, enable_chunked_prefill=True, tokens_per_block=4)
    assert (upstream.generation_charge(request), ours.generation_charge(request)) == (1, 5)


# ---- chunking -----------------------------------------------------------------------
def context_batch(prompt_lens):
    return [make_request(prompt_len=n) for n in prompt_lens]


def test_fcfs_gives_each_request_the_largest_chunk_that_fits():
    scheduler = MicroBatch(max_num_tokens=16)
    r1, r2, r3 = context_batch([10, 30, 2])
    scheduled = scheduler.schedule([r1, r2, r3])
    assert scheduled.context_requests == [r1, r2, r3]
    assert chunk_sizes(scheduled, (r1, r2, r3)) == [10, 4, 2]  # 4 = the largest unit multiple <= 6
    assert scheduled.scheduled_tokens == 16


def test_fcfs_never_lets_a_later_request_overtake_one_that_did_not_fit():
    scheduler = MicroBatch(max_num_tokens=16)
    r1, r2, r3 = context_batch([13, 30, 2])
    scheduled = scheduler.schedule([r1, r2, r3])
    # 3 tokens are left: not a whole unit for r2, and r3 (2 tokens) must wait behind it.
    assert scheduled.context_requests == [r1]


def test_scheduling_writes_nothing_on_the_requests():
    scheduler = MicroBatch(max_num_tokens=16, context_chunking_policy="EQUAL_PROGRESS")
    batch = context_batch([30, 30, 30])
    before = [repr(r) for r in batch]
    scheduler.schedule(batch)
    assert [repr(r) for r in batch] == before


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    scheduler = MicroBatch(max_num_tokens=16, enable_chunked_prefill=False)
    r1, r2, r3 = context_batch([10, 10, 3])
    scheduled = scheduler.schedule([r1, r2, r3])
    assert scheduled.context_requests == [r1]
    assert chunk_sizes(scheduled, [r1]) == [10]


def test_equal_progress_grows_every_request_one_unit_at_a_time():
    scheduler = MicroBatch(max_num_tokens=16, context_chunking_policy="EQUAL_PROGRESS")
    batch = context_batch([30, 30, 30])
    scheduled = scheduler.schedule(batch)
    assert chunk_sizes(scheduled, batch) == [8, 4, 4]
    assert scheduled.scheduled_tokens == 16


def test_equal_progress_finishes_short_prompts_with_a_partial_unit():
    scheduler = MicroBatch(max_num_tokens=16, context_chunking_policy="EQUAL_PROGRESS")
    batch = context_batch([6, 30])
    assert chunk_sizes(scheduler.schedule(batch), batch) == [6, 8]


def test_equal_progress_takes_the_rest_of_a_prompt_the_discount_covers():
    scheduler = MicroBatch(max_num_tokens=16, context_chunking_policy="EQUAL_PROGRESS")
    covered, other = context_batch([40, 40])
    # only the last 4 tokens are charged
    scheduled = scheduler.schedule([covered, other], {covered.request_id: 36})
    assert chunk_sizes(scheduled, [covered, other]) == [40, 12]
    assert scheduled.charges[covered.request_id] == 4


@pytest.mark.parametrize("chunking", ["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"])
@pytest.mark.parametrize("policy, seed", [("none", 11), ("recheck", 12)])
def test_chunks_are_units_except_the_last_and_charges_fit_the_budget(chunking, policy, seed):
    rng = random.Random(seed)
    for _ in range(150):
        max_num_tokens = rng.choice([8, 16, 24, 33, 64])
        unit = rng.choice([4, 8])
        if unit > max_num_tokens:
            continue
        scheduler = MicroBatch(
            max_num_tokens=max_num_tokens,
            chunk_unit_size=unit,
            context_chunking_policy=chunking,
            token_budget_policy=policy,
        )
        batch = context_batch([rng.randrange(1, 80) for _ in range(rng.randrange(1, 6))])
        estimates = {}
        for request in batch:
            if rng.random() < 0.3:
                estimates[request.request_id] = rng.randrange(0, request.prompt_len + 1) // 4 * 4
        scheduled = scheduler.schedule(batch, estimates)
        assert scheduled.scheduled_tokens <= max_num_tokens, scheduled
        for chunk in scheduled.context_chunks:
            assert chunk.size > 0
            assert chunk.size % unit == 0 or chunk.is_last, (chunk, unit)
        if chunking == "FIRST_COME_FIRST_SERVED":
            # The scheduled requests are a prefix of the candidates: nobody overtakes.
            assert scheduled.context_requests == batch[: len(scheduled.context_requests)]


def test_generation_requests_are_charged_first():
    scheduler = MicroBatch(max_num_tokens=16)
    context = make_request(prompt_len=40)
    gens = [generation(make_request(prompt_len=5, beam_width=2)) for _ in range(3)]
    scheduled = scheduler.schedule([context, *gens])
    assert scheduled.generation_requests == gens
    assert chunk_sizes(scheduled, [context]) == [8]  # 16 - 3 * 2 = 10, floored to the unit


# ---- max_batch_size -----------------------------------------------------------------
def test_max_batch_size_limits_requests_not_tokens():
    scheduler = MicroBatch(max_num_tokens=64, max_batch_size=2)
    batch = context_batch([4, 4, 4])
    scheduled = scheduler.schedule(batch)
    assert scheduled.context_requests == batch[:2]
    assert scheduled.batch_size == 2

    gens = [generation(make_request(prompt_len=3)) for _ in range(3)]
    scheduled = scheduler.schedule(gens)
    assert scheduled.generation_requests == gens[:2]


def test_max_batch_size_counts_generation_and_context_together():
    scheduler = MicroBatch(max_num_tokens=64, max_batch_size=2)
    gen = generation(make_request(prompt_len=3))
    first, second = context_batch([4, 4])
    scheduled = scheduler.schedule([gen, first, second])
    assert scheduled.all_requests == [first, gen]  # context requests are listed first
    assert scheduled.batch_size == 2


# ---- capacity -----------------------------------------------------------------------
def capacity(policy, num_blocks):
    kv = make_kv_cache_manager(num_blocks=num_blocks, max_num_tokens=256)
    return CapacityScheduler(CapacitySchedulerPolicy(policy), kv), kv


def test_guaranteed_no_evict_reserves_to_completion_and_admits_in_order():
    scheduler, kv = capacity("GUARANTEED_NO_EVICT", num_blocks=10)
    r1 = make_request(prompt_len=12, max_new_tokens=8)  # 5 blocks to completion
    r2 = make_request(prompt_len=16, max_new_tokens=8)  # 6 blocks
    r3 = make_request(prompt_len=2, max_new_tokens=2)  # 1 block, but behind r2
    decision = scheduler.schedule([r1, r2, r3])
    assert decision.fitting == [r1] and decision.paused == []

    prefill(kv, r1)  # holds its 3 prompt blocks now, reserves 2 more to completion
    assert kv.sequences.num_held_blocks(r1) == 3 and kv.sequences.blocks_reserved_to_completion([r1]) == 2
    fits = make_request(prompt_len=16, max_new_tokens=4)  # 5 blocks: 3 held + 2 reserved + 5 = 10
    too_big = make_request(prompt_len=16, max_new_tokens=5)  # 6 blocks
    assert scheduler.schedule([r1, fits]).fitting == [r1, fits]
    assert scheduler.schedule([r1, too_big]).fitting == [r1]


def test_guaranteed_no_evict_credits_only_blocks_started_requests_hold():
    scheduler, kv = capacity("GUARANTEED_NO_EVICT", num_blocks=10)
    prompt = make_request(prompt_len=16).input_token_ids
    cached = make_request(prompt)
    prefill(kv, cached)
    kv.free(cached)  # 4 cached, unreferenced blocks
    reuser = make_request(prompt + [1, 2, 3, 4], max_new_tokens=4)  # 6 blocks to completion
    other = make_request(prompt_len=4, max_new_tokens=12)  # 4 blocks
    # Claiming a cached block takes it out of the pool like a fresh one: no credit, 6 + 4 = 10 fits.
    assert scheduler.schedule([reuser, other]).fitting == [reuser, other]
    bigger = make_request(prompt_len=4, max_new_tokens=13)  # 5 blocks: 11 > 10
    decision = scheduler.schedule([reuser, bigger])
    assert decision.fitting == [reuser]
    assert decision.estimated_reusable == {reuser.request_id: 16}  # the micro-batch discount still sees it

    running = make_request(prompt + [9], max_new_tokens=4)
    prefill(kv, running)  # holds the 4 cached blocks + 1 fresh, 1 more to completion: 5 available
    assert kv.match(reuser).shared_blocks == 4
    assert kv.match(make_request(prompt)).shared_blocks == 3  # a claim stops at prompt_len - 1
    # The reuser shares the 4 held blocks for free: 1 + (6 - 4) <= 5; without the credit 6 would not fit.
    assert scheduler.schedule([running, reuser]).fitting == [running, reuser]


@pytest.mark.parametrize("capacity_policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
@pytest.mark.parametrize("policy", ["none", "recheck"])
def test_reusing_a_cached_prefix_never_deadlocks_the_pool(capacity_policy, policy):
    # Crediting the cached prefix as free used to admit both requests into 8 blocks that
    # they need 7 + 4 of; under GUARANTEED_NO_EVICT both then waited for a block forever.
    executor = make_sim_executor(
        make_config(
            num_blocks=8, max_num_tokens=32, token_budget_policy=policy, capacity_scheduler_policy=capacity_policy
        )
    )
    checker = ExecutorChecker(executor)
    prefix = make_request(prompt_len=16, max_new_tokens=2)
    checker.submit(prefix)
    checker.drain()
    reuser = make_request(prefix.input_token_ids + [1, 2, 3, 4], max_new_tokens=8)
    other = make_request(prompt_len=8, max_new_tokens=8)
    checker.submit(reuser)
    checker.submit(other)
    checker.drain(max_steps=200)
    assert reuser.num_generated_tokens == other.num_generated_tokens == 8
    assert reuser.error is None and other.error is None


def run_two_long_generations(policy, num_blocks):
    """Two requests whose generations outgrow a small pool; returns them and the executor."""
    executor = make_sim_executor(
        make_config(num_blocks=num_blocks, capacity_scheduler_policy=policy, max_num_tokens=32)
    )
    checker = ExecutorChecker(executor)
    first = make_request(prompt_len=8, max_new_tokens=16, request_id=1)
    second = make_request(prompt_len=8, max_new_tokens=16, request_id=2)
    checker.submit(first)
    checker.step()  # first starts before second
    checker.submit(second)
    return checker, first, second


def test_max_utilization_pauses_the_most_recently_started_request():
    checker, first, second = run_two_long_generations("MAX_UTILIZATION", num_blocks=8)
    paused_with = None
    while checker.executor.has_work:
        before = second.tokens.tolist()
        checker.step()
        if second.counters.pauses and paused_with is None:
            paused_with = before
            # Restarted as context, generated tokens kept as prompt to recompute.
            assert second.state is LlmRequestState.CONTEXT_INIT
            assert second.tokens.tolist() == before and second.prompt_len == len(before) > 8
            assert not checker.executor.kv_cache_manager.is_allocated(second)
    checker.check_drained()

    assert paused_with is not None, "the pool was expected to run out"
    assert first.counters.pauses == 0
    assert sum(s.num_paused_requests for s in checker.executor.iteration_stats) == second.counters.pauses
    for request in (first, second):
        assert request.state is LlmRequestState.GENERATION_COMPLETE and request.error is None
        assert request.num_generated_tokens == 16
    assert second.tokens[: len(paused_with)].tolist() == paused_with  # the output continued where it stopped

    # Same tokens as a run that never pauses.
    alone, first_alone, second_alone = run_two_long_generations("MAX_UTILIZATION", num_blocks=64)
    alone.drain()
    assert second_alone.counters.pauses == 0
    assert second.output_token_ids == second_alone.output_token_ids
    assert first.output_token_ids == first_alone.output_token_ids


def test_guaranteed_no_evict_never_pauses_it_waits():
    checker, first, second = run_two_long_generations("GUARANTEED_NO_EVICT", num_blocks=8)
    checker.drain()
    assert first.counters.pauses == second.counters.pauses == 0
    assert all(s.num_paused_requests == 0 for s in checker.executor.iteration_stats)
    assert second.first_token_time >= first.finish_time  # it only started once the first finished


@pytest.mark.parametrize("chunking", ["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"])
@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_lazy_admission_schedules_the_eager_batch_and_walks_only_what_it_reads(policy, chunking):
    """SimpleScheduler admits waiting requests as the micro-batch stage reads them: the batch
    is the one the eager capacity decision gives, and with FCFS the requests behind the first
    one the budget cannot take are never looked up in the prefix tree."""
    config = make_config(
        max_num_tokens=24, max_batch_size=8, capacity_scheduler_policy=policy, context_chunking_policy=chunking
    )
    kv = make_kv_cache_manager(config)
    started = make_request(prompt_len=10, max_new_tokens=8)
    prefill(kv, started)
    waiting = [make_request(prompt_len=20 + i, max_new_tokens=4, seed=i) for i in range(6)]
    active = [started, *waiting]
    capacity = CapacityScheduler(config.capacity_scheduler_policy, kv)
    micro = MicroBatchScheduler(config, make_policy(config))
    eager = capacity.schedule(active)
    assert len(eager.fitting) == 1 + len(waiting)  # all fit in KV memory; the budget takes fewer
    expected = micro.schedule(eager.fitting, eager.estimated_reusable)

    looked_up = []
    match = kv.match
    kv.match = lambda request: looked_up.append(request) or match(request)
    scheduled = SimpleScheduler(capacity, micro).schedule_request(active)
    assert [(c.request, c.start, c.size) for c in scheduled.context_chunks] == [
        (c.request, c.start, c.size) for c in expected.context_chunks
    ]
    assert scheduled.generation_requests == expected.generation_requests == [started]
    assert scheduled.charges == expected.charges and scheduled.estimated_reusable == expected.estimated_reusable
    if chunking == "FIRST_COME_FIRST_SERVED":
        assert len(expected.context_chunks) < len(waiting)
        assert looked_up == waiting[: len(expected.context_chunks) + 1]  # the chunks, then the one that did not fit
    else:
        assert looked_up == waiting
