"""The multi-rank replay (``benchmarks.replay_ranks``) on the session's live rank groups.

A short slice of the default scenario, replayed under tensor parallelism and attention DP
on 2 ranks with the decision check on: every request completes, the per-rank numbers add
up to the group's, no rank's forward exceeds its budget, the TP ranks agree on everything
and the attention-DP ranks both get work; the §5 keys are present for the group and for
every rank.
"""

import pytest
from rank_jobs import JOB_TIMEOUT_S

from benchmarks.replay import ReplaySettings, TraceSpec
from benchmarks.replay_ranks import (
    RankLayout,
    RanksJob,
    RanksResult,
    build_ranks_parser,
    replay_on_rank,
    schema_errors,
    summarize,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

SPEC = TraceSpec(num_requests=24, time_scale=0.3)
SETTINGS = ReplaySettings(max_num_tokens=2048, kv_blocks=640, host_cache_blocks=128)


@pytest.mark.parametrize("attention_dp", [False, True], ids=["tensor parallel", "attention DP"])
def test_replay_on_two_ranks(rank_group, attention_dp):
    layout = RankLayout(2, attention_dp)
    job = RanksJob(SPEC, SETTINGS, ("recheck",), layout, check_decisions=True)
    per_rank = rank_group(2).run_ok(replay_on_rank, job, timeout_s=JOB_TIMEOUT_S)
    runs = [runs["recheck"] for runs in per_rank]
    group = summarize(runs, layout, SETTINGS.max_num_tokens, SPEC.num_requests, 0.0)
    assert group["completed"] == SPEC.num_requests and group["errored"] == 0 and group["unserved"] == 0
    assert group["overshoots"] == 0 and group["max_forward_tokens"] <= SETTINGS.max_num_tokens
    assert all(rank["max_forward_tokens"] <= SETTINGS.max_num_tokens for rank in group["ranks"])
    assert not schema_errors(RanksResult({}, {"recheck": group}))
    costs = group["decision_check_us_per_iteration"]
    if attention_dp:
        assert sum(group["balance"]["requests"]) == SPEC.num_requests and min(group["balance"]["requests"]) > 0
        assert group["ttft_ms"]["n"] == sum(rank["ttft_ms"]["n"] for rank in group["ranks"])
    else:
        assert group["ranks_agree"] and group["balance"]["requests"] == [SPEC.num_requests] * 2
        assert all(cost["iterations"] > 0 for cost in costs)  # the digest was compared every iteration


def test_the_cli_takes_exactly_one_layout():
    parser = build_ranks_parser()
    args = parser.parse_args(["--attention-dp", "4", "--num-requests", "10"])
    assert args.attention_dp == 4 and args.tp_size is None and args.policies == ["recheck"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-dp", "2", "--tp-size", "2"])
    with pytest.raises(SystemExit):
        parser.parse_args([])
