"""Tool calling on /v1/chat/completions, driven with the openai client's own types, streamed and
not: parsers (hermes, llama3_json) x tool_choice (auto, none, required, a named function).

The server runs SmolLM2's tokenizer with a tool template of each format (``chat_templates/``)
over a tiny random model of its vocabulary (``smollm2_tokenizer_checkpoint``: the text is
scripted, so the model only has to be fast); a scripted logits processor (``scripted``) makes
it write a known text, so what is tested is the server, not a model's choices. Where the grammar
decides (required, named), the script is made to want something else: the answer must still be a
call the schema allows. One test lets the model write what it likes (its random weights choose
the tokens; the grammar still rules a required call), and the last runs SmolLM2 itself with its
own template (which has no tool section).
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from tests.helpers.scripted import install, scripted
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.serve.errors import OpenAIError
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest
from tensorrt_llm.serve.server_config import ServerConfig
from tensorrt_llm.serve.tool_calling import plan_tools, template_messages
from tensorrt_llm.serve.tool_parsers import HERMES, TOOL_PARSERS

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def tool_server(request, smollm2_tokenizer_checkpoint):
    llm = LLM(str(smollm2_tokenizer_checkpoint), max_seq_len=1024, max_num_tokens=512,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128))
    sampler = install(llm)
    config = ServerConfig(tool_parser=request.param, chat_template=str(TEMPLATES / f"{request.param}_tools.jinja"))
    server = RunningServer(llm, config=config)
    server.parser = TOOL_PARSERS[request.param]
    server.sampler = sampler
    yield server
    server.stop()


def call_text(parser, *calls: tuple[str, dict]) -> str:
    """What a model of ``parser``'s format writes for ``calls``."""
    key = parser.syntax.argument_keys[0]
    bodies = [json.dumps({"name": name, key: args}) for name, args in calls]
    if parser.syntax.start:
        return "\n".join(f"{parser.syntax.start}\n{body}\n{parser.syntax.end}" for body in bodies)
    return "; ".join(bodies)


