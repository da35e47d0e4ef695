"""``python -m benchmarks.serving.replay`` against a real server: every request served, the JSON of DESIGN.md §6."""

from __future__ import annotations

import json
import random

import pytest
from tests.helpers.server_harness import RunningServer

from benchmarks.serving import replay as serve_replay
from tensorrt_llm.llmapi import LLM, KvCacheConfig


def test_serve_replay_over_a_mooncake_trace_completes_every_request(tiny_server, tmp_path, capsys):
    # Six requests in 0.3 s; the later ones share the first ones' 512-token hash ids' prefixes,
    # cut to the server's max_seq_len of 256.
    rows = [(0, 40, 5, [1]), (50, 60, 4, [1]), (100, 30, 6, [2]), (150, 90, 3, [1]), (200, 45, 5, [2]), (300, 20, 2, [3])]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}) + "\n"
                             for ts, n, out, ids in rows))
    out = tmp_path / "replay.json"
    assert serve_replay.main(["--url", tiny_server.url, "--trace", str(trace), "--api-key", tiny_server.api_key,
                              "--max-output-tokens", "4", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    result = document["result"]
    assert (result["requests"], result["completed"], result["errored"]) == (6, 6, 0), result["errors"]
    assert result["output_tokens"] == sum(min(o, 4) for _, _, o, _ in rows)
    for key in ("ttft_ms", "itl_ms"):
        assert set(result[key]) >= {"p50", "p99"} and result[key]["p50"] > 0
    assert result["output_tokens_per_s"] > 0 and result["wall_s"] > 0
    assert set(result["server"]) >= {"budget_deferrals", "budget_overshoots", "failed_batches"}
    assert result["server"]["budget_overshoots"] == 0 and result["server"]["failed_batches"] == 0
    assert result["server"]["prefix_cache_hit_tokens"] > 0  # the shared hash ids reached the server as shared tokens
    assert document["config"]["model"] == "tiny-random" and document["config"]["vocab_size"] == 512
    assert "serve_replay:" in capsys.readouterr().out


def test_serve_replay_closed_loop_never_has_more_than_n_requests_in_flight(tiny_server, tmp_path, monkeypatch):
    rows = [{"task_id": i, "input_ids": [1 + (i * 7 + j) % 500 for j in range(20 + i)], "output_tokens": 3} for i in range(8)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    in_flight, peak, order = 0, 0, []
    send_one = serve_replay.send_one

    async def counting(client, target, request, max_tokens, start):
        nonlocal in_flight, peak
        assert start is None  # a closed loop sends at once
        in_flight += 1
        peak = max(peak, in_flight)
        order.append(request.request_index)
        try:
            return await send_one(client, target, request, max_tokens, start)
        finally:
            in_flight -= 1

    monkeypatch.setattr(serve_replay, "send_one", counting)
    out = tmp_path / "replay.json"
    assert serve_replay.main(["--url", tiny_server.url, "--trace", str(trace), "--api-key", tiny_server.api_key,
                              "--concurrency", "3", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["config"]["concurrency"] == 3 and document["result"]["completed"] == 8
    assert peak == 3 and order == list(range(8))  # three users, requests in trace order
    with pytest.raises(SystemExit):
        serve_replay.main(["--url", tiny_server.url, "--concurrency", "2", "--qps", "3"])


def whole_prompt_hit_trace(path, num_requests: int = 60) -> None:
    """Block-aligned prompts (8 blocks of 32) sent again and again, between unrelated prompts:
    without partial reuse a fully cached repeat is charged 1 token and recomputes its last block."""
    rng = random.Random(0)
    repeated = [[1 + rng.randrange(500) for _ in range(256)] for _ in range(6)]
    rows = []
    for i in range(num_requests):
        ids = [1 + rng.randrange(500) for _ in range(rng.randrange(150, 600))] if i % 3 == 0 else rng.choice(repeated)
        rows.append({"task_id": i, "input_ids": ids, "output_tokens": 8})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("policy", ["none", "recheck"])
def test_over_http_none_overshoots_and_recheck_defers(policy, tmp_path, one_torch_thread):
    """The bug and the fix as a client sees them: under ``none`` forwards overshoot
    max_num_tokens and their batches fail (the server keeps serving: it is not upstream's
    dead thread); under ``recheck`` the same traffic is deferred a little and all of it is served."""
    llm = LLM("tiny-random", max_num_tokens=256, max_seq_len=1024, enable_chunked_prefill=True,
              token_budget_policy=policy,
              kv_cache_config=KvCacheConfig(tokens_per_block=32, num_blocks=512, enable_partial_reuse=False))
    server = RunningServer(llm, api_key=None)
    try:
        whole_prompt_hit_trace(tmp_path / "trace.jsonl")
        out = tmp_path / "replay.json"
        assert serve_replay.main(["--url", server.url, "--trace", str(tmp_path / "trace.jsonl"), "--json", str(out)]) == 0
        result = json.loads(out.read_text())["result"]
        counters = result["server"]
        print(f"\n{policy}: {result['completed']}/{result['requests']} completed, server {counters}")
        if policy == "none":
            assert counters["budget_overshoots"] > 0 and counters["failed_batches"] == counters["budget_overshoots"]
            assert result["errored"] > 0 and all("TokenBudgetExceeded" in e for e in result["errors"])
        else:
            assert counters["budget_overshoots"] == counters["failed_batches"] == 0 and counters["budget_deferrals"] > 0
            assert result["completed"] == result["requests"]
        assert server.executor.health().healthy
    finally:
        server.stop()
