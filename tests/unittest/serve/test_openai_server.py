"""The OpenAI front over tiny-random (token-id prompts), driven over HTTP with the openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = [7, 3, 99, 150, 2, 48, 311, 5, 60, 61]


def prompt_of(length: int, seed: int) -> list[int]:
    return [1 + (seed * 131 + i * 37) % 500 for i in range(length)]


def metric_values(server) -> dict[str, float]:
    """Every sample of /prometheus/metrics, keyed by name plus labels."""
    text = httpx.get(f"{server.url}/prometheus/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_open_endpoints_and_api_key(tiny_server):
    base = tiny_server.url
    for path in ("/health", "/metrics", "/prometheus/metrics", "/version"):
        assert httpx.get(base + path, timeout=30).status_code == 200, path
    assert isinstance(httpx.get(base + "/version").json()["version"], str)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(base + "/v1/models", headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == 401 and "API key" in error["message"] and set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    models = tiny_server.http().get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny-random" and card["object"] == "model"
    assert isinstance(card["created"], int) and isinstance(card["owned_by"], str)
    assert [m.id for m in tiny_server.client().models.list()] == ["tiny-random"]


def test_completion_with_token_ids_and_usage(tiny_server):
    response = tiny_server.client().completions.create(model="tiny-random", prompt=PROMPT, max_tokens=6, temperature=0)
    (choice,) = response.choices
    assert choice.finish_reason == "length"
    assert len(choice.token_ids) == 6 and choice.text == ""  # no tokenizer: ids are the output
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (10, 6, 16)
    assert response.object == "text_completion" and response.model == "tiny-random"


def test_streaming_equals_non_streamed_and_reports_usage(tiny_server):
    client = tiny_server.client()
    whole = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens == len(PROMPT)
    # the wire format: SSE data lines ending in [DONE]
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    with tiny_server.http().stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "usage" not in json.loads(lines[-2][6:]) or json.loads(lines[-2][6:])["usage"] is None


def test_seed_makes_sampling_reproducible(tiny_server):
    client = tiny_server.client()

    def sample(seed: int) -> list[int]:
        response = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                             top_p=0.9, seed=seed)
        return response.choices[0].token_ids

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_concurrent_greedy_requests_equal_one_at_a_time(tiny_server):
    """16 requests in flight together (batched, chunked, sharing prefixes) give the tokens each
    gives alone."""
    shared = prompt_of(40, seed=1)
    prompts = [shared[: 20 + i] + prompt_of(3 + i, seed=i) if i % 2 else prompt_of(8 + 7 * i, seed=i) for i in range(16)]
    client = tiny_server.client()
    alone = [client.completions.create(model="tiny-random", prompt=p, max_tokens=6, temperature=0).choices[0].token_ids
             for p in prompts]

    async def together() -> list[list[int]]:
        async with tiny_server.async_client() as aclient:
            responses = await asyncio.gather(*(
                aclient.completions.create(model="tiny-random", prompt=p, max_tokens=6, temperature=0) for p in prompts))
        return [r.choices[0].token_ids for r in responses]

    assert asyncio.run(together()) == alone
    assert max(s.num_context_requests + s.num_generation_requests for s in tiny_server.executor.iteration_stats) > 1


BIG = 16 * 1024 * 1024


@pytest.mark.parametrize(
    "body, status, message, param",
    [
        ({"prompt": []}, 400, "the prompt is empty", "prompt"),
        ({"prompt": prompt_of(300, seed=3)}, 400, "exceeds max_seq_len 256", None),
        ({"prompt": PROMPT, "max_tokens": 250}, 400, "exceeds max_seq_len 256", None),
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"prompt": PROMPT, "n": 17}, 400, "less than or equal to 16", "n"),
        ({"prompt": PROMPT, "n": 2, "best_of": 1}, 400, "best_of (1) must be at least n (2)", None),
        ({"prompt": PROMPT, "best_of": 2, "stream": True}, 400, "best_of > n cannot stream", None),
        ({"prompt": PROMPT, "temperature": -0.5}, 400, "temperature", "temperature"),
        ({"prompt": [1, 2, 512]}, 400, "token id 512 is outside the vocabulary [0, 512)", None),
        ({"prompt": [1, -4]}, 400, "token id -4 is outside the vocabulary", None),
        ({"prompt": [1, 2.5]}, 400, "list of integer token ids", "prompt"),
        ({"prompt": [[1, 2], [3, 512]]}, 400, "prompt.1: token id 512 is outside the vocabulary", "prompt.1"),
        ({"prompt": "hello"}, 400, "has no tokenizer", "prompt"),
        ({"prompt": PROMPT, "stop": ["x"]}, 400, "stop sequences need a tokenizer", "stop"),
        ({"prompt": PROMPT, "logprobs": 21}, 400, "less than or equal to 20", "logprobs"),
        ({"prompt": PROMPT, "suffix": "x"}, 400, "suffix='x' is not supported", "suffix"),
        ({"prompt": PROMPT, "response_format": {"type": "json_object"}}, 400, "needs a tokenizer", "response_format"),
        ({"prompt": PROMPT, "frobnicate": 1}, 400, "unrecognized request argument 'frobnicate'", "frobnicate"),
        ({"prompt": PROMPT, "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist", "model"),
        ({}, 400, "prompt is required", "prompt"),
    ],
)
def test_bad_completion_requests_get_a_clear_error(tiny_server, body, status, message, param):
    with tiny_server.http() as http:
        response = http.post("/v1/completions", json={"model": "tiny-random", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status and error["param"] == param


def test_bad_requests_of_other_kinds(tiny_server):
    with tiny_server.http() as http:
        malformed = http.post("/v1/completions", content=b'{"model": "tiny-random", "prompt": [1, 2',
                              headers={"content-type": "application/json"})
        assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
        chat = http.post("/v1/chat/completions", json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
        too_big = http.post("/v1/completions", content=b" " * (BIG + 1), headers={"content-type": "application/json"})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == 413


def test_bad_input_disturbs_nothing(tiny_server):
    before = tiny_server.executor.health()
    client = tiny_server.client()
    expected = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0)
    for bad in ({"prompt": [1, 9999]}, {"prompt": []}, {"prompt": PROMPT, "n": 17}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-random", max_tokens=4, **bad)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
    again = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.choices[0].token_ids == expected.choices[0].token_ids
    after = tiny_server.executor.health()
    assert after.healthy and after.failed_batches == before.failed_batches


def test_client_disconnect_mid_stream_cancels_and_frees_its_blocks(tiny_server):
    before = metric_values(tiny_server)
    body = {"model": "tiny-random", "prompt": prompt_of(30, seed=11), "max_tokens": 220, "stream": True,
            "temperature": 0}
    with tiny_server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(4)]  # two events (each followed by a blank line)
    assert received[0].startswith("data: ")
    tiny_server.wait_idle()
    assert tiny_server.executor.load().kv.num_held == 0  # drained: every block free or cached
    after = metric_values(tiny_server)
    key = "trtllm_request_success_total{finished_reason=cancelled}"
    assert after[key] == before[key] + 1
    assert after["trtllm_generation_tokens_total"] - before["trtllm_generation_tokens_total"] < 220


def test_client_that_gives_up_on_a_non_streamed_request_cancels_it(tiny_server):
    before = metric_values(tiny_server)
    body = {"model": "tiny-random", "prompt": prompt_of(30, seed=12), "max_tokens": 220, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # 220 decode steps take far longer than 0.15 s
        tiny_server.http().post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    tiny_server.wait_idle()
    key = "trtllm_request_success_total{finished_reason=cancelled}"
    assert metric_values(tiny_server)[key] == before[key] + 1
    assert tiny_server.executor.load().kv.num_held == 0  # drained: every block free or cached


REQUIRED_METRICS = {
    "trtllm_num_requests_running": "gauge",
    "trtllm_num_requests_waiting": "gauge",
    "trtllm_kv_cache_usage_ratio": "gauge",
    "trtllm_prefix_cache_hit_tokens_total": "counter",
    "trtllm_prefix_cache_query_tokens_total": "counter",
    "trtllm_budget_deferrals_total": "counter",
    "trtllm_budget_overshoots_total": "counter",
    "trtllm_failed_batches_total": "counter",
    "trtllm_prompt_tokens_total": "counter",
    "trtllm_generation_tokens_total": "counter",
    "trtllm_request_success_total": "counter",
    "trtllm_iteration_forward_tokens": "histogram",
    "trtllm_budget_utilization": "histogram",
    "trtllm_time_to_first_token_seconds": "histogram",
    "trtllm_inter_token_latency_seconds": "histogram",
    "trtllm_e2e_request_latency_seconds": "histogram",
}


def test_prometheus_exposes_every_design_metric(tiny_server):
    for _ in range(2):  # the second finds the first's blocks in the prefix cache
        tiny_server.client().completions.create(model="tiny-random", prompt=PROMPT * 3, max_tokens=3)
    text = httpx.get(f"{tiny_server.url}/prometheus/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in REQUIRED_METRICS.items():
        family = families.get(name.removesuffix("_total"))
        assert family is not None and family.type == kind, name
        sample_names = {s.name for s in family.samples}
        assert (name if kind != "histogram" else f"{name}_count") in sample_names, name
    reasons = {s.labels["finished_reason"] for s in families["trtllm_request_success"].samples
               if s.name == "trtllm_request_success_total"}
    assert reasons == {"stop", "length", "error", "cancelled"}
    values = metric_values(tiny_server)
    assert values["trtllm_prompt_tokens_total"] >= 30 and values["trtllm_generation_tokens_total"] >= 3
    assert values["trtllm_prefix_cache_hit_tokens_total"] > 0
    assert 0.0 <= values["trtllm_kv_cache_usage_ratio"] <= 1.0


def test_iteration_statistics_are_a_bounded_ring(tiny_server):
    client = tiny_server.client()
    for i in range(3):
        client.completions.create(model="tiny-random", prompt=prompt_of(12, seed=40 + i), max_tokens=30)
    stats = tiny_server.http().get("/metrics").json()
    assert len(stats) == 64  # iter_stats_max_iterations of the fixture
    assert stats[-1]["iteration"] == tiny_server.executor.health().iterations - 1
    assert {"forward_tokens", "budget_utilization", "num_budget_deferrals", "error"} <= set(stats[-1])


def test_health_reports_ok_with_its_counters(tiny_server):
    response = httpx.get(f"{tiny_server.url}/health")
    body = response.json()
    assert response.status_code == 200 and body["status"] == "ok"
    assert {"iterations", "active_requests", "failed_batches", "budget_violations", "last_error"} <= set(body)


def test_time_to_first_token_is_measured(tiny_server):
    before = metric_values(tiny_server)
    start = time.monotonic()
    tiny_server.client().completions.create(model="tiny-random", prompt=PROMPT, max_tokens=2)
    elapsed = time.monotonic() - start
    after = metric_values(tiny_server)
    ttft = after["trtllm_time_to_first_token_seconds_sum"] - before["trtllm_time_to_first_token_seconds_sum"]
    assert after["trtllm_time_to_first_token_seconds_count"] == before["trtllm_time_to_first_token_seconds_count"] + 1
    assert 0 < ttft <= elapsed
