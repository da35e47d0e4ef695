"""The replay benchmark: §5 JSON contract, determinism, upstream's crash under ``none``, the CLI, both engines.

The crash tests use tiny hand-made traces built so that one docs/design.md §1 mechanism fires at
a known iteration; the numbers in their comments are the executor's arithmetic.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
import torch

from benchmarks.replay import report
from benchmarks.replay import (
    KNOWN_POLICIES,
    POLICIES,
    ReplaySettings,
    TraceSpec,
    build_parser,
    main,
    parse_args,
    replay_policy,
    replay_trace,
    settings_from_args,
)
from benchmarks.replay.traces import SyntheticRequest, Trace, segment_key
from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tests.helpers.replay_cases import EVICTED_SETTINGS, evicted_discount_trace
from tests.helpers.replay_cases import request as _request


def whole_prompt_hit_trace() -> Trace:
    """An exact repeat of a block-aligned prompt, charged 1 token, recomputes its last block.

    tokens_per_block=4, partial reuse off, max_num_tokens=64. ``long`` decodes (1 position);
    at t=0.3 ``chunked`` (200 tokens) gets the largest whole-block chunk of the 63 tokens
    left, 60, and the repeat, estimated fully cached, is charged 1 of the last 3. Its claim
    stops at prompt_len - 1, i.e. 28 tokens, so it runs 4: 1 + 60 + 4 = 65 > 64.
    """
    return Trace("whole-prompt-hit", "scenario", (
        _request(0, 0.0, 2, ("system", 32)),
        _request(1, 0.05, 400, ("long", 8)),
        _request(2, 0.3, 2, ("chunked", 200)),
        _request(3, 0.3, 2, ("system", 32)),
    ))


WHOLE_SETTINGS = ReplaySettings.from_options(
    max_num_tokens=64, kv_cache_config={"tokens_per_block": 4, "num_blocks": 200, "enable_partial_reuse": False},
    host_cache_blocks=0,
)


@lru_cache(maxsize=None)
def _replay(trace_name: str, policies: tuple[str, ...] = POLICIES):
    trace, settings = {
        "evicted": (evicted_discount_trace(), EVICTED_SETTINGS),
        "whole": (whole_prompt_hit_trace(), WHOLE_SETTINGS),
    }[trace_name]
    return replay_trace(trace, settings, policies, progress=False)


def _check_schema(document: dict) -> None:
    assert report.schema_errors(document) == []
    assert set(document) >= {"config", "results"}
    for policy, result in document["results"].items():
        assert policy in KNOWN_POLICIES
        for key in ("requests", "completed", "errored", "overshoots", "max_forward_tokens", "deferrals",
                    "max_consecutive_deferrals", "iterations"):
            assert type(result[key]) is int, key
        assert type(result["crashed"]) is bool
        for key in ("budget_utilization", "budget_utilization_when_bound", "output_tokens_per_s", "wall_s"):
            assert type(result[key]) is float, key
        assert 0.0 <= result["budget_utilization_when_bound"] <= 1.0
        for key in ("ttft_ms", "tpot_ms"):
            assert type(result[key]["p50"]) is float and type(result[key]["p99"]) is float
        if result["crashed"]:
            assert type(result["crash"]["iteration"]) is int and type(result["crash"]["message"]) is str
        else:
            assert result["crash"] is None
        assert set(result["overshoot_mechanisms"]) == {"whole_prompt_hit", "evicted_discount", "other"}


def test_json_follows_the_section_5_contract(tmp_path):
    result = _replay("evicted")
    path = tmp_path / "replay.json"
    report.write_json(result, path)
    document = json.loads(path.read_text())  # strict JSON: no NaN
    _check_schema(document)
    config = document["config"]
    assert config["trace"]["name"] == "evicted-discount" and config["trace"]["format"] == "scenario"
    assert config["engine"]["engine"] == "sim" and "cost_model" in config["engine"]
    assert config["executor"]["max_num_tokens"] == 48
    assert config["kv_cache"]["num_blocks"] == 20 and config["kv_cache"]["host_cache_size"] == 0


def test_schema_check_rejects_a_wrong_type():
    document = _replay("evicted").to_json()
    broken = json.loads(json.dumps(document))
    broken["results"]["recheck"]["completed"] = 3.0
    del broken["results"]["fit"]["wall_s"]
    errors = report.schema_errors(broken)
    assert any("completed" in e for e in errors) and any("wall_s" in e for e in errors)


def test_none_crashes_on_evicted_discount_and_recheck_completes_everything():
    results = _replay("evicted").to_json()["results"]
    none, recheck = results["none"], results["recheck"]
    assert none["crashed"] and none["overshoots"] == 1
    assert none["crash"]["message"] == "total_num_tokens (74) should be less than or equal to max_num_tokens (48)"
    assert none["crash"]["mechanism"] == "evicted_discount"
    assert none["overshoot_mechanisms"] == {"whole_prompt_hit": 0, "evicted_discount": 1, "other": 0}
    assert none["completed"] == 2 and none["unserved"] == 4  # the crashed batch and every later request hang
    assert not recheck["crashed"] and recheck["overshoots"] == 0
    assert recheck["completed"] == recheck["requests"] == 6 and recheck["errored"] == 0
    assert recheck["max_forward_tokens"] <= 48 and recheck["deferrals"] + recheck["budget_cuts"] >= 1
    assert recheck["max_consecutive_deferrals"] <= 1


def test_none_crashes_on_whole_prompt_hit():
    results = _replay("whole", ("none", "recheck")).to_json()["results"]
    crash = results["none"]["crash"]
    assert crash["mechanism"] == "whole_prompt_hit" and crash["overshoot"] == 1
    assert crash["message"].startswith("total_num_tokens (65)")
    assert results["recheck"]["overshoots"] == 0 and results["recheck"]["completed"] == 4


def test_utilization_when_bound_averages_the_iterations_that_left_prompt_tokens_behind():
    """docs/design.md §5: the busy iterations after which some active request still had prompt
    tokens to compute; recomputed here from the executor's own statistics."""
    from benchmarks.replay import loop

    trace, settings = whole_prompt_hit_trace(), WHOLE_SETTINGS
    replay = loop._PolicyReplay(trace, settings, "recheck", settings.max_seq_len(trace))
    replay.run(0, True, loop.Progress("recheck", len(trace), enabled=False))
    stats = [s for s in replay.executor.iteration_stats if s.forward_tokens and not s.overshoot]
    bound = [s.forward_tokens for s in stats if s.budget_bound]
    metrics = replay.result().metrics
    assert 0 < len(bound) < len(stats) == metrics["iterations"]
    assert metrics["budget_utilization_when_bound"] == sum(bound) / len(bound) / settings.executor.max_num_tokens
    # the long prompt is chunked at the full budget while anything waits: bound iterations are full
    assert metrics["budget_utilization_when_bound"] > metrics["budget_utilization"]


