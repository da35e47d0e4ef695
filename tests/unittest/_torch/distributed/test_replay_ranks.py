"""The multi-rank replay (``benchmarks.replay --tp-size/--attention-dp``) on the session's live rank groups.

A short slice of the default scenario, replayed under tensor parallelism and attention DP
on 2 ranks with the decision check on: every request completes, the per-rank numbers add
up to the group's, no rank's forward exceeds its budget, the TP ranks agree on everything
and the attention-DP ranks both get work; the §5 keys are present for the group and for
every rank.
"""

import pytest
from tests.helpers.rank_jobs import JOB_TIMEOUT_S

from benchmarks.replay import ReplaySettings, TraceSpec, build_parser, rank_layout, replay_trace
from benchmarks.replay.ranks import RankLayout, RanksJob, RanksResult, replay_on_rank, schema_errors, summarize
from tests.helpers.replay_cases import EVICTED_SETTINGS, evicted_discount_trace

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

SPEC = TraceSpec(num_requests=24, time_scale=0.3)
SETTINGS = ReplaySettings.from_options(max_num_tokens=2048, kv_cache_config={"num_blocks": 640}, host_cache_blocks=128)


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tensor parallel", "attention DP"])
def test_replay_on_two_ranks(rank_group, attention_dp):
    layout = RankLayout(2, attention_dp)
    job = RanksJob(SPEC.load(SETTINGS), SETTINGS, ("recheck",), layout, check_decisions=True)
    per_rank = rank_group(2).run_ok(replay_on_rank, job, timeout_s=JOB_TIMEOUT_S)
    runs = [runs["recheck"] for runs in per_rank]
    group = summarize(runs, layout, SETTINGS.executor.max_num_tokens, SPEC.num_requests, 0.0)
    assert group["completed"] == SPEC.num_requests and group["errored"] == 0 and group["unserved"] == 0
    assert group["overshoots"] == 0 and group["max_forward_tokens"] <= SETTINGS.executor.max_num_tokens
    assert all(rank["max_forward_tokens"] <= SETTINGS.executor.max_num_tokens for rank in group["ranks"])
    assert not schema_errors(RanksResult(layout, {"recheck": group}))
    assert [rank["rank"] for rank in group["ranks"]] == [0, 1]
    assert sum(rank["requests"] for rank in group["ranks"]) == SPEC.num_requests * (1 if attention_dp else 2)
    costs = group["decision_check_us_per_iteration"]
    if attention_dp:
        assert sum(group["balance"]["requests"]) == SPEC.num_requests and min(group["balance"]["requests"]) > 0
        assert group["ttft_ms"]["n"] == sum(rank["ttft_ms"]["n"] for rank in group["ranks"])
    else:
        assert group["ranks_agree"] and group["balance"]["requests"] == [SPEC.num_requests] * 2
        assert all(cost["iterations"] > 0 for cost in costs)  # the digest was compared every iteration


# The single-rank replay's evicted-discount case: a follow-up charged for 2 tokens whose
# cached prefix the chunk before it evicts: 74 > 48 positions.
EVICTED = evicted_discount_trace()


def test_none_stops_every_tensor_parallel_rank_at_its_first_overshoot(rank_group):
    """As the single-rank replay does: ``crashed`` with the budget check's message, the rest unserved."""
    layout = RankLayout(2, attention_dp=False)
    job = RanksJob(EVICTED, EVICTED_SETTINGS, ("none", "recheck"), layout)
    per_rank = rank_group(2).run_ok(replay_on_rank, job, timeout_s=JOB_TIMEOUT_S)
    n = len(EVICTED)
    none = summarize([runs["none"] for runs in per_rank], layout, 48, n, 0.0)
    single = replay_trace(EVICTED, EVICTED_SETTINGS, ("none",), progress=False).runs["none"].metrics
    assert none["crashed"] and none["overshoots"] == 1 and none["unserved"] == single["unserved"] > 0
    assert none["crash"]["message"] == single["crash"]["message"]
    assert none["crash"]["iteration"] == single["crash"]["iteration"]
    assert all(rank["crashed"] and rank["group_iterations"] == none["group_iterations"] for rank in none["ranks"])
    recheck = summarize([runs["recheck"] for runs in per_rank], layout, 48, n, 0.0)
    assert not recheck["crashed"] and recheck["completed"] == n and recheck["max_forward_tokens"] <= 48


def test_the_replay_cli_takes_at_most_one_layout():
    parser = build_parser()
    args = parser.parse_args(["--attention-dp", "4", "--num-requests", "10"])
    assert rank_layout(args) == RankLayout(4, attention_dp=True)
    assert rank_layout(parser.parse_args(["--tp-size", "2"])) == RankLayout(2, attention_dp=False)
    assert rank_layout(parser.parse_args([])) is None  # the single-rank replay
    for bad in (["--attention-dp", "2", "--tp-size", "2"], ["--tp-size", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
