"""Tensor parallelism on 2 and 4 gloo ranks against one rank, in float64.

Every case runs on a live rank group (spawned once per session) and on one ordinary
executor in this process, with the same requests at the same iterations. Required:

* outputs equal: every request's tokens and how it ended (length, error, cancellation);
* every rank decided what the single rank decided, iteration by iteration (the decision
  digests of all ranks equal the reference's), and the in-band digest check agreed;
* every rank sampled the same tokens (each rank's own record of its requests);
* a planted nondeterminism on one rank is caught in the iteration it is planted, on every
  rank, with an error that names that iteration and a request of the batch.

The tiny model has 4 query heads and 2 KV heads: on 4 ranks each KV head is replicated on
two ranks.
"""

import re

import pytest
import torch
from hypothesis import example, given, settings
from tests.helpers.rank_jobs import (
    JOB_TIMEOUT_S,
    CorruptNewestToken,
    ReverseActiveRequests,
    ShrinkRecheckBudget,
    run_reference,
    run_scenario,
    tp_logits,
)
from tests.helpers.scenarios import POLICIES, TINY64, forced_scenario, prompt, scenarios
from tests.helpers.strategies import examples

from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]


def check_equal_to_single_rank(group, scenario):
    reference = run_reference(scenario)
    ranks = group.run_ok(run_scenario, scenario, timeout_s=JOB_TIMEOUT_S)
    assert ranks[0].outputs == reference.outputs, "rank 0's responses differ from the single rank's"
    for rank, outcome in enumerate(ranks):
        assert outcome.decision_digests == reference.decision_digests, (
            f"rank {rank} decided differently from the single rank (first at iteration "
            f"{next(i for i, (a, b) in enumerate(zip(outcome.decision_digests, reference.decision_digests)) if a != b)})"
            if len(outcome.decision_digests) == len(reference.decision_digests)
            else f"rank {rank} ran {len(outcome.decision_digests)} batches, the single rank {len(reference.decision_digests)}"
        )
        assert outcome.local == reference.outputs, f"rank {rank} sampled differently"
    return reference, ranks


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_with_reuse_chunking_and_deferrals_forced(rank_group, policy):
    scenario = forced_scenario(policy, host_blocks=6)
    reference, _ = check_equal_to_single_rank(rank_group(2), scenario)
    assert reference.reused_tokens > 0, "the scenario must reuse blocks"
    budget = scenario.config.max_num_tokens
    assert any(len(a.prompt) > budget and reference.final[a.request_id] is None for a in scenario.arrivals), (
        "a prompt longer than the budget must have run in chunks"
    )
    if policy in ("recheck", "claim", "trim"):
        assert reference.deferrals > 0, "the guard must defer requests in this scenario"
    if policy in ("none", "fit"):  # the overshooting batch fails on every rank alike; the group goes on
        assert reference.overshoots > 0, "upstream's discount must overshoot in this scenario"


@settings(max_examples=examples(0.1, 12))
@given(scenario=scenarios(max_requests=6))
def test_two_ranks_equal_one_rank(rank_group, scenario):
    check_equal_to_single_rank(rank_group(2), scenario)


@settings(max_examples=examples(0.02, 3))
@given(scenario=scenarios(max_requests=4, max_arrival=3))
@example(scenario=forced_scenario("recheck"))
def test_four_ranks_replicated_kv_heads_equal_one_rank(rank_group, scenario):
    check_equal_to_single_rank(rank_group(4), scenario)


def test_sharded_logits_match_one_rank_and_agree_bitwise_across_ranks(rank_group):
    tokens = prompt(0, 40, 1, 9)
    with torch.inference_mode():
        single = LlamaForCausalLM(TINY64).forward_full(torch.tensor(tokens))
    for world_size in (2, 4):
        ranks = rank_group(world_size).run_ok(tp_logits, TINY64, tokens, timeout_s=JOB_TIMEOUT_S)
        assert all(torch.equal(logits, ranks[0]) for logits in ranks), "ranks hold different logits"
        assert torch.equal(ranks[0].argmax(-1), single.argmax(-1))
        # the all-reduce adds the ranks' partial sums in another order than one matmul does
        assert torch.allclose(ranks[0], single, rtol=0, atol=1e-12), (ranks[0] - single).abs().max()


# ---- the digest check catches a planted nondeterminism within one iteration -------------
def _first_iteration(reference, predicate) -> int:
    return next(i for i, active in enumerate(reference.active_before_step) if predicate(active))


PLANTS = {
    "set order": (ReverseActiveRequests, lambda active: sum(ctx for _, ctx in active) >= 2),
    "rank-local budget": (ShrinkRecheckBudget, lambda active: len(active) >= 2),
    "sampled token": (CorruptNewestToken, lambda active: any(not ctx for _, ctx in active)),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_nondeterminism_is_caught_in_its_iteration(rank_group, plant):
    scenario = forced_scenario("recheck")
    reference = run_reference(scenario)
    hook, where = PLANTS[plant]
    at = _first_iteration(reference, where)
    active_ids = {rid for rid, _ in reference.active_before_step[at]}
    results = rank_group(2).run(run_scenario, scenario, False, True, hook(at), 1, timeout_s=JOB_TIMEOUT_S)
    for result in results:
        assert result.error_type == "RankDivergenceError", (result.rank, result.error_type, result.error)
        match = re.match(r"ranks diverged at iteration (\d+) \(first differing request (\d+)\)", result.error)
        assert match, result.error
        assert int(match[1]) == at, f"planted at iteration {at}, caught at {match[1]}: {result.error}"
        assert int(match[2]) in active_ids, result.error
    assert results[0].error == results[1].error, "the ranks disagree about the divergence"