def test_policies_that_go_on_count_overshoots_as_errors():
    trace = evicted_discount_trace()
    run = replay_policy(trace, EVICTED_SETTINGS, "none", progress=False, stop_at_crash=False)
    m = run.metrics
    assert not m["crashed"] and m["overshoots"] == 1 and m["errored"] == 2  # the failed batch: fresh + follow-up
    assert m["completed"] == 4 and m["unserved"] == 0


def test_deterministic_except_wall_time():
    spec = TraceSpec(num_requests=40, seed=3)

    def strip(document: dict) -> dict:
        for result in document["results"].values():
            result.pop("wall_s")
        return document

    from benchmarks.replay import run_replay

    first = strip(run_replay(spec, ReplaySettings(), ("none", "recheck"), progress=False).to_json())
    second = strip(run_replay(spec, ReplaySettings(), ("none", "recheck"), progress=False).to_json())
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert first["results"]["recheck"]["completed"] == 40


def test_a_saved_cost_model_prices_the_sim_engine(tmp_path):
    """``--cost-model``: the sim engine's forwards are priced by a refitted model (here the
    default fit with every coefficient doubled), which the timings and the config show."""
    from benchmarks.replay.cost_model import FittedCostModel, default_cost_model
    from benchmarks.replay import run_replay

    default = default_cost_model()
    assert isinstance(default, FittedCostModel)
    slower = FittedCostModel([2 * c for c in default.coef], default.gemm_knee, default.attn_knee, default.fallback,
                             2 * default.fallback_scale, default.range, 2 * default._floor_s)
    path = tmp_path / "slower.json"
    slower.save(path)
    args = build_parser().parse_args(["--num-requests", "12", "--policies", "recheck", "--cost-model", str(path)])
    spec, settings, policies = settings_from_args(args)
    assert settings.cost_model == str(path)
    priced = run_replay(spec, settings, policies, progress=False).to_json()
    plain = run_replay(spec, ReplaySettings(), policies, progress=False).to_json()
    assert priced["config"]["engine"]["cost_model_file"] == str(path)
    assert priced["results"]["recheck"]["completed"] == plain["results"]["recheck"]["completed"] == 12
    assert priced["results"]["recheck"]["tpot_ms"]["p50"] > 1.5 * plain["results"]["recheck"]["tpot_ms"]["p50"]
    with pytest.raises(ValueError, match="sim engine"):
        ReplaySettings(engine="torch", cost_model=str(path))
    with pytest.raises(SystemExit):
        main(["--engine", "torch", "--cost-model", str(path)])


