"""Priority over HTTP: a real server (tiny-random on the CPU) at saturation.

Low-priority requests with long prompts fill the KV pool first; high-priority requests with
short prompts arrive while they run. Under ``waiting_queue_policy="priority"`` with preemption
every high-priority request finishes before any low-priority one, and every low-priority one
still finishes. The same traffic under ``fcfs`` serves them in arrival order (the comparison
shows the test can fail). The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig

NUM_LOW, NUM_HIGH = 6, 4
LOW_PROMPT, HIGH_PROMPT = 96, 8
LOW_TOKENS, HIGH_TOKENS = 96, 4


def _serve(policy: str) -> RunningServer:
    # 48 blocks of 8 tokens: the low-priority requests (96 + 96 tokens = 24 blocks each to
    # completion) hold the whole pool two at a time; the rest wait for KV memory.
    llm = LLM("tiny-random", dtype="float64", max_seq_len=256, max_num_tokens=64, max_batch_size=8,
              enable_chunked_prefill=True,
              kv_cache_config=KvCacheConfig(tokens_per_block=8, num_blocks=48, host_cache_size=1 << 20),
              scheduler_config={"waiting_queue_policy": policy, "enable_preemption": policy == "priority",
                                "preemption_cooldown_iterations": 4})
    return RunningServer(llm)


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % 250 for i in range(n)]


def _run(server: RunningServer) -> dict[str, list[tuple[float, float, int]]]:
    """Send the low-priority requests, then (once they are running) the high-priority ones;
    each class's (sent, finished, output tokens), seconds from the first send."""
    done: dict[str, list[tuple[float, float, int]]] = {"low": [], "high": []}
    lock = threading.Lock()
    t0 = time.monotonic()

    def send(cls: str, prompt: list[int], max_tokens: int, priority: float) -> None:
        sent = time.monotonic() - t0
        with server.http() as http:
            response = http.post("/v1/completions", json={
                "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority})
        assert response.status_code == 200, response.text
        tokens = response.json()["usage"]["completion_tokens"]
        with lock:
            done[cls].append((sent, time.monotonic() - t0, tokens))

    threads = [threading.Thread(target=send, args=("low", _prompt(LOW_PROMPT, i), LOW_TOKENS, 0.1))
               for i in range(NUM_LOW)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while server.executor.load().running < 2:  # saturated: the pool holds low-priority requests
        assert time.monotonic() < deadline, "the low-priority requests never started"
        time.sleep(0.005)
    high = [threading.Thread(target=send, args=("high", _prompt(HIGH_PROMPT, 100 + i), HIGH_TOKENS, 0.9))
            for i in range(NUM_HIGH)]
    for thread in high:
        thread.start()
    for thread in threads + high:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request hung"
    return done


def _figures(policy: str, done: dict, preemptions: float) -> str:
    def stats(cls: str) -> str:
        latencies = sorted(f - s for s, f, _ in done[cls])
        return (f"{cls}: {len(done[cls])} done, latency {latencies[0]:.3f}..{latencies[-1]:.3f} s,"
                f" last finished at {max(f for _, f, _ in done[cls]):.3f} s")
    return f"[{policy}] {stats('high')}; {stats('low')}; preemptions {preemptions:.0f}"


def _preemptions(server: RunningServer) -> float:
    text = httpx.get(f"{server.url}/prometheus/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("trtllm_preemptions_total "))
    return float(line.split()[1])


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_requests_finish_first_and_low_priority_ones_all_finish(one_torch_thread, policy):
    server = _serve(policy)
    try:
        done = _run(server)
        print("\n" + _figures(policy, done, _preemptions(server)))
        assert len(done["low"]) == NUM_LOW and all(tokens == LOW_TOKENS for _, _, tokens in done["low"])
        assert len(done["high"]) == NUM_HIGH and all(tokens == HIGH_TOKENS for _, _, tokens in done["high"])
        last_high = max(f for _, f, _ in done["high"])
        first_low = min(f for _, f, _ in done["low"])
        if policy == "priority":
            assert last_high < first_low, "a low-priority request finished before a high-priority one"
            assert _preemptions(server) > 0
        else:  # arrival order: the running low-priority requests finish first
            assert first_low < last_high
        server.wait_idle()
        assert server.executor.load().kv.num_held == 0
    finally:
        server.stop()


@pytest.mark.parametrize("value", [1.5, -0.1, "high", True, None])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_priority_is_a_400_naming_the_field(tiny_server, endpoint, value):
    body = {"model": tiny_server.model, "max_tokens": 2, "priority": value}
    body |= {"prompt": [1, 2, 3]} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = tiny_server.http().post(endpoint, json=body)
    if value is None:  # null: the default, 0.5 (chat: tiny-random has no template, refused for that reason)
        assert response.status_code == (200 if endpoint == "/v1/completions" else 400)
        if response.status_code == 400:
            assert response.json()["error"]["param"] != "priority"
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" or "priority" in error["message"], error


def test_a_priority_in_range_is_served_under_fcfs_too(tiny_server):
    response = tiny_server.http().post("/v1/completions", json={
        "model": tiny_server.model, "prompt": [1, 2, 3], "max_tokens": 2, "priority": 0.9})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
