"""The sampling fields people call with, each driven by the ``openai`` client against a
real server: logprobs (checked against a float64 reference forward), n, best_of, penalties,
min_tokens, stop_token_ids, echo and response_format.

tiny-random in float64 (``tiny_server``) where outputs are compared across runs or against a
reference computed here (its arithmetic does not depend on the batch); SmolLM2
(``smollm2_server``) where text, a chat template or a tokenizer matter.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tensorrt_llm._torch.models.checkpoints.gguf_loader import load_llama_from_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = [1 + (i * 37) % 500 for i in range(40)]  # 2 full blocks of 16 and a partial one
REPEATING = list(range(1, 40))  # tiny-random's greedy output repeats a token after it: penalties show
#: The served SmolLM2 (float16 weights, float32 arithmetic) against the float64 reference: its
#: log-probabilities agree to a few 1e-3 (measured: at most ~6e-3 over these tokens).
LOGPROB_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def smollm2_float64(smollm2_path):
    return load_llama_from_gguf(smollm2_path, dtype="float64")


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """(len(output), vocab): the float64 log-softmax predicting each output token, from one forward."""
    with torch.inference_mode():
        logits = model.forward_full(torch.tensor(prompt + output[:-1]))[len(prompt) - 1 :]
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def prompt_ids(server, messages) -> list[int]:
    tokenizer = server.llm.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ---- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_are_the_float64_reference_log_softmax(smollm2_server, smollm2_float64):
    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=3)
    (choice,) = client.chat.completions.create(**kwargs).choices
    entries = choice.logprobs.content
    tokens = choice.token_ids
    assert len(entries) == len(tokens) == 6
    reference = reference_logprobs(smollm2_float64, prompt_ids(smollm2_server, QUESTION), tokens)
    id_of = {raw: i for i, raw in enumerate(smollm2_server.llm.tokenizer.token_bytes())}
    worst = 0.0
    for entry, token, row in zip(entries, tokens, reference):
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token and id_of[bytes(entry.bytes)] == token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        listed = [(token, entry.logprob)] + [(id_of[bytes(a.bytes)], a.logprob) for a in entry.top_logprobs]
        worst = max(worst, *(abs(value - float(row[i])) for i, value in listed))
        # the alternatives are the reference's three most likely ids (a near-tie may swap two)
        assert {i for i, _ in listed[1:]} <= set(torch.topk(row, 4).indices.tolist())
    print(f"\nchat logprobs vs the float64 reference: max abs difference {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
    assert "".join(e.token for e in entries) == choice.message.content

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs_take_the_legacy_shape_streamed_or_not(smollm2_server):
    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, prompt="The capital of France is", max_tokens=5, temperature=0,
                  logprobs=2)
    (choice,) = client.completions.create(**kwargs).choices
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == logprobs.tokens
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset


# ---- n and best_of ----------------------------------------------------------------------------


def _hit_tokens(server) -> float:
    with server.http() as http:
        text = http.get("/prometheus/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("trtllm_prefix_cache_hit_tokens_total")))


def test_n_samples_share_the_prompt_blocks_and_each_is_charged(tiny_server):
    client = tiny_server.client()
    kwargs = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
    hits = _hit_tokens(tiny_server)
    first_iteration = len(tiny_server.executor.iteration_stats)
    response = client.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2]
    samples = [c.token_ids for c in response.choices]
    assert len({tuple(s) for s in samples}) == 3, samples  # sample i draws with seed + i
    assert response.usage.completion_tokens == 18 and response.usage.prompt_tokens == len(PROMPT)
    # samples 1 and 2 claimed sample 0's two full prompt blocks instead of computing them
    assert _hit_tokens(tiny_server) - hits >= 2 * 32
    stats = list(tiny_server.executor.iteration_stats)[first_iteration:]
    assert sum(s.forward_tokens for s in stats) >= len(PROMPT) + 2 * (len(PROMPT) - 32) + 3 * 5
    assert max(s.forward_tokens for s in stats) <= tiny_server.llm.config.max_num_tokens

    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = {i: [t for c in chunks for t in c.choices[0].token_ids if c.choices[0].index == i] for i in range(3)}
    assert [streamed[i] for i in range(3)] == samples
    assert sorted(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason) == ["length"] * 3


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(tiny_server):
    client = tiny_server.client()
    kwargs = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11, logprobs=0)
    every = client.completions.create(**kwargs, n=4).choices
    cumulative = [sum(c.logprobs.token_logprobs) for c in every]
    best = client.completions.create(**kwargs, n=2, best_of=4)
    ranked = sorted(range(4), key=lambda i: cumulative[i], reverse=True)[:2]
    assert [c.token_ids for c in best.choices] == [every[i].token_ids for i in ranked]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 4 * 5  # every sample drawn is generated, and counted
    without = client.completions.create(**{**kwargs, "logprobs": None}, n=1, best_of=4).choices
    assert without[0].logprobs is None and without[0].token_ids == every[ranked[0]].token_ids


def test_beam_search_returns_the_n_best_beams_on_both_endpoints(tiny_server):
    """use_beam_search with best_of beams, as upstream's trtllm-serve takes it: the n best beams,
    the same as the LLM API's, streamed or not; early_stopping "never" and length_penalty pass through."""
    from tensorrt_llm.llmapi.llm import SamplingParams

    client = tiny_server.client()
    beam = {"use_beam_search": True, "length_penalty": 1.0, "early_stopping": "never"}
    kwargs = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=4, n=2, best_of=3, extra_body=beam)
    response = client.completions.create(**kwargs)
    expected = tiny_server.llm.generate(PROMPT, SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=4,
                                                               length_penalty=1.0, early_stopping=2))
    assert [c.token_ids for c in response.choices] == [c.token_ids for c in expected.outputs]
    assert [c.index for c in response.choices] == [0, 1] and response.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = {c.choices[0].index: c.choices[0].token_ids for c in chunks if c.choices}
    assert [streamed[0], streamed[1]] == [c.token_ids for c in expected.outputs]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(**{**kwargs, "temperature": 0.5})


