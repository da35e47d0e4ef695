"""``/v1/completions`` with several prompts in one request, as OpenAI and vLLM serve it.

``prompt`` as a list of strings (``tiny_chat_server``: SmolLM2's tokenizer over a tiny model)
or of token-id lists (``tiny_server``): each prompt is generated on its own, prompt ``i``'s
sample ``j`` is choice ``i * n + j``, usage sums every prompt and sample. Greedy (temperature
0), so every choice must be what the same prompt alone gives; a bad prompt fails the request
naming ``prompt.<i>`` before anything runs.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tensorrt_llm.serve.openai_protocol import MAX_PROMPTS

TEXTS = ["Write a short poem about the sea.", "The capital of France is", "1, 2, 3, 4,"]
TOKEN_PROMPTS = [[1, 504, 345, 282], [7, 8, 9], [300, 301, 302, 303, 304, 305]]  # tiny-random: 512 ids
MAX_TOKENS = 5
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _post(server, body: dict) -> httpx.Response:
    with server.http() as http:
        return http.post("/v1/completions", json={"model": server.model, **body})


def _alone(server, prompt, **fields) -> dict:
    """The same prompt, by itself: its one choice and its usage."""
    response = _post(server, {"prompt": prompt, **GREEDY, **fields})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 1
    return body


def _events(response: httpx.Response) -> list[dict]:
    """A stream's JSON events, checked to end with ``[DONE]``."""
    lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def _iterations(server) -> float:
    return server.server.metrics.registry.get_sample_value("trtllm_iterations_total")


def _cancelled(server) -> float:
    return server.server.metrics.registry.get_sample_value("trtllm_request_success_total",
                                                           {"finished_reason": "cancelled"})


