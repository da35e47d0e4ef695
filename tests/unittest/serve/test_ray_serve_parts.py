"""The Ray Serve application's parts that need no Ray: the ingress's prompt ids (the ids the
replica queues), the registry's push protocol, the metrics merge and ``build_app``'s checks."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.serve.ray_serve.metrics_merge import merge_expositions
from tensorrt_llm.serve.ray_serve.prefix_index import request_keys
from tensorrt_llm.serve.ray_serve.prompt_ids import CHAT, COMPLETIONS, RoutingPrompts, prompt_renderer
from tensorrt_llm.serve.ray_serve.registry import ReplicaRegistry
from tensorrt_llm.serve.server_config import ServerConfig

TPB = 8
FAST = {"step_s": 0.0, "context_token_s": 0.0, "context_attention_s": 0.0, "decode_token_s": 0.0,
        "decode_kv_token_s": 0.0}


@pytest.fixture(scope="module")
def smollm2_replica():
    """SmolLM2's tokenizer and chat template over the simulated engine, KV events on: a replica as
    the Ray Serve application runs it, behind the real server."""
    llm = LLM("smollm2-135m-instruct", simulated_engine=FAST, max_seq_len=1024,
              kv_cache_config=KvCacheConfig(tokens_per_block=TPB, num_blocks=512, event_buffer_max_size=4096))
    server = RunningServer(llm, api_key=None)
    yield server
    server.stop()


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name three colors, then three fruits, then three trees."}],
            "max_tokens": 2}),
    (COMPLETIONS, {"prompt": "Once upon a time, in a land far away beyond the hills and the rivers, there lived a"
                             " baker who sold bread to every traveller", "max_tokens": 2}),
])
def test_the_ids_the_ingress_routes_by_are_the_ids_the_replica_caches(smollm2_replica, path, body):
    """The ingress renders the request from the model's metadata alone; the replica serves it; the
    replica's KV events hold exactly those ids' full blocks (chat template applied, no double BOS)."""
    llm = smollm2_replica.llm
    llm.get_kv_cache_events(timeout=0)  # what earlier requests left
    routing = RoutingPrompts(prompt_renderer("smollm2-135m-instruct", ServerConfig()), ServerConfig())
    ids = asyncio.run(routing.prompt_ids(path, json.dumps(body).encode()))
    with smollm2_replica.http() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    stored = {block["block_hash"] for event in llm.get_kv_cache_events(timeout=1)
              if event["data"]["type"] == "stored" for block in event["data"]["blocks"]}
    keys = request_keys(ids, TPB)
    assert len(keys) >= 2 and set(keys) <= stored


def test_a_request_the_ingress_cannot_render_has_no_ids():
    routing = RoutingPrompts(prompt_renderer("tiny-random", ServerConfig()), ServerConfig())
    assert asyncio.run(routing.prompt_ids(COMPLETIONS, b'{"prompt": "text"}')) is None  # no tokenizer
    assert asyncio.run(routing.prompt_ids(COMPLETIONS, b"{not json")) is None
    assert asyncio.run(routing.prompt_ids("/v1/models", b"")) is None
    assert asyncio.run(routing.prompt_ids(COMPLETIONS, b'{"prompt": [[5, 6], [7]]}')) == [5, 6]  # a batch: the first


# ---- the registry ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stored(*hashes: int) -> list[dict]:
    return [{"event_id": 0, "data": {"type": "stored", "parent_hash": None,
                                     "blocks": [{"block_hash": h, "tokens": []} for h in hashes]}}]


def test_the_registry_applies_batches_in_order_and_asks_for_a_resync_otherwise():
    registry = ReplicaRegistry()
    assert not registry.apply("r", "e1", 0, _stored(1, 2))  # new here: it does not follow r yet
    registry.resync("r", "e1", 0, [1, 2])
    assert registry.match([1, 2, 3], ["r"]) == {"r": 2}
    assert registry.apply("r", "e1", 1, _stored(3))
    assert registry.match([1, 2, 3], ["r"]) == {"r": 3}
    assert not registry.apply("r", "e1", 3, _stored(4))  # batch 2 was lost
    assert not registry.apply("r", "e2", 2, _stored(4))  # another life of the replica
    registry.resync("r", "e2", 0, [9])
    assert registry.match([1], ["r"]) == {"r": 0} and registry.num_blocks() == {"r": 1}


def test_a_malformed_batch_drops_the_replica_into_a_resync():
    registry = ReplicaRegistry()
    registry.resync("r", "e", 0, [])
    assert not registry.apply("r", "e", 1, [{"data": {"type": "moved"}}])
    assert not registry.apply("r", "e", 2, _stored(1))  # until it resynchronises


def test_a_silent_replica_is_dropped_with_its_blocks():
    clock = Clock()
    registry = ReplicaRegistry(stale_after_s=5.0, clock=clock)
    registry.resync("a", "e", 0, [1])
    registry.report("a", {"healthy": True}, "")
    clock.now = 3.0
    registry.report("b", {"healthy": True}, "")
    clock.now = 7.0
    assert set(registry.reports()) == {"b"}
    assert registry.match([1], ["a", "b"]) == {"a": 0, "b": 0}


# ---- the metrics merge ---------------------------------------------------------------------------

def _exposition(prompt_tokens: float) -> str:
    """One replica's metrics as prometheus_client writes them (a counter, a labelled counter, a histogram)."""
    registry = CollectorRegistry()
    Counter("trtllm_prompt_tokens", "Prompt tokens", registry=registry).inc(prompt_tokens)
    Counter("trtllm_request_success", "Finished", ["finished_reason"], registry=registry).labels("stop").inc()
    Histogram("trtllm_ttft_seconds", "TTFT", buckets=(0.1,), registry=registry).observe(0.05)
    return generate_latest(registry).decode()


