"""The server's memory gauges, and the soak's reading of them over a run."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

from benchmarks.serving.soak import memory_gauges, summarize_memory, summarize_polls
from tensorrt_llm.llmapi import LLM
from tensorrt_llm.serve.metrics import ServerMetrics


@pytest.fixture(scope="module")
def metrics_text():
    llm = LLM("tiny-random")
    try:
        yield generate_latest(ServerMetrics(llm.executor).registry).decode()
    finally:
        llm.shutdown()


def test_the_metrics_carry_the_process_memory_and_no_gpu_gauge_without_cuda(metrics_text):
    gauges = memory_gauges(metrics_text)
    assert gauges["rss_mib"] > 50  # torch alone is larger
    assert "gpu_allocated_mib" not in gauges and "trtllm_gpu_memory" not in metrics_text


def test_the_soak_summarizes_memory_samples_apart_from_the_polls(tmp_path):
    lines = [{"t": 0.0, "path": "/health", "status": 200, "ms": 1.0}]
    lines += [{"t": float(t), "memory": {"rss_mib": rss, "gpu_reserved_mib": 1000.0}}
              for t, rss in enumerate([500.0, 600.0, 610.0, 612.0, 611.0])]
    path = tmp_path / "polls.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"t": 9, "pa')  # a cut last line
    memory = summarize_memory(path)
    assert memory["rss_mib"] == {"samples": 5, "first": 500.0, "max": 612.0, "last": 611.0, "second_half_change": 1.0}
    assert memory["gpu_reserved_mib"]["second_half_change"] == 0.0
    assert summarize_polls(path)["/health"]["polls"] == 1