def test_cli_parses_every_flag():
    args = build_parser().parse_args([
        "--trace", "t.jsonl", "--format", "mooncake", "--policies", "fit,recheck", "--engine", "torch",
        "--max-num-tokens", "2048", "--num-requests", "10", "--seed", "7", "--json", "o.json", "--plot", "o.png",
        "--kv-blocks", "300", "--host-cache-blocks", "50", "--tokens-per-block", "16", "--max-batch-size", "12",
        "--no-enable-partial-reuse", "--no-enable-block-reuse", "--no-enable-chunked-prefill",
        "--time-scale", "0.5", "--qps", "3.5", "--system-prompt-len", "100", "--model", "small-random",
    ])
    spec, settings, policies = settings_from_args(args)
    assert policies == ["fit", "recheck"] and args.json == "o.json" and args.plot == "o.png"
    assert spec == TraceSpec(path="t.jsonl", format="mooncake", num_requests=10, seed=7, qps=3.5, time_scale=0.5,
                             system_prompt_len=100)
    assert settings == ReplaySettings.from_options(
        engine="torch", model="small-random", max_num_tokens=2048, max_batch_size=12, host_cache_blocks=50,
        kv_cache_config={"tokens_per_block": 16, "num_blocks": 300, "enable_block_reuse": False,
                         "enable_partial_reuse": False},
        enable_chunked_prefill=False,
    )
    executor = settings.executor
    assert (executor.max_num_tokens, executor.max_batch_size, executor.enable_chunked_prefill) == (2048, 12, False)
    assert executor.kv_cache_config == KvCacheConfig(tokens_per_block=16, num_blocks=300, enable_block_reuse=False,
                                                     enable_partial_reuse=False)
    config = settings.executor_config("fit", max_seq_len=100, kv_bytes_per_token=10)
    assert config.kv_cache_config.host_cache_size == 50 * 16 * 10  # blocks x tokens_per_block x bytes per token


