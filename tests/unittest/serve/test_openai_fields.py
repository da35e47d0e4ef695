"""The OpenAI fields clients send: the field table walked over HTTP, and the fields benchmark
tools and SDKs send on every request (stream_options, cached_tokens, max_tokens forms, created)."""

from __future__ import annotations

import json
import logging
import typing

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from test_openai_server import metric_values, prompt_of

from tensorrt_llm.serve import openai_fields, openai_protocol
from tensorrt_llm.serve.openai_fields import CHAT, COMPLETIONS, Disposition

PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
HIT_TOKENS = "trtllm_prefix_cache_hit_tokens_total"


def base_body(endpoint: str, model: str) -> dict:
    if endpoint == COMPLETIONS:
        return {"model": model, "prompt": "The capital of France is", "max_tokens": 2}
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_the_table_and_the_request_models_agree():
    models = {COMPLETIONS: openai_protocol.CompletionRequest, CHAT: openai_protocol.ChatCompletionRequest}
    for endpoint, model in models.items():
        assert set(model.model_fields) == openai_fields.top_level_names(endpoint), endpoint
        nested = {r.name.split(".", 1)[1] for r in openai_fields.rules(endpoint) if r.name.startswith("stream_options.")}
        assert set(openai_protocol.StreamOptions.model_fields) == nested
    for rule in openai_fields.FIELDS:
        assert (rule.disposition is Disposition.REFUSED) == bool(rule.neutral), rule.name
        assert rule.origin in ("openai", "vllm", "trtllm") and rule.note


def test_every_field_of_the_openai_client_is_in_the_table():
    """What the openai SDK can send (its own request types) is each classified: served, ignored or
    refused by name, never 'unrecognized'."""
    for endpoint, module in ((CHAT, chat_params), (COMPLETIONS, completion_params)):
        sdk = set(typing.get_type_hints(module.CompletionCreateParamsStreaming)) | set(
            typing.get_type_hints(module.CompletionCreateParamsNonStreaming))
        assert sdk - openai_fields.top_level_names(endpoint) == set(), endpoint
    options = set(typing.get_type_hints(chat_params.ChatCompletionStreamOptionsParam))
    assert {f"stream_options.{name}" for name in options} <= {r.name for r in openai_fields.rules(CHAT)}


def test_the_docs_page_lists_every_row():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "openai-api.md").read_text()
    for rule in openai_fields.FIELDS:
        row = f"| `{rule.name}` | {rule.disposition.value if COMPLETIONS in rule.endpoints else '—'} |"
        assert row in page, rule.name


def _rows():
    return [(rule, endpoint) for rule in openai_fields.FIELDS for endpoint in sorted(rule.endpoints)]


