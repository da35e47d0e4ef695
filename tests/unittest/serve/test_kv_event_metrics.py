"""``/prometheus/metrics`` counts the KV cache events the pool emitted, and those dropped unread."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, SamplingParams

BUFFER = 3


def scrape(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/prometheus/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("trtllm_kv_cache_events")}


@pytest.fixture(scope="module")
def server(one_torch_thread):
    llm = LLM("tiny-random", max_seq_len=64, max_num_tokens=64,
              kv_cache_config={"tokens_per_block": 4, "num_blocks": 32, "event_buffer_max_size": BUFFER})
    running = RunningServer(llm)
    yield running
    running.stop()  # (it shuts the LLM down)


def test_events_emitted_and_dropped_are_counted(server):
    assert scrape(server) == {"trtllm_kv_cache_events_total": 1.0, "trtllm_kv_cache_events_dropped_total": 0.0}
    for start in (1, 100, 200, 300):  # each stores its two full blocks in one event: 4 events, nobody reads
        server.llm.generate(list(range(start, start + 9)), SamplingParams(max_tokens=1))
    counts = scrape(server)
    assert counts["trtllm_kv_cache_events_total"] == 5.0  # created + four stores
    assert counts["trtllm_kv_cache_events_dropped_total"] == 5.0 - BUFFER  # the oldest, beyond what the buffer holds
    assert [e["event_id"] for e in server.llm.get_kv_cache_events(0)] == [2, 3, 4]  # a reader sees the gap


def test_no_event_series_while_events_are_off(tiny_server):
    assert scrape(tiny_server) == {}