def test_cli_defaults_and_bad_values():
    spec, settings, policies = settings_from_args(build_parser().parse_args([]))
    assert spec.path is None and policies == list(POLICIES) and settings == ReplaySettings()
    executor = settings.executor
    assert executor.max_num_tokens == 4096 and executor.enable_chunked_prefill
    assert executor.kv_cache_config.enable_partial_reuse and executor.kv_cache_config.enable_block_reuse
    assert executor.kv_cache_config.num_blocks == 1280 and settings.host_cache_blocks > 0
    # the torch engine's device is LLM's: auto resolves to the GPU only where torch sees one
    assert settings.device == "auto"
    assert settings.torch_device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert ReplaySettings.from_options(device="cpu").torch_device == "cpu"
    for bad in (["--policies", "none,best"], ["--engine", "gpu"], ["--device", "tpu"], ["--max-num-tokens", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    # values the dataclasses refuse: a usage error (status 2) before anything is replayed
    for bad in (["--kv-blocks", "0"], ["--kv-blocks", "none"], ["--qps", "-1"], ["--time-scale", "nan"],
                ["--num-requests", "0"], ["--tokens-per-block", "48", "--chunk-unit-size", "32"]):
        with pytest.raises(SystemExit) as error:
            parse_args(bad)
        assert error.value.code == 2


def test_main_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["--num-requests", "30", "--policies", "none,recheck", "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "recheck" in printed and "note: default scenario:" in printed
    _check_schema(json.loads(out_json.read_text()))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.usefixtures("one_torch_thread")
def test_torch_engine_runs_a_tiny_trace_end_to_end():
    trace = Trace("tiny", "scenario", tuple(
        SyntheticRequest(i, 0.05 * i, 24 + 8 * (i % 3), 4, ((segment_key(0xB0, i % 2), 16), (segment_key(0xB1, i), 8 + 8 * (i % 3))), 512)
        for i in range(6)
    ))
    settings = ReplaySettings.from_options(engine="torch", model="tiny-random", max_num_tokens=32, host_cache_blocks=8,
                                           kv_cache_config={"tokens_per_block": 4, "num_blocks": 64}, max_batch_size=4)
    document = replay_trace(trace, settings, ("none", "recheck"), progress=False).to_json()
    _check_schema(document)
    assert document["config"]["engine"]["engine"] == "torch"
    for result in document["results"].values():
        assert result["completed"] == 6 and result["overshoots"] == 0
        assert result["ttft_ms"]["p50"] > 0.0


def test_admission_window_changes_no_decision():
    # 120 requests in 3 s overload the engine: a long queue forms behind a batch of 4.
    trace = TraceSpec(num_requests=120, seed=5, qps=40.0).load(ReplaySettings())
    settings = ReplaySettings.from_options(max_batch_size=4)
    for policy in ("none", "recheck"):
        gated = replay_policy(trace, settings, policy, progress=False, admission_window=4).metrics
        ungated = replay_policy(trace, settings, policy, progress=False, admission_window=0).metrics
        gated.pop("wall_s"), ungated.pop("wall_s")
        assert gated == ungated


def test_resumed_admission_walk_equals_fresh_walks(monkeypatch):
    """The KV manager's prefix index (each waiting request's walk, resumed by the next) returns
    what a walk from scratch returns, at every match and claim of a replay whose pool and host
    tier churn."""
    from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_reuse import PrefixIndex

    resumed = PrefixIndex.chain
    calls = []

    def checked(self, request_id, prompt_len, keys):
        got = resumed(self, request_id, prompt_len, keys)
        assert got == self._tree.match(keys)  # the walk from the root
        calls.append(len(got))
        return got

    monkeypatch.setattr(PrefixIndex, "chain", checked)
    settings = ReplaySettings.from_options(kv_cache_config={"num_blocks": 400}, host_cache_blocks=64)
    trace = TraceSpec(num_requests=120, seed=2).load(settings)
    replay_policy(trace, settings, "recheck", progress=False)
    assert len(calls) > 500 and any(calls)


@pytest.mark.usefixtures("one_torch_thread")
def test_torch_engine_refuses_a_request_longer_than_the_model_alone():
    from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS

    limit = MODEL_PRESETS["tiny-random"].max_position_embeddings
    trace = Trace("too-long", "scenario", (
        SyntheticRequest(0, 0.0, limit, 4, ((segment_key(0xC0, 0), limit),), 512),
        SyntheticRequest(1, 0.0, 20, 4, ((segment_key(0xC0, 1), 20),), 512),
    ))
    settings = ReplaySettings.from_options(engine="torch", max_num_tokens=64, host_cache_blocks=0,
                                           kv_cache_config={"tokens_per_block": 4, "num_blocks": 2100})
    assert settings.max_seq_len(trace) == limit
    result = replay_trace(trace, settings, ("recheck",), progress=False).to_json()["results"]["recheck"]
    assert result["errored"] == 1 and result["completed"] == 1  # the short request is not collateral damage


def test_a_generation_step_charged_less_than_it_ran_is_named():
    """No context chunk ran past its charge: the diagnosis names the generation step that did
    (a first draft charged without its padding, beams charged as one position), under ``other``."""
    from tests.helpers.factories import make_batch, make_request

    from benchmarks.replay.diagnosis import diagnose_overshoot
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState

    first = make_request(prompt_len=3, max_draft_len=4, is_first_draft=True)
    beams = make_request(prompt_len=3, beam_width=4)
    for request in (first, beams):
        request.state = LlmRequestState.GENERATION_IN_PROGRESS
    batch = make_batch(generation=[first, beams])
    event = diagnose_overshoot(batch, {first.request_id: 1, beams.request_id: 4}, [], 4, iteration=7, time_s=1.0,
                               forward_tokens=9, overshoot=1)
    assert (event.mechanism, event.request_id, event.step, event.charged, event.ran) == (
        "other", first.request_id, "first draft 4", 1, 5)
    assert "generation step" in event.describe()
    event = diagnose_overshoot(batch, {first.request_id: 5, beams.request_id: 1}, [], 4, iteration=7, time_s=1.0,
                               forward_tokens=9, overshoot=1)
    assert (event.request_id, event.step, event.ran) == (beams.request_id, "beams 4", 4)
