"""Attention data parallelism on 2 and 4 gloo ranks: each rank its own requests, KV cache and budget.

Required, for hypothesis-generated traffic:

* nothing is lost: rank 0's submitter gets a final response for every request, and every
  request ran on exactly one rank (no rank ran it twice, none dropped it);
* every rank stays within its own ``max_num_tokens`` on every iteration (for the policies
  that promise it; checked on the ranks after each step) and its KV pool stays consistent;
* the assignment of new requests agreed on every rank, every iteration (the digest check);
* the ranks stepped together: all ran the same number of iterations;
* greedy float64 outputs of the real model equal the single rank's (each rank holds a full
  replica; only the batches differ).
"""

import pytest
from hypothesis import given, settings
from tests.helpers.rank_jobs import JOB_TIMEOUT_S, run_reference, run_scenario
from tests.helpers.scenarios import POLICIES, forced_scenario, scenarios
from tests.helpers.strategies import examples

from tensorrt_llm._torch.distributed.attention_dp import RankLoad, assign_requests
from tensorrt_llm._torch.distributed.request_spec import RequestSpec

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]


def check_attention_dp(group, scenario):
    reference = run_reference(scenario)
    ranks = group.run_ok(run_scenario, scenario, True, timeout_s=JOB_TIMEOUT_S)
    submitted = {a.request_id for a in scenario.arrivals}
    assert set(ranks[0].final) == submitted, f"lost: {sorted(submitted - set(ranks[0].final))}"
    owner: dict[int, int] = {}
    for rank, outcome in enumerate(ranks):
        for request_id in outcome.local:
            assert request_id not in owner, f"request {request_id} ran on ranks {owner[request_id]} and {rank}"
            owner[request_id] = rank
    assert set(owner) == submitted
    assert ranks[0].outputs == {rid: ranks[owner[rid]].local[rid] for rid in submitted}, "forwarded responses differ"
    assert len({outcome.iterations for outcome in ranks}) == 1, "the ranks did not step together"
    budget = scenario.config.max_num_tokens
    if scenario.config.token_budget_policy.value in ("recheck", "claim"):
        assert all(outcome.max_forward_tokens <= budget and not outcome.overshoots for outcome in ranks)
    # Requests that ended normally on both sides produced the same tokens (a cancellation
    # or an overshooting batch lands at another point of another batch under attention DP).
    for request_id, (tokens, end) in reference.outputs.items():
        if end is None and ranks[0].final[request_id] is None:
            assert ranks[0].outputs[request_id][0] == tokens, f"request {request_id} on rank {owner[request_id]}"
    return ranks


@pytest.mark.parametrize("policy", POLICIES)
def test_forced_scenario_on_two_ranks(rank_group, policy):
    ranks = check_attention_dp(rank_group(2), forced_scenario(policy, host_blocks=6))
    assert all(outcome.local for outcome in ranks), "the balancer left a rank without requests"


@settings(max_examples=examples(0.1, 12))
@given(scenario=scenarios(max_requests=10))
def test_two_ranks_real_model(rank_group, scenario):
    check_attention_dp(rank_group(2), scenario)


@settings(max_examples=examples(0.03, 4))
@given(scenario=scenarios(model=None, max_requests=12))
def test_four_ranks_simulated_engine(rank_group, scenario):
    check_attention_dp(rank_group(4), scenario)


# ---- the balancer (a pure function every rank computes alike) -----------------------------
def _spec(request_id: int, prompt_len: int) -> RequestSpec:
    return RequestSpec(request_id, tuple(range(1, prompt_len + 1)), 1)


def test_a_burst_on_idle_ranks_is_spread_round_robin():
    loads = [RankLoad(0, 100)] * 4
    assert assign_requests([_spec(i, 8) for i in range(6)], loads, 4) == [0, 1, 2, 3, 0, 1]


def test_fewest_active_requests_first_then_most_free_blocks_then_lowest_rank():
    loads = [RankLoad(3, 50), RankLoad(1, 10), RankLoad(1, 40), RankLoad(2, 90)]
    # rank 2 (1 active, more free), then rank 1 (1 active), then 2 and 1 tie on 2 active with
    # rank 3: rank 3 has the most free blocks
    assert assign_requests([_spec(i, 16) for i in range(4)], loads, 4) == [2, 1, 3, 2]


def test_the_assignment_depends_only_on_its_inputs():
    specs = [_spec(i, 5 + i) for i in range(9)]
    loads = [RankLoad(2, 7), RankLoad(0, 3), RankLoad(5, 30)]
    assert assign_requests(specs, loads, 4) == assign_requests(list(specs), list(loads), 4)
