"""Tools on ``/v1/chat/completions``: what a request's ``tools`` and ``tool_choice`` ask of the
server (:func:`plan_tools`, a value), the conversation as the chat template takes it
(:func:`template_messages`), and the answer: a whole message (:func:`message_of`) or streamed
deltas (:class:`ToolDeltas`).

==================  ===============================  =====================================
``tool_choice``     the prompt                        the output
==================  ===============================  =====================================
``none``            tools rendered by the template    text, not parsed
``auto`` (default)  tools rendered                    parsed (``--tool_parser``): calls and text
``required``        tools rendered                    grammar: one call or more of the tools
a named function    tools rendered                    grammar: one call of that function
==================  ===============================  =====================================

The grammar is the parser's own format around each function's JSON schema, so the arguments of
a required or named call always validate. A model whose chat template has no tool section
(SmolLM2's) cannot be shown the tools: ``auto``, ``required`` and a named function are refused
(400 naming ``tools``) unless the server was started with a ``--chat_template`` that has one;
with ``none`` the tools are accepted and, as the template ignores them, change nothing.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Iterator

from tensorrt_llm._torch.pyexecutor.sampling.guided_decoder import GuidedDecodingParams
from tensorrt_llm.serve.errors import bad_request
from tensorrt_llm.serve.openai_protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tensorrt_llm.serve.tool_parsers import CallArgs, CallStart, Content, ToolCallStream, ToolParser


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools ask for. ``parser`` None: the output is not parsed."""

    parser: ToolParser | None = None
    tool_names: tuple[str, ...] = ()
    max_calls: int | None = None  # 1 with parallel_tool_calls: false
    grammar: GuidedDecodingParams | None = None  # required / named: the calls the output must be
    template_tools: list[dict] | None = None  # handed to the chat template as ``tools``

    def stream(self) -> ToolCallStream | None:
        return None if self.parser is None else self.parser.stream(self.tool_names, max_calls=self.max_calls)


@functools.lru_cache(maxsize=16)
def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (has a tool section)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None, template: str | None) -> ToolPlan:
    """The plan for ``body``'s tools, with the server's ``parser`` (``--tool_parser``) and chat
    ``template``; OpenAIError (400, naming the field) for what cannot be served."""
    if not body.tools:
        return ToolPlan()
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = body.tool_choice_value
    if choice == "none":
        return ToolPlan(template_tools=tools)
    if parser is None:
        raise bad_request(f"tool_choice {choice!r} needs a tool-call parser: start the server with --tool_parser"
                          " (hermes, qwen3, llama3_json, ...)", "tool_choice")
    if not template or not template_renders_tools(template):
        raise bad_request("the chat template has no tool section, so the model cannot be shown the tools; serve it"
                          " with --chat_template FILE (a template that renders tools) or send tool_choice 'none'",
                          "tools")
    names = tuple(tool["function"]["name"] for tool in tools)
    one_call = body.parallel_tool_calls is False
    grammar = None
    if choice in ("required", "function"):
        if body.response_format is not None and body.response_format.type != "text":
            raise bad_request(f"response_format cannot be combined with tool_choice {choice!r}: the output is the"
                              " call", "response_format")
        functions = [tool["function"] for tool in tools]
        if choice == "function":
            functions = [f for f in functions if f["name"] == body.tool_choice.function.name]
            one_call = True
        grammar = GuidedDecodingParams(grammar=parser.grammar(functions, one_call=one_call))
    return ToolPlan(parser, names, 1 if one_call else None, grammar, tools)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as chat templates take it (transformers' convention): an assistant's
    ``tool_calls`` with their ``arguments`` as a mapping (templates write it with ``tojson``), a
    tool message's ``tool_call_id``. Arguments that are not a JSON object are a 400 naming them."""
    out = []
    for i, message in enumerate(messages):
        entry: dict = {"role": message.role, "content": message.content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise bad_request("a tool call's arguments must be a JSON object",
                                      f"messages.{i}.tool_calls.{j}.function.arguments")
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's: ``tool_calls`` when the model stopped after calling; ``length`` stays ``length``."""
    return "tool_calls" if calls and reason == "stop" else reason


def message_of(plan: ToolPlan, text: str) -> tuple[ChatCompletionMessage, int]:
    """A whole choice's message (content null when it is only calls) and its number of calls."""
    if plan.parser is None:
        return ChatCompletionMessage(content=text), 0
    parsed = plan.parser.parse(text, plan.tool_names, max_calls=plan.max_calls)
    calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls]
    content = parsed.content if parsed.content or not calls else None
    return ChatCompletionMessage(content=content, tool_calls=calls or None), len(calls)


class ToolDeltas:
    """One streamed choice's text in, OpenAI deltas out: content, and each call as a first delta
    (``id``, ``type``, ``function.name``, ``arguments: ""``) then ``arguments`` fragments."""

    def __init__(self, stream: ToolCallStream) -> None:
        self._stream = stream
        self._ids: dict[int, str] = {}

    @property
    def calls(self) -> int:
        return len(self._ids)

    def deltas(self, text: str, last: bool) -> Iterator[DeltaMessage]:
        events = self._stream.push(text)
        if last:
            events += self._stream.finish()
        for event in events:
            if isinstance(event, Content):
                yield DeltaMessage(content=event.text)
            elif isinstance(event, CallStart):
                call_id = self._ids[event.index] = f"call_{uuid.uuid4().hex[:24]}"
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, id=call_id, type="function",
                                                             function=DeltaFunctionCall(name=event.name, arguments=""))])
            elif isinstance(event, CallArgs):
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=event.index,
                                                             function=DeltaFunctionCall(arguments=event.fragment))])

