"""A padded vocabulary over HTTP: a checkpoint whose ``vocab_size`` exceeds its tokenizer's.

Real checkpoints pad their vocabularies (Qwen2.5: 151,936 rows for 151,665 tokens) and a model
may sample a padded id. Such an id decodes to ``''`` (as transformers decodes it) and the request
goes on: streamed or not, completions and chat, log-probabilities included (a padded id's
``token`` is ``""``, ``bytes`` ``[]``). Prompt ids below the model's ``vocab_size`` are accepted;
an id at or above it is still refused.

The model (``hf_reference.write_padded_vocab_checkpoint``): SmolLM2's tokenizer (49,152 ids) over
a tiny Llama of 49,216 rows that writes the padded id ``PADDED`` after every real token and
`` yes`` after ``PADDED``, decisively (greedy and sampled alike).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.hf_reference import PADDED_VOCAB_ROWS, write_padded_vocab_checkpoint
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.llmapi.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

TOKENIZER_SIZE = 49152  # SmolLM2's
VOCAB_SIZE = TOKENIZER_SIZE + PADDED_VOCAB_ROWS
PADDED = TOKENIZER_SIZE + 17


@pytest.fixture(scope="module")
def yes_id(smollm2_tokenizer_checkpoint) -> int:
    (token,) = Tokenizer.from_hf_directory(smollm2_tokenizer_checkpoint).encode(" yes", add_special_tokens=False)
    return token


@pytest.fixture(scope="module")
def padded_server(tmp_path_factory, smollm2_tokenizer_checkpoint, yes_id):
    directory = write_padded_vocab_checkpoint(tmp_path_factory.mktemp("padded") / "padded-llama",
                                              smollm2_tokenizer_checkpoint, tokenizer_size=TOKENIZER_SIZE,
                                              padded_id=PADDED, text_id=yes_id)
    llm = LLM(str(directory), device="cpu", max_seq_len=512,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128))
    server = RunningServer(llm)
    yield server
    server.stop()


def events(response) -> list[dict]:
    """The JSON events of a streamed answer (``[DONE]`` checked and left out)."""
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and lines[-1] == "[DONE]", response.text[-500:]
    return [json.loads(line) for line in lines[:-1]]


def test_the_start_up_line_says_how_many_ids_the_tokenizer_lacks(padded_server):
    assert padded_server.llm.tokenizer.model_vocab_size == VOCAB_SIZE
    assert (f"vocabulary {VOCAB_SIZE} (tokenizer covers {TOKENIZER_SIZE}; {PADDED_VOCAB_ROWS} ids decode to '')"
            in padded_server.llm.describe())


def test_completions_generate_padded_ids_streamed_and_not(padded_server, yes_id):
    body = dict(model=padded_server.model, prompt="The capital of France is", max_tokens=9, temperature=0)
    with padded_server.http() as http:
        whole = http.post("/v1/completions", json=body)
        streamed = events(http.post("/v1/completions", json=dict(body, stream=True,
                                                                 stream_options={"include_usage": True})))
    assert whole.status_code == 200, whole.text
    choice, usage = whole.json()["choices"][0], whole.json()["usage"]
    assert choice["token_ids"] == [PADDED, yes_id] * 4 + [PADDED]
    assert choice["text"] == " yes" * 4 and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 9 and usage["prompt_tokens"] == 5
    chunks = [e["choices"][0] for e in streamed if e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["finish_reason"] == "length"
    assert streamed[-1]["usage"]["completion_tokens"] == 9


def test_chat_generates_padded_ids_streamed_and_not(padded_server):
    body = dict(model=padded_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    with padded_server.http() as http:
        whole = http.post("/v1/chat/completions", json=body)
        streamed = events(http.post("/v1/chat/completions", json=dict(body, stream=True,
                                                                      stream_options={"include_usage": True})))
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == " yes" * 3 and whole.json()["usage"]["completion_tokens"] == 6
    deltas = [e["choices"][0]["delta"] for e in streamed if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert streamed[-1]["usage"]["completion_tokens"] == 6


def test_sampled_requests_emit_padded_ids_and_finish(padded_server, yes_id):
    """Temperature 1 (what a benchmark client sends by default) samples the padded id too."""
    client = padded_server.client()
    for seed in range(3):
        choice = client.completions.create(model=padded_server.model, prompt="Once upon a time", max_tokens=8,
                                           temperature=1.0, seed=seed).choices[0]
        ids = choice.model_extra["token_ids"]
        assert PADDED in ids and len(ids) == 8 and choice.finish_reason == "length"
        assert choice.text == " yes" * ids.count(yes_id)


def test_logprobs_name_a_padded_id_with_no_text(padded_server, yes_id):
    """Chat: a padded id's entry is ``token: ""``, ``bytes: []``; completions: ``tokens`` still
    concatenate to the text and ``text_offset`` follows it."""
    with padded_server.http() as http:
        chat = http.post("/v1/chat/completions", json=dict(
            model=padded_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
            logprobs=True, top_logprobs=2)).json()
        text = http.post("/v1/completions", json=dict(
            model=padded_server.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [("", []), (" yes", list(b" yes"))] * 2
    assert content[0]["top_logprobs"][0] == {"token": "", "bytes": [], "logprob": content[0]["logprob"]}
    assert content[0]["logprob"] > -0.05  # decisive
    legacy = text["choices"][0]["logprobs"]
    assert legacy["tokens"] == ["", " yes", "", " yes"] and "".join(legacy["tokens"]) == text["choices"][0]["text"]
    assert legacy["text_offset"] == [0, 0, 4, 4]
    assert [len(top) for top in legacy["top_logprobs"]] == [2] * 4
    assert "" in legacy["top_logprobs"][0] and " yes" in legacy["top_logprobs"][1]


def test_prompt_ids_below_the_model_vocab_size_are_accepted(padded_server, yes_id):
    hello = padded_server.llm.tokenizer.encode("Hello", add_special_tokens=False)
    prompt = [*hello, PADDED, VOCAB_SIZE - 1, *hello]
    with padded_server.http() as http:
        accepted = http.post("/v1/completions", json=dict(model=padded_server.model, prompt=prompt, max_tokens=2,
                                                          temperature=0, echo=True))
        batch = http.post("/v1/completions", json=dict(model=padded_server.model, prompt=[prompt, hello],
                                                       max_tokens=2, temperature=0))
        refused = http.post("/v1/completions", json=dict(model=padded_server.model, prompt=[*hello, VOCAB_SIZE],
                                                         max_tokens=2, echo=True))
    assert accepted.status_code == 200, accepted.text
    # the echo (padded ids add nothing), then what the model wrote: the padded id and " yes"
    assert accepted.json()["choices"][0]["text"] == "HelloHello yes"
    assert accepted.json()["choices"][0]["token_ids"] == [PADDED, yes_id]
    assert accepted.json()["usage"]["prompt_tokens"] == len(prompt)
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2
    assert refused.status_code == 400  # checked before the echo decodes the prompt
    assert f"token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})" in refused.json()["error"]["message"]


def test_structured_output_never_allows_a_padded_id(padded_server):
    """The grammar masks every id without bytes: the model's favourite (the padded id) is never
    taken, and the answer is JSON."""
    chat = padded_server.client().chat.completions.create(
        model=padded_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "yes", "schema": {
            "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
            "additionalProperties": False}}})
    ids = chat.choices[0].model_extra["token_ids"]
    assert ids and max(ids) < TOKENIZER_SIZE
    assert json.loads(chat.choices[0].message.content) in ({"a": True}, {"a": False})


def test_stop_strings_cut_text_between_padded_ids(padded_server):
    choice = padded_server.client().completions.create(model=padded_server.model, prompt="Hello", max_tokens=12,
                                                       temperature=0, stop=["s y"]).choices[0]
    assert choice.text == " ye" and choice.finish_reason == "stop"
