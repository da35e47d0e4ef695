"""The peer benchmark's pieces on the CPU: the checkpoint's vocabulary arithmetic and LM head, the
GuideLLM command per sampling, the level statistics (from GuideLLM's JSON and from the engine's
token stamps), the comparison table, the published figures' citations, the wheel-site check, and
one engine level run for real on a tiny model. (GuideLLM itself against a real server:
``test_peer_guidellm.py``, marked slow.)"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import peer_checkpoint, peer_engine, peer_serving, peer_summary, site_check

ROOT = Path(__file__).resolve().parents[4]
LLAMA_3_1_8B_PARAMETERS = 8_030_261_248  # the published count


def test_the_vocabulary_statement_of_llama_3_1_8b():
    config = peer_checkpoint.checkpoint_config("model", 49152, dry_run=False)
    statement = peer_checkpoint.vocab_statement(config, 49152)
    hidden = 4096
    assert statement["vocab_size"] == 128256 and statement["ids_decoding_to_empty"] == 79104
    assert statement["lm_head_bytes"] == 2 * 128256 * hidden == 1_050_673_152
    assert statement["tokenizer_vocab_removes_lm_head_bytes"] == 2 * 79104 * hidden == 648_019_968
    step = statement["decode_step_weight_bytes"]["model_vocab"]
    assert step // 2 + 128256 * hidden == LLAMA_3_1_8B_PARAMETERS  # every weight but the embedding table
    assert step - statement["decode_step_weight_bytes"]["tokenizer_vocab"] == 648_019_968
    assert statement["tokenizer_vocab_removes_share_of_decode_step_bytes"] == pytest.approx(0.0432, abs=5e-4)
    trimmed = peer_checkpoint.checkpoint_config("tokenizer", 49152, dry_run=True)
    assert trimmed["vocab_size"] == 49152 and trimmed["hidden_size"] == 64
    assert peer_checkpoint.checkpoint_config("model", 49152, dry_run=True)["vocab_size"] == 128256


def test_the_lm_head_makes_padded_ids_as_rare_as_predicted():
    """Real rows ~ N(0, (4/sqrt(hidden))^2), padded rows 0: greedy never picks a padded id and
    sampling at temperature 1 does about as often as ``padded_probability`` says."""
    vocab, tokenizer_size, hidden = 128256, 49152, 64
    head = torch.empty(vocab, hidden)
    peer_checkpoint.shape_lm_head_(head, tokenizer_size)
    assert not head[tokenizer_size:].any()
    assert head[:tokenizer_size].std().item() == pytest.approx(4 / math.sqrt(hidden), rel=0.02)
    states = torch.randn(64, hidden, generator=torch.Generator().manual_seed(1))  # not the head's seed (0)
    states = states / states.pow(2).mean(-1, keepdim=True).sqrt()  # (64, hidden), RMS 1 as after RMSNorm
    probabilities = torch.softmax(states @ head.T, dim=-1)  # (64, vocab)
    assert (probabilities.argmax(-1) < tokenizer_size).all()
    padded = probabilities[:, tokenizer_size:].sum(-1).mean().item()
    expected = peer_checkpoint.padded_probability(vocab, tokenizer_size)
    assert expected == pytest.approx(5.4e-4, rel=0.01)
    assert expected / 3 < padded < expected * 3


def test_samplings_alternate_and_only_greedy_sends_a_temperature(tmp_path):
    shapes = [(1024, 128), (1024, 1024)]
    assert peer_serving.run_order(shapes, ["sampled", "greedy"]) == [
        ((1024, 128), "sampled"), ((1024, 128), "greedy"), ((1024, 1024), "greedy"), ((1024, 1024), "sampled")]
    args = argparse.Namespace(guidellm="python3 -m guidellm", concurrency=[1, 16, 64, 128], seconds=10)
    for seed, (sampling, extras) in enumerate((("greedy", {"body": {"temperature": 0}}), ("sampled", None))):
        command = peer_serving.guidellm_command(args, "http://h:1", "m", tmp_path, (1024, 128), sampling,
                                                tmp_path / "r.json", seed)
        # each run its own prompts: a run re-sending another's would find them in the prefix cache
        assert command[command.index("--seed") + 1] == f"kind=static,value={seed}"
        backend = json.loads(command[command.index("--backend") + 1])
        assert backend.get("extras") == extras and backend["request_format"] == "/v1/completions"
        assert "kind=concurrent,streams[0]=1,streams[1]=16,streams[2]=64,streams[3]=128" in command
        assert "kind=synthetic_text,prompt_tokens=1024,output_tokens=128" in command


def _guidellm_request(start: float, first: float | None, last: float | None, tokens: int, temperature) -> dict:
    body = {"prompt": "x", "max_tokens": 8} | ({} if temperature is None else {"temperature": temperature})
    return {"output_tokens": tokens, "request_args": json.dumps({"body": body}), "cached_tokens": 2,
            "info": {"timings": {"request_start": start, "first_token_iteration": first, "last_token_iteration": last}}}


def test_a_guidellm_level_counts_cut_requests_and_weights_itl_by_tokens():
    report = {"benchmarks": [{
        "config": {"strategy": {"streams": 2}}, "duration": 2.0,
        "metrics": {"request_totals": {"successful": 2, "incomplete": 1, "errored": 1, "total": 4}},
        "requests": {
            "successful": [_guidellm_request(0.0, 0.1, 0.8, 8, 0), _guidellm_request(0.8, 1.0, 1.4, 5, 0)],
            "incomplete": [_guidellm_request(1.4, 1.5, 2.0, 3, 0)],  # cut at the end: 3 tokens so far
            "errored": [_guidellm_request(0.0, None, None, 0, 0)],
        }}]}
    (level,) = peer_summary.summarize_guidellm(report)
    assert (level["concurrency"], level["completed"], level["incomplete"], level["errored"]) == (2, 2, 1, 1)
    assert level["output_tokens"] == 16 and level["output_tokens_per_s"] == 8.0
    assert level["ttft_ms"]["p50"] == pytest.approx(100.0)  # 100, 200, 100 ms
    # per-request ITL 100 (x7 weight), 100 (x4), 250 (x2): the weighted median is 100 ms
    assert level["itl_ms"]["p50"] == pytest.approx(100.0) and level["itl_ms"]["p99"] == pytest.approx(250.0)
    assert level["decode_tokens_per_s"] == pytest.approx(20.0)
    assert level["body_temperature"] == "0" and level["cached_tokens_mean"] == 2
    report["benchmarks"][0]["requests"] = {"successful": [_guidellm_request(0.0, 0.1, 0.2, 2, None)]}
    assert peer_summary.summarize_guidellm(report)[0]["body_temperature"] == "omitted"


def test_the_engine_measures_the_same_figures_from_token_stamps():
    figures = peer_summary.request_figures(1.0, [1.25, 1.30, 1.35, 1.45])
    assert figures == {"tokens": 4, "ttft_ms": pytest.approx(250.0), "itl_ms": pytest.approx(200 / 3)}
    assert peer_summary.request_figures(1.0, []) == {"tokens": 0, "ttft_ms": None, "itl_ms": None}


def _level(concurrency: int, tokens_per_s: float, itl: float, ttft: float) -> dict:
    return {"concurrency": concurrency, "completed": 3, "incomplete": 1, "errored": 0,
            "output_tokens_per_s": tokens_per_s, "itl_ms": {"p50": itl}, "ttft_ms": {"p50": ttft}}


def test_the_comparison_table_and_the_ratio_to_a_comparable_published_figure():
    records = {
        "peer_auto.json": {"runs": {"1024/1024": {"sampled": {"levels": [_level(1, 100.0, 10.0, 50.0), _level(128, 9000.0, 14.0, 900.0)]},
                                                  "greedy": {"levels": [_level(1, 110.0, 9.0, 45.0), _level(128, 10000.0, 12.8, 800.0)]}}}},
        "engine_auto.json": {"runs": {"1024/1024": {"sampled": {"levels": [_level(128, 9500.0, 13.0, 700.0)]},
                                                    "greedy": {"levels": [_level(128, 10500.0, 12.0, 650.0)]}}}},
    }
    rows = peer_summary.comparison_rows(records)
    assert [(r["kv"], r["shape"], r["concurrency"]) for r in rows] == [("auto", "1024/1024", 1), ("auto", "1024/1024", 128)]
    table = peer_summary.render_table(rows)
    assert "9,000 / 10,000 (0.90)" in table and "14.00 / 12.80 (1.09)" in table and "0.95 / 0.95" in table
    ratios = peer_summary.figure_ratios(records, peer_summary.load_figures())
    trtllm = [r for r in ratios if r["figure"] == "trtllm-h200-fp8-1000-1000"]
    assert {(r["sampling"], r["concurrency"], r["ours"]) for r in trtllm} == {("sampled", 128, 9000.0), ("greedy", 128, 10000.0)}
    assert trtllm[0]["ratio"] == pytest.approx(trtllm[0]["ours"] / 17744)
    assert "17,744" in peer_summary.report(records, peer_summary.load_figures())


def test_every_published_figure_is_cited_and_in_the_docs():
    data = json.loads(peer_summary.FIGURES.read_text())
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for figure in data["figures"]:
        assert figure["url"].startswith("https://") and figure["date"] and figure["setting"] and figure["metric"]
        assert isinstance(figure["value"], (int, float)) and figure["gpu"].startswith("H200")
        assert ("comparable_to" in figure) != ("not_comparable_because" in figure), figure["id"]
        assert f"{figure['value']:,}" in docs, f"docs/gpu.md lacks {figure['id']}"
    assert {entry["engine"] for entry in data["not_found"]} >= {"SGLang", "vLLM", "TensorRT-LLM"}
    assert peer_summary.render_figures(data["figures"]).count("\n") == len(data["figures"]) + 1


def _dist(site: Path, name: str, version: str, *requires: str, extras: tuple[str, ...] = ()) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Provides-Extra: {e}" for e in extras), *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_the_site_check_names_what_a_wheel_set_lacks(tmp_path):
    _dist(tmp_path, "client", "1.0", "lib>=2", "httpx[http2]<1", "torch", "winonly; sys_platform == 'win32'",
          "old; python_version < '3.12'")
    _dist(tmp_path, "lib", "1.5")
    _dist(tmp_path, "httpx", "0.29.0", "anyio", "h2>=3; extra == 'http2'", extras=("http2",))
    assert site_check.unmet(tmp_path) == ["client: lib>=2 (SITE has 1.5)", "httpx: anyio", "httpx[http2]: h2>=3"]
    assert site_check.main([str(tmp_path)]) == 1


def test_an_engine_level_runs_cuts_and_drains(one_torch_thread):
    """A real level on a tiny model: requests end and are replaced, those running at the end are
    aborted (their tokens so far count) and the executor is left empty; refused requests are
    counted, not retried in a tight loop."""
    from tensorrt_llm.llmapi import LLM

    with LLM("tiny-random", max_seq_len=4096, max_batch_size=8) as llm:
        async def measure():
            warm = await peer_engine.warm_up(llm, 512, 3, (16, 48))
            level = await peer_engine.run_level(llm, peer_engine.prompt_source(16, 512),
                                                peer_engine.sampling_params("sampled", 3000), 3, 1.0)
            refused = await peer_engine.run_level(llm, peer_engine.prompt_source(16, 512),
                                                  peer_engine.sampling_params("greedy", 5000), 3, 0.5)
            return warm, level, refused
        warm, level, refused = asyncio.run(measure())
        assert not llm.executor.has_work
    # refused at submission (16 + 5000 > max_seq_len): each stream counts its error and stops
    assert (refused["errored"], refused["completed"], refused["output_tokens"]) == (3, 0, 0)
    assert "max_seq_len" in refused["first_error"]
    assert warm["greedy"]["tokens"] == 2 * (8 + 9 + 10) and warm["sampled"]["padded_share"] == 0.0
    assert level["errored"] == 0 and level["incomplete"] == 3  # 3000 tokens outlast a second
    assert level["output_tokens"] > 0 and level["itl_ms"]["p50"] > 0 and level["ttft_ms"]["p50"] > 0