def test_walk_the_table_over_http(tiny_chat_server, caplog):
    """Every row on every endpoint it names: served and ignored fields answered 200 (ignored ones
    logged at debug level, by name), refused ones 400 naming the field and 200 at their neutral
    values; a name in no row 400 naming it. The server is a chat model's whole request path
    (SmolLM2's tokenizer and template) over a tiny model: what is walked is the protocol."""
    caplog.set_level(logging.DEBUG, logger=openai_protocol.__name__)
    with tiny_chat_server.http() as http:
        for rule, endpoint in _rows():
            body = {**base_body(endpoint, tiny_chat_server.model), **rule.example_for(endpoint)}
            caplog.clear()
            response = http.post(PATHS[endpoint], json=body)
            where = f"{endpoint} {rule.name}: {response.status_code} {response.text[:300]}"
            if rule.disposition is Disposition.REFUSED:
                assert response.status_code == 400, where
                assert response.json()["error"]["param"] == rule.name and rule.note in response.text, where
                for neutral in rule.neutral:
                    ok = http.post(PATHS[endpoint], json={**base_body(endpoint, tiny_chat_server.model), rule.name: neutral})
                    assert ok.status_code == 200, f"{where}; neutral {neutral!r}: {ok.text[:200]}"
                continue
            assert response.status_code == 200, where
            if body.get("stream"):
                assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text, where
            logged = any(rule.name in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
            assert logged == (rule.disposition is Disposition.IGNORED), where
        for endpoint in (COMPLETIONS, CHAT):
            for typo in ("max_token", "frobnicate", "temprature"):
                response = http.post(PATHS[endpoint], json={**base_body(endpoint, tiny_chat_server.model), typo: 1})
                assert response.status_code == 400 and response.json()["error"]["param"] == typo, response.text
                assert "unrecognized request argument" in response.json()["error"]["message"]


# ---- the fields benchmark tools send ----------------------------------------------------------


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_put_cumulative_usage_on_every_chunk(smollm2_server, endpoint):
    body = {**base_body(endpoint, smollm2_server.model), "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with smollm2_server.http() as http:
        events = _events(http.post(PATHS[endpoint], json=body))
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    generated = 0
    for chunk in chunks:
        usage = chunk["usage"]
        generated += len(chunk["choices"][0].get("token_ids") or [])
        assert usage["completion_tokens"] == generated, chunks
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert generated == 6
    # without continuous_usage_stats only the last chunk has usage; stream_options {} asks for it (upstream, vLLM)
    with smollm2_server.http() as http:
        plain = _events(http.post(PATHS[endpoint], json={**body, "stream_options": {}}))
    assert all(e.get("usage") is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6


def test_cached_tokens_are_the_executors_prefix_hits_streamed_or_not(tiny_server):
    """A repeated prompt with block reuse on: usage.prompt_tokens_details.cached_tokens equals what
    the executor counted for that request (the Prometheus hit counter's increase), streamed or not."""
    prompt = prompt_of(70, seed=911)
    client = tiny_server.client()
    seen = []
    for stream in (False, False, True):
        tiny_server.wait_idle()
        before = metric_values(tiny_server)[HIT_TOKENS]
        if stream:
            chunks = list(client.completions.create(model="tiny-random", prompt=prompt, max_tokens=3, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=3, temperature=0).usage
        tiny_server.wait_idle()
        counted = metric_values(tiny_server)[HIT_TOKENS] - before
        assert usage.prompt_tokens_details.cached_tokens == counted, (stream, usage)
        seen.append(counted)
    assert seen[0] == 0 and seen[1] == seen[2] >= 64  # four 16-token blocks of 70 (and a partial one with partial reuse)


def test_cached_tokens_on_chat_with_continuous_usage(smollm2_server):
    body = {**base_body(CHAT, smollm2_server.model), "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with smollm2_server.http() as http:
        events = _events(http.post(PATHS[CHAT], json=body))
    # block reuse is off on this server: nothing is cached, and it says so once the first token is out
    # the role chunk goes out with the first token (when the hit is known), carrying none of them
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["usage"]["completion_tokens"] == 0
    assert all(e["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} for e in events)


def test_max_tokens_and_max_completion_tokens_are_one_field(smollm2_server, caplog):
    caplog.set_level(logging.DEBUG, logger=openai_protocol.__name__)
    client = smollm2_server.client()
    messages = [{"role": "user", "content": "Count to twenty."}]

    def generated(**kwargs) -> int:
        response = client.chat.completions.create(model=smollm2_server.model, messages=messages, temperature=0,
                                                  extra_body={"ignore_eos": True}, **kwargs)
        return response.usage.completion_tokens

    assert generated(max_tokens=3) == generated(max_completion_tokens=3) == generated(max_tokens=3,
                                                                                      max_completion_tokens=3) == 3
    assert generated(max_tokens=7, max_completion_tokens=4) == 4  # vLLM's rule: max_completion_tokens wins
    assert "max_completion_tokens is used" in caplog.text


def test_an_integral_float_count_is_an_integer(tiny_server):
    with tiny_server.http() as http:
        whole = http.post("/v1/completions", json={"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 4.0,
                                                   "n": 2.0, "temperature": 0})
        assert whole.status_code == 200, whole.text
        assert [len(c["token_ids"]) for c in whole.json()["choices"]] == [4, 4]
        for field, value in (("max_tokens", 16.5), ("n", 1.5), ("seed", 0.25)):
            refused = http.post("/v1/completions", json={"model": "tiny-random", "prompt": [1, 2, 3], field: value})
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == field, refused.text
            assert error["message"] == f"{field} must be an integer, got {value}"


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_created_is_one_value_for_every_chunk_of_a_response(smollm2_server, endpoint, monkeypatch):
    """Each call of the responses' default clock returns a new second: a chunk that took its own
    ``created`` would differ from the others."""
    ticks = iter(range(1_000_000_000, 2_000_000_000))
    monkeypatch.setattr(openai_protocol, "_now", lambda: next(ticks))
    body = {**base_body(endpoint, smollm2_server.model), "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with smollm2_server.http() as http:
        events = _events(http.post(PATHS[endpoint], json=body))
        whole = http.post(PATHS[endpoint], json={**body, "stream": False, "stream_options": None}).json()
    assert len(events) >= 6 and len({e["created"] for e in events}) == 1
    assert abs(events[0]["created"] - whole["created"]) < 5
