"""Two replicas of the OpenAI server under Ray Serve, in a local Ray cluster on this machine:
requests through Ray Serve's HTTP proxy, the prefix-aware router, the load bound, streaming,
health and metrics for the application, and a replica killed mid-request.

The replicas run the simulated engine (the real executor, KV manager, events and server; no
model arithmetic), so a request's length is set by the cost formula and the test is quick.
Ray Serve is the ``[ray]`` extra (in the test extra); the test is skipped without it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from tensorrt_llm.serve.ray_serve import build_app  # noqa: E402
from tensorrt_llm.serve.ray_serve.prefix_index import request_keys  # noqa: E402
from tensorrt_llm.serve.ray_serve.registry import NAMESPACE, registry_name  # noqa: E402

pytestmark = pytest.mark.slow

APP = "trtllm"
TPB = 16
SIMULATED = {"step_s": 0.02, "context_token_s": 1e-4}  # 20 ms a decode step: requests overlap


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # match_timeout_s: the tests check the routing rule; on a starved 2-core machine the registry's answer
    # can take longer than the default 0.5 s, and a request routed without it is balanced instead
    app = build_app(model="tiny-random", num_replicas=2, router="prefix_aware", max_load_gap=1, match_timeout_s=10.0,
                    replica_num_cpus=0.5, ingress_num_cpus=0.5, report_period_s=0.2, health_check_period_s=1.0,
                    llm={"simulated_engine": SIMULATED, "max_seq_len": 1024,
                         "kv_cache_config": {"tokens_per_block": TPB, "num_blocks": 512}})
    serve.run(app, name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    _wait_for(lambda: httpx.get(f"{url}/health").json().get("healthy_replicas") == 2, "both replicas reporting")
    yield url
    serve.shutdown()
    ray.shutdown()


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)


def _wait_cached(prompt: list[int], replica: str) -> None:
    """Until the router's registry holds every full block of ``prompt`` on ``replica``: the replica
    pushes its events every report_period_s / 4, later on a loaded machine, and a request routed
    before they arrive is balanced instead."""
    registry = ray.get_actor(registry_name(APP), namespace=NAMESPACE)
    keys = request_keys(prompt, TPB)
    _wait_for(lambda: ray.get(registry.match.remote(keys, [replica]), timeout=10)[replica] == len(keys),
              "the prompt's blocks registered on its replica")


def _prompt(seed: int, length: int = 80) -> list[int]:
    return [1 + (seed * 131 + i * 17) % 500 for i in range(length)]


def test_a_cached_prefix_brings_its_requests_back_to_its_replica(cluster):
    """A prompt served once is cached on one replica; that replica's events reach the router,
    and every later request sharing the prefix (a follow-up turn) goes there and hits."""
    prompt = _prompt(1)
    first = _complete(cluster, prompt)
    assert first.status_code == 200, first.text
    home = first.headers["x-trtllm-replica"]
    _wait_cached(prompt, home)
    for turn in range(4):
        follow_up = prompt + _prompt(100 + turn, 20)
        response = _complete(cluster, follow_up)
        assert response.headers["x-trtllm-replica"] == home, turn
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # 4 full blocks of 16


def test_a_hot_prefix_spills_over_the_load_bound(cluster):
    """Eight concurrent requests on one cached prefix, max_load_gap=1: the prefix's replica takes
    them until it is two requests ahead of the other (so at least the first two), which then takes
    its share. How the rest split is not fixed: once a spilled request has run on the other
    replica, that replica holds the prefix too, and the router balances between the two holders
    (how many arrive before that depends on the machine's speed). Every request the home replica
    serves reuses the prefix."""
    prompt = _prompt(2)
    home = _complete(cluster, prompt).headers["x-trtllm-replica"]
    _wait_cached(prompt, home)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: _complete(cluster, prompt + [7 + i] * 3, max_tokens=40), range(8)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = [r.headers["x-trtllm-replica"] for r in responses]
    assert len(set(served)) == 2, served  # it spilled
    assert served.count(home) >= 2, served  # the first two go home: the bound lets it run one ahead
    at_home = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses
               if r.headers["x-trtllm-replica"] == home]
    assert all(cached >= 80 for cached in at_home), at_home  # the prompt's 5 full blocks of 16


def test_streaming_and_errors_through_the_proxy_are_the_servers(cluster):
    body = {"prompt": _prompt(3), "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    bad = httpx.post(f"{cluster}/v1/completions", json={"prompt": [1, 2], "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(f"{cluster}/v1/completions", json={"model": "nope", "prompt": [1]}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
    text = httpx.post(f"{cluster}/v1/completions", json={"prompt": "text"}, timeout=30)
    assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]


def test_health_and_metrics_answer_for_every_replica(cluster):
    health = httpx.get(f"{cluster}/health", timeout=30)
    assert health.status_code == 200 and health.json()["healthy_replicas"] == 2
    names = set(health.json()["replicas"])
    metrics = httpx.get(f"{cluster}/prometheus/metrics", timeout=30).text
    assert len(names) == 2
    for name in names:
        assert f'trtllm_num_requests_running{{replica="{name}"}}' in metrics
    assert metrics.count("# TYPE trtllm_prefix_cache_hit_tokens_total counter") == 1  # one family, both replicas


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_and_is_replaced(cluster):
    """The stream's replica is killed after its first token: the client gets an error event and
    [DONE] (no hang); Ray Serve starts a replacement; new requests are served meanwhile."""
    body = {"prompt": _prompt(4), "max_tokens": 400, "stream": True}  # 400 steps of 20 ms
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=30) as response:
        victim = response.headers["x-trtllm-replica"]
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2].removeprefix("data: ")), rest[-2:]
    assert _complete(cluster, _prompt(5)).status_code == 200  # the survivor serves

    def replaced() -> bool:
        replicas = httpx.get(f"{cluster}/health", timeout=10).json()["replicas"]
        return victim not in replicas and sum(r["healthy"] for r in replicas.values()) == 2

    _wait_for(replaced, "Ray Serve to replace the killed replica", timeout_s=90)