def ask(server, *, stream: bool, script: str | None = None, messages=ASK, **kwargs):
    """(content, [(name, arguments)], finish_reason), from the client's types; streamed, the
    deltas are joined as a client joins them, and checked for the OpenAI shape."""
    client = server.client()
    params = dict(model=server.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=80, **kwargs)
    with scripted(server.sampler, script) if script is not None else _nothing():
        if not stream:
            choice = client.chat.completions.create(**params).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls or [])
            return choice.message.content, calls, choice.finish_reason
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **params):
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    if call.index not in calls:  # a call's first delta: id, type, name
                        assert call.id and call.type == "function" and call.function.name
                        calls[call.index] = [call.function.name, call.function.arguments or "", 1]
                    else:  # then arguments fragments only
                        assert call.id is None and call.function.name is None
                        calls[call.index][1] += call.function.arguments
                        calls[call.index][2] += 1
                finish = choice.finish_reason or finish
        ask.fragments = [calls[i][2] for i in sorted(calls)]
        return content or None, [tuple(calls[i][:2]) for i in sorted(calls)], finish


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_schema_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) <= {"city", "days"} and args["city"] in ("Paris", "Tokyo")
        assert "days" not in args or isinstance(args["days"], int)
    else:
        assert name == "get_time" and set(args) == {"zone"} and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_returns_the_call_the_model_writes(tool_server, stream):
    script = call_text(tool_server.parser, ("get_weather", {"city": "Paris", "days": 2}))
    content, calls, finish = ask(tool_server, stream=stream, script=script)
    assert calls == [("get_weather", '{"city": "Paris", "days": 2}')] and finish == "tool_calls"
    assert not content
    if stream:
        assert ask.fragments[0] > 2  # the arguments came in several fragments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_two_calls_or_one_with_parallel_tool_calls_false(tool_server, stream):
    script = call_text(tool_server.parser, ("get_weather", {"city": "Tokyo"}), ("get_time", {"zone": "UTC"}))
    _, calls, finish = ask(tool_server, stream=stream, script=script)
    assert calls == [("get_weather", '{"city": "Tokyo"}'), ("get_time", '{"zone": "UTC"}')] and finish == "tool_calls"
    _, calls, _ = ask(tool_server, stream=stream, script=script, parallel_tool_calls=False)
    assert calls == [("get_weather", '{"city": "Tokyo"}')]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_text_and_malformed_calls_are_content(tool_server, stream):
    text = "It is sunny in Paris today."
    assert ask(tool_server, stream=stream, script=text) == (text, [], "stop")
    malformed = call_text(tool_server.parser, ("launch_rocket", {"when": "now"}))  # no such tool
    assert ask(tool_server, stream=stream, script=malformed) == (malformed, [], "stop")
    if tool_server.parser is HERMES:
        broken = "Let me see.\n<tool_call>\n{\"name\": get_weather}\n</tool_call>"  # not JSON
        assert ask(tool_server, stream=stream, script=broken) == (broken, [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_none_leaves_what_the_model_writes_as_text(tool_server, stream):
    script = call_text(tool_server.parser, ("get_weather", {"city": "Paris"}))
    assert ask(tool_server, stream=stream, script=script, tool_choice="none") == (script, [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_makes_a_call_the_schema_allows_whatever_the_model_wants(tool_server, stream):
    content, calls, finish = ask(tool_server, stream=stream, script="I would rather not call anything.",
                                 tool_choice="required")
    assert calls and finish == "tool_calls" and not content
    for name, arguments in calls:
        check_schema_call(name, arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_the_one_called(tool_server, stream):
    script = call_text(tool_server.parser, ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"}))
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = ask(tool_server, stream=stream, script=script, tool_choice=named)
    assert [name for name, _ in calls] == ["get_time"] and finish == "tool_calls" and not content
    check_schema_call(*calls[0])


def test_streamed_and_whole_agree_unscripted(tool_server):
    """The model choosing for itself (greedy): whatever it writes, both answers are the same, and a
    required call follows the schema. Random weights may keep calling until ``max_tokens``: the
    calls completed so far come back with finish reason ``length`` (an unfinished one as content,
    as any malformed call); with ``parallel_tool_calls`` off the grammar ends the output after one
    call."""
    for choice, parallel in (("auto", True), ("required", True), ("required", False)):
        whole = ask(tool_server, stream=False, tool_choice=choice, parallel_tool_calls=parallel)
        assert ask(tool_server, stream=True, tool_choice=choice, parallel_tool_calls=parallel) == whole
        if choice == "required":
            content, calls, finish = whole
            assert calls and finish in ("tool_calls", "length") and (finish == "length" or not content), whole
            for call in calls:
                check_schema_call(*call)
            if not parallel:
                assert len(calls) == 1 and finish == "tool_calls", whole


def test_tool_results_go_back_through_the_template(tool_server):
    conversation = [*ASK,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, clear"}]
    for stream in (False, True):
        content, calls, finish = ask(tool_server, stream=stream, script="It is 21 degrees.", messages=conversation)
        assert (content, calls, finish) == ("It is 21 degrees.", [], "stop")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": conversation, "tools": TOOLS})
    text = tool_server.llm.tokenizer.apply_chat_template(template_messages(body.messages), add_generation_prompt=True,
                                                        chat_template=tool_server.server.chat_template, tools=TOOLS)
    assert "21 degrees, clear" in text and '"city": "Paris"' in text and '"get_time"' in text
    with pytest.raises(openai.BadRequestError, match="arguments must be a JSON object") as error:
        bad = [*conversation[:1], {**conversation[1], "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "Paris"}}]}]
        ask(tool_server, stream=False, messages=bad)
    assert error.value.body["param"] == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}],
      "tool_choice": "required"}, "tools", "tools"),
])
def test_bad_tool_requests_are_refused_naming_the_field(tool_server, body, param, message):
    with tool_server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": tool_server.model, "messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and (error["param"] or "").startswith(param.split(".")[0]), error


def test_smollm2_own_template_has_no_tool_section(smollm2_server):
    """SmolLM2's template never reads ``tools``: the model cannot be shown them. Without a parser
    a call cannot be read either; with tool_choice none the tools are accepted and change nothing."""
    client = smollm2_server.client()
    with pytest.raises(openai.BadRequestError, match="--tool_parser") as error:
        client.chat.completions.create(model=smollm2_server.model, messages=ASK, tools=TOOLS)
    assert error.value.body["param"] == "tool_choice"
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS})
    with pytest.raises(OpenAIError, match="no tool section") as refused:
        plan_tools(body, HERMES, smollm2_server.llm.tokenizer.chat_template)
    assert refused.value.param == "tools"
    plain = client.chat.completions.create(model=smollm2_server.model, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model=smollm2_server.model, messages=ASK, max_tokens=1, tools=TOOLS,
                                                tool_choice="none")
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