# ---- penalties, min_tokens, stop_token_ids ------------------------------------------------------


def penalized_greedy(model, prompt, max_tokens, *, frequency=0.0, presence=0.0, repetition=1.0) -> list[int]:
    """Greedy decoding with the penalties as OpenAI and vLLM define them, over a full forward each
    step (the test's own oracle: a loop over ids, no tensor tricks)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model.forward_full(torch.tensor(tokens))[-1].to(torch.float64).tolist()
            output = tokens[len(prompt):]
            for token in set(tokens):
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            for token in set(output):
                logits[token] -= frequency * output.count(token) + presence
            tokens.append(max(range(len(logits)), key=logits.__getitem__))
    return tokens[len(prompt):]


@pytest.mark.parametrize("penalties", [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=-0.5),
    dict(repetition_penalty=3.0),
])
def test_penalties_follow_their_definition(tiny_server, penalties):
    model = tiny_server.executor.model_engine.model
    client = tiny_server.client()
    names = {"frequency_penalty": "frequency", "presence_penalty": "presence", "repetition_penalty": "repetition"}
    expected = penalized_greedy(model, REPEATING, 12, **{names[k]: v for k, v in penalties.items()})
    plain = client.completions.create(model=tiny_server.model, prompt=REPEATING, max_tokens=12, temperature=0)
    extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
    official = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    got = client.completions.create(model=tiny_server.model, prompt=REPEATING, max_tokens=12, temperature=0,
                                    extra_body=extra, **official)
    assert got.choices[0].token_ids == expected
    assert expected != plain.choices[0].token_ids  # the penalty changed the output: the test can fail


def test_min_tokens_and_stop_token_ids(smollm2_server):
    client = smollm2_server.client()
    messages = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    kwargs = dict(model=smollm2_server.model, messages=messages, max_tokens=40, temperature=0)
    free = client.chat.completions.create(**kwargs)
    (choice,) = free.choices
    assert choice.finish_reason == "stop" and len(choice.token_ids) < 15
    longer = client.chat.completions.create(**kwargs, extra_body={"min_tokens": len(choice.token_ids) + 5})
    assert longer.usage.completion_tokens >= len(choice.token_ids) + 5
    assert longer.choices[0].token_ids[: len(choice.token_ids) - 1] == choice.token_ids[:-1]

    tokens = choice.token_ids
    stop_at = 1 if tokens[1] not in tokens[:1] else 2
    stopped = client.chat.completions.create(**kwargs, extra_body={"stop_token_ids": [tokens[stop_at]]})
    assert stopped.choices[0].token_ids == tokens[: stop_at + 1] and stopped.choices[0].finish_reason == "stop"


# ---- echo -----------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_text(smollm2_server, tiny_server):
    client = smollm2_server.client()
    prompt = "The capital of France is"
    kwargs = dict(model=smollm2_server.model, prompt=prompt, max_tokens=4, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True).choices[0]
    assert echoed.text == prompt + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, echo=True, stream=True))
    assert streamed == prompt + plain
    # token-id prompts are echoed as their text; a model without a tokenizer has none
    ids = smollm2_server.llm.tokenizer.encode(prompt)
    assert client.completions.create(**{**kwargs, "prompt": ids}, echo=True).choices[0].text == prompt + plain
    tiny = tiny_server.client().completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=2, echo=True)
    assert tiny.choices[0].text == "" and len(tiny.choices[0].token_ids) == 2


def test_echo_with_logprobs_scores_the_prompt_against_the_float64_reference(smollm2_server, smollm2_float64):
    client = smollm2_server.client()
    prompt = "The capital of France is"
    ids = smollm2_server.llm.tokenizer.encode(prompt)
    kwargs = dict(model=smollm2_server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    (choice,) = client.completions.create(**kwargs).choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 3 and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first
    reference = reference_logprobs(smollm2_float64, ids[:1], ids[1:] + choice.token_ids)
    scored = logprobs.token_logprobs[1:]
    worst = max(abs(value - float(row[token])) for value, row, token in zip(scored, reference, ids[1:] + choice.token_ids))
    print(f"\nprompt and output logprobs vs the float64 reference: max abs difference {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        logprobs.token_logprobs


def test_prompt_logprobs_are_computed_even_where_the_prefix_is_cached(tiny_server):
    """A request asking for its prompt's log-probabilities claims no cached block (its every
    prompt position must be computed), so a prompt scored twice is scored whole twice."""
    client = tiny_server.client()
    kwargs = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, temperature=0)
    client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=1)  # caches the prompt's blocks
    hits = _hit_tokens(tiny_server)
    first = client.completions.create(**kwargs).choices[0].logprobs
    second = client.completions.create(**kwargs).choices[0].logprobs
    assert _hit_tokens(tiny_server) == hits
    assert first.token_logprobs[0] is None and None not in first.token_logprobs[1:]
    assert second.token_logprobs == first.token_logprobs and len(first.tokens) == len(PROMPT) + 2
    model = tiny_server.executor.model_engine.model
    expected = reference_logprobs(model, PROMPT[:1], PROMPT[1:])
    assert first.token_logprobs[1 : len(PROMPT)] == pytest.approx(
        [float(row[t]) for row, t in zip(expected, PROMPT[1:])], abs=1e-9)


# ---- structured output ---------------------------------------------------------------------


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def test_response_format_json_object_and_json_schema(smollm2_server):
    from jsonschema import validate

    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, messages=QUESTION, max_tokens=60, temperature=0)
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)  # unguided, the model answers in prose: the format below is the grammar's doing
    as_object = client.chat.completions.create(**kwargs, response_format={"type": "json_object"}).choices[0]
    assert isinstance(json.loads(as_object.message.content), dict) and as_object.finish_reason == "stop"
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    as_schema = client.chat.completions.create(**kwargs, response_format=response_format).choices[0]
    validate(json.loads(as_schema.message.content), SCHEMA)
    chunks = client.chat.completions.create(**kwargs, response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == as_schema.message.content


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json: Invalid type"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is given with type 'json_schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos cannot be honoured"),
    ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_values_the_engine_cannot_honour_are_refused_naming_the_field(smollm2_server, body, message):
    with pytest.raises(openai.BadRequestError) as refused:
        smollm2_server.client().chat.completions.create(model=smollm2_server.model, messages=QUESTION, max_tokens=4,
                                                        extra_body=body)
    assert message in refused.value.body["message"]


def test_each_chat_choice_stops_at_its_own_stop_string_streamed_or_not(smollm2_server):
    client = smollm2_server.client()
    kwargs = dict(model=smollm2_server.model, messages=QUESTION, max_tokens=20, temperature=0)
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    cut = free[: free.index(stop)]
    both = client.chat.completions.create(**kwargs, n=2, stop=stop)
    assert [(c.index, c.message.content, c.finish_reason) for c in both.choices] == [(0, cut, "stop"), (1, cut, "stop")]
    chunks = list(client.chat.completions.create(**kwargs, n=2, stop=stop, stream=True))
    assert [c.index for c in chunks[0].choices] == [0, 1] and chunks[0].choices[0].delta.role == "assistant"
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[1:] if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == cut and mine[-1].finish_reason == "stop"
    smollm2_server.wait_idle()  # both samples were cancelled in the executor