# ------------------------------------------------------------------------------ non-streamed
def test_text_prompts_through_the_sdk_each_as_alone(tiny_chat_server):
    alone = [_alone(tiny_chat_server, text) for text in TEXTS]
    completion = tiny_chat_server.client().completions.create(
        model=tiny_chat_server.model, prompt=TEXTS, n=2, temperature=0.0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == list(range(2 * len(TEXTS)))
    for choice in completion.choices:  # prompt i's sample j is choice i * n + j
        single = alone[choice.index // 2]["choices"][0]
        assert choice.text == single["text"] and choice.finish_reason == "length"
        assert choice.model_extra["token_ids"] == single["token_ids"]
    usage = completion.usage
    assert usage.prompt_tokens == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage.completion_tokens == 2 * sum(a["usage"]["completion_tokens"] for a in alone) == 2 * 3 * MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_token_id_prompts_each_as_alone(tiny_server):
    alone = [_alone(tiny_server, ids) for ids in TOKEN_PROMPTS]
    response = _post(tiny_server, {"prompt": TOKEN_PROMPTS, "n": 2, **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice in body["choices"]:
        assert choice["token_ids"] == alone[choice["index"] // 2]["choices"][0]["token_ids"]
        assert len(choice["token_ids"]) == MAX_TOKENS
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in TOKEN_PROMPTS)
    assert body["usage"]["completion_tokens"] == 2 * len(TOKEN_PROMPTS) * MAX_TOKENS


def test_a_batch_of_one_is_the_single_prompt(tiny_chat_server):
    single = _alone(tiny_chat_server, TEXTS[1])
    batch = _alone(tiny_chat_server, [TEXTS[1]])
    assert batch["choices"] == single["choices"] and batch["usage"] == single["usage"]


def test_echo_logprobs_stop_and_best_of_per_prompt(tiny_chat_server):
    alone = [_alone(tiny_chat_server, text, echo=True, logprobs=2) for text in TEXTS[:2]]
    body = _post(tiny_chat_server, {"prompt": TEXTS[:2], "echo": True, "logprobs": 2, **GREEDY}).json()
    for choice, single in zip(body["choices"], alone):
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["text"].startswith(TEXTS[choice["index"]])
        assert choice["logprobs"] == single["choices"][0]["logprobs"]
    # A stop string cuts each prompt's text where its own text meets it (one met by prompt 1's text).
    generated = _alone(tiny_chat_server, TEXTS[1])["choices"][0]["text"]
    assert len(generated) >= 3, generated
    stop = generated[1:3]
    body = _post(tiny_chat_server, {"prompt": TEXTS[:2], "stop": [stop], **GREEDY}).json()
    for choice, text in zip(body["choices"], TEXTS[:2]):
        single = _alone(tiny_chat_server, text, stop=[stop])["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (single["text"], single["finish_reason"])
    assert body["choices"][1]["finish_reason"] == "stop" and body["choices"][1]["text"] == generated[:1]
    # best_of > n: each prompt's best sample, whole
    body = _post(tiny_chat_server, {"prompt": TEXTS[:2], "best_of": 2, "n": 1, **GREEDY}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 2 * 2 * MAX_TOKENS  # every sample generated counts


# ------------------------------------------------------------------------------ streamed
@pytest.mark.parametrize("fixture", ["tiny_chat_server", "tiny_server"])
def test_stream_interleaves_prompts_with_their_indices(request, fixture):
    server = request.getfixturevalue(fixture)
    prompts = TEXTS if fixture == "tiny_chat_server" else TOKEN_PROMPTS
    alone = [_alone(server, p) for p in prompts]
    body = {"model": server.model, "prompt": prompts, "n": 2, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = _events(response)
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    *chunks, last = events
    token_ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    previous = 0
    for event in chunks:
        (choice,) = event["choices"]
        index = choice["index"]
        assert index not in reasons or reasons[index][-1] is None, "a chunk after the choice's finish reason"
        token_ids.setdefault(index, []).extend(choice["token_ids"])
        texts[index] = texts.get(index, "") + choice["text"]
        reasons.setdefault(index, []).append(choice["finish_reason"])
        usage = event["usage"]  # cumulative over the whole request
        assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert previous <= usage["completion_tokens"] == usage["total_tokens"] - usage["prompt_tokens"]
        previous = usage["completion_tokens"]
    assert sorted(token_ids) == list(range(2 * len(prompts)))
    for index, ids in token_ids.items():
        single = alone[index // 2]["choices"][0]
        assert ids == single["token_ids"] and texts[index] == single["text"]
        assert reasons[index][-1] == "length" and set(reasons[index][:-1]) <= {None}
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 2 * len(prompts) * MAX_TOKENS
    assert last["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)


def test_stream_through_the_sdk(tiny_chat_server):
    alone = [_alone(tiny_chat_server, text)["choices"][0]["text"] for text in TEXTS[:2]]
    stream = tiny_chat_server.client().completions.create(
        model=tiny_chat_server.model, prompt=TEXTS[:2], temperature=0.0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts = ["", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == alone and usage.completion_tokens == 2 * MAX_TOKENS


def test_disconnect_cancels_every_prompt(tiny_server):
    before = _cancelled(tiny_server)
    body = {"model": tiny_server.model, "prompt": TOKEN_PROMPTS, "n": 2, "stream": True, "max_tokens": 200,
            "ignore_eos": True}
    with tiny_server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    tiny_server.wait_idle(timeout=30)
    deadline = time.monotonic() + 10  # the metrics are recorded as the cancelled generations end
    while _cancelled(tiny_server) < before + len(TOKEN_PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _cancelled(tiny_server) == before + len(TOKEN_PROMPTS)


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("prompt", "param", "message"), [
    ([TOKEN_PROMPTS[0], []], "prompt.1", "empty"),
    ([TOKEN_PROMPTS[0], TOKEN_PROMPTS[1], [1, 512]], "prompt.2", "token id 512 is outside the vocabulary"),
    ([[1, -3], TOKEN_PROMPTS[0]], "prompt.0", "token id -3 is outside the vocabulary"),
    ([TOKEN_PROMPTS[0], [5] * 254], "prompt.1", "exceeds max_seq_len 256"),
])
def test_a_bad_token_prompt_fails_the_batch_before_anything_runs(tiny_server, prompt, param, message):
    tiny_server.wait_idle()
    iterations = _iterations(tiny_server)
    for stream in (False, True):
        response = _post(tiny_server, {"prompt": prompt, "stream": stream, **GREEDY})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"]
    assert not tiny_server.executor.has_work and _iterations(tiny_server) == iterations


def test_a_bad_text_prompt_fails_the_batch_naming_it(tiny_chat_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_chat_server.client().completions.create(model=tiny_chat_server.model, prompt=[TEXTS[0], ""],
                                                     max_tokens=MAX_TOKENS)
    assert caught.value.body["param"] == "prompt.1"


@pytest.mark.parametrize(("prompt", "message"), [
    ([[1, 2]] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
    (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
    (["a", [1, 2]], "a list of strings or a list of token-id lists"),
    ([[1, 2], [3, True]], "token-id lists"),
])
def test_too_many_or_mixed_prompts_are_refused_naming_prompt(tiny_server, prompt, message):
    response = _post(tiny_server, {"prompt": prompt, **GREEDY})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and message in error["message"]


def test_the_cap_is_served(tiny_server):
    response = _post(tiny_server, {"prompt": [[1 + i, 2] for i in range(MAX_PROMPTS)], **GREEDY})
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == list(range(MAX_PROMPTS))
