"""``benchmarks.replay.diff``: wall time is ignored, every other metric is compared."""

from __future__ import annotations

import json

from benchmarks.replay.diff import differences, main


def _replay(**recheck) -> dict:
    metrics = {"deferrals": 13, "ttft_ms": {"p50": 767.0, "p99": 6346.0, "n": 700}, "wall_s": 0.7,
               "budget_utilization_before_crash": 0.054}
    metrics.update(recheck)
    return {"config": {}, "results": {"recheck": metrics, "fit": {"deferrals": 0, "wall_s": 0.7}}}


def test_only_wall_time_differs():
    assert differences(_replay(), _replay(wall_s=9.9)) == []


def test_a_decision_that_changed_is_named():
    assert differences(_replay(), _replay(deferrals=14)) == ["recheck deferrals: 13 != 14"]


def test_policies_in_one_file_only_are_named_and_cross_policy_figures_skipped():
    after = _replay(budget_utilization_before_crash=0.9)
    del after["results"]["fit"]
    assert differences(_replay(), after) == ["fit: only in before"]


def test_a_metric_only_a_newer_replay_reports_is_named_and_skipped(tmp_path):
    assert differences(_replay(), _replay(errors={})) == ["recheck errors: only in after"]
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(_replay()))
    after.write_text(json.dumps(_replay(errors={})))
    assert main([str(before), str(after)]) == 0


def test_exit_status(tmp_path):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(_replay()))
    after.write_text(json.dumps(_replay(wall_s=2.0)))
    assert main([str(before), str(after)]) == 0
    after.write_text(json.dumps(_replay(ttft_ms={"p50": 767.0, "p99": 6347.0, "n": 700})))
    assert main([str(before), str(after)]) == 1
