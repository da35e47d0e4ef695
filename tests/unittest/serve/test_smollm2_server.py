"""The OpenAI front over the real model: text in, text out, chat through the model's template."""

from __future__ import annotations

import json

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_text_completion_detokenizes_its_tokens(smollm2_server):
    tokenizer = smollm2_server.llm.tokenizer
    prompt = "The capital of France is"
    response = smollm2_server.client().completions.create(model=smollm2_server.model, prompt=prompt, max_tokens=6,
                                                          temperature=0)
    (choice,) = response.choices
    assert choice.text and choice.text == tokenizer.decode(choice.token_ids)
    assert "Paris" in choice.text
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert response.usage.completion_tokens == len(choice.token_ids) == 6 and choice.finish_reason == "length"


def test_streamed_text_deltas_equal_the_whole_text(smollm2_server):
    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(deltas) == whole and len([d for d in deltas if d]) > 1


def test_chat_answers_with_text_and_streams_the_same(smollm2_server):
    client, tokenizer = smollm2_server.client(), smollm2_server.llm.tokenizer
    response = client.chat.completions.create(model=smollm2_server.model, messages=QUESTION, max_tokens=20,
                                              temperature=0)
    (choice,) = response.choices
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the model ended its turn (<|im_end|>) before max_tokens
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered))
    chunks = list(client.chat.completions.create(model=smollm2_server.model, messages=QUESTION, max_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_stop_string_cuts_the_text_streamed_or_not(smollm2_server):
    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, prompt="The capital of France is", max_tokens=12, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # three characters from the middle
    assert stop.strip(), free
    cut = free[: free.index(stop)]
    stopped = client.completions.create(**kwargs, stop=[stop, "never-said"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    smollm2_server.wait_idle()  # the stop cancelled the request in the executor


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": ""}, "the prompt is empty"),
        ("/v1/completions", {"prompt": "word " * 1100}, "exceeds max_seq_len 1024"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "only text content parts are supported"),
        ("/v1/chat/completions", {"messages": QUESTION, "tools": []}, "tools: List should have at least 1 item"),
        ("/v1/chat/completions", {"messages": QUESTION, "tool": []}, "unrecognized request argument 'tool'"),
    ],
)
def test_bad_text_requests_get_a_clear_error(smollm2_server, path, body, message):
    with smollm2_server.http() as http:
        response = http.post(path, json={"model": smollm2_server.model, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_a_detokenizer_error_fails_its_request_alone(smollm2_server, monkeypatch, caplog):
    """Text that cannot be decoded (here: the tokenizer made to fail on one id) ends that request
    with an error, a 500 body or, streamed, an error event and then [DONE]; the next request is
    served, and the log has one line for it, no traceback."""
    client, tokenizer = smollm2_server.client(), smollm2_server.llm.tokenizer
    kwargs = dict(model=smollm2_server.model, prompt="The capital of France is", max_tokens=6, temperature=0)
    poison = client.completions.create(**kwargs).choices[0].token_ids[2]
    other = dict(kwargs, prompt="One, two, three,", max_tokens=4)
    expected = client.completions.create(**other).choices[0].token_ids
    assert poison not in expected
    decode = tokenizer.decode

    def failing_decode(ids, **options):
        if poison in ids:
            raise ValueError(f"token id {poison} cannot be decoded")
        return decode(ids, **options)

    monkeypatch.setattr(tokenizer, "decode", failing_decode)
    with smollm2_server.http() as http:
        whole = http.post("/v1/completions", json=kwargs)
        streamed = http.post("/v1/completions", json=dict(kwargs, stream=True))
        served = http.post("/v1/completions", json=other)
    assert whole.status_code == 500
    assert "DetokenizationError" in whole.json()["error"]["message"] and f"token id {poison}" in whole.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert "DetokenizationError" in json.loads(events[-2])["error"]["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["token_ids"] == expected
    smollm2_server.wait_idle()  # the failed requests were cancelled in the executor
    assert "Traceback" not in caplog.text
    assert sum("DetokenizationError" in r.getMessage() for r in caplog.records) == 2  # one line per request
