"""``python -m benchmarks.serve_replay`` against a real server: every request served, the JSON of DESIGN.md §6."""

from __future__ import annotations

import json

from benchmarks import serve_replay


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