def test_the_merged_metrics_hold_every_replicas_samples_under_one_family():
    text = merge_expositions({"r1": _exposition(10), "r2": _exposition(32), "bad": "trtllm_x{ 1"}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["replica"]: s.value for s in families["trtllm_prompt_tokens"].samples
              if s.name == "trtllm_prompt_tokens_total"}
    assert tokens == {"r1": 10.0, "r2": 32.0}  # the unparsable replica is left out
    assert text.count("# TYPE trtllm_prompt_tokens_total counter") == 1
    assert 'trtllm_request_success_total{finished_reason="stop",replica="r2"} 1.0' in text
    buckets = [s for s in families["trtllm_ttft_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["replica"], s.labels["le"]) for s in buckets} == {
        (r, le) for r in ("r1", "r2") for le in ("0.1", "+Inf")}


# ---- build_app's checks (Ray builds nothing until serve.run) -------------------------------------


def test_build_app_refuses_bad_settings_by_name():
    pytest.importorskip("ray.serve")
    from tensorrt_llm.serve.ray_serve import build_app

    with pytest.raises(ValueError, match="unknown key 'num_replica'"):
        build_app(model="tiny-random", num_replica=2)
    with pytest.raises(ValueError, match="router must be one of"):
        build_app(model="tiny-random", router="random")
    with pytest.raises(ValueError, match="unknown key 'server.apikey'"):
        build_app(model="tiny-random", server={"apikey": "x"})
    with pytest.raises(ValueError, match="event_buffer_max_size must be > 0"):
        build_app(model="tiny-random", llm={"kv_cache_config": {"event_buffer_max_size": 0}})
    with pytest.raises(ValueError, match="match_timeout_s must be a number > 0"):
        build_app(model="tiny-random", match_timeout_s=0)
    build_app({"model": "tiny-random", "num_replicas": "3", "max_in_flight": "8"})  # serve run's strings, as YAML
