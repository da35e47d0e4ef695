"""The tool-call parsers alone: whole texts, every way of splitting them into streamed deltas, and
their grammars (compiled and walked with llguidance against SmolLM2's vocabulary)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm.serve.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    CallArgs,
    CallStart,
    Content,
    ParsedCall,
    get_tool_parser,
)

TOOLS = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET \\"x\\" }"}}'


def streamed(parser, text: str, cuts: list[int], max_calls=None):
    """Feed ``text`` cut at ``cuts`` (a repeated cut feeds an empty delta, as a token with no text
    does); return (content, calls as (name, arguments)) built from the events as a client builds
    them from deltas, and the stream."""
    stream = parser.stream(TOOLS, max_calls=max_calls)
    events = []
    previous = 0
    for cut in sorted(cuts) + [len(text)]:
        events += stream.push(text[previous:cut])
        previous = cut
    events += stream.finish()
    content, calls = "", {}
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index not in calls
            calls[event.index] = [event.name, ""]
        else:
            assert isinstance(event, CallArgs) and event.index in calls
            calls[event.index][1] += event.fragment
    return content, [tuple(calls[i]) for i in sorted(calls)], stream


HERMES_CASES = [
    # (text, content, calls)
    ("Hello there.", "Hello there.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", "Let me check.\n\n",
     [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"zone": "CET \\"x\\" }"}')]),
    # arguments first: sent whole once it closes
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>', "",
     [("get_weather", '{"city": "Rome"}')]),
    # an unknown function, not JSON, arguments not an object: content, marker included
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
    ('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', []),
    # the end marker missing at the end of the output: the complete call stands
    (f"<tool_call>\n{WEATHER}", "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    ("a < b and <tool_", "a < b and <tool_", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed_at_every_split(text, content, calls):
    parsed = HERMES.parse(text, TOOLS)
    assert parsed.content == content and parsed.calls == tuple(ParsedCall(*c) for c in calls)
    for cut in range(len(text) + 1):
        assert streamed(HERMES, text, [cut])[:2] == (content, calls), cut
    assert streamed(HERMES, text, list(range(len(text))))[:2] == (content, calls)  # one character at a time
    assert streamed(HERMES, text, [c for c in range(len(text)) for _ in "ab"])[:2] == (content, calls)  # and ''


@given(data=st.data())
def test_streamed_equals_whole_property(data):
    """Any split of any mix of text, calls and junk: the deltas joined are what the whole text
    parses to, unless a started call broke (then the whole text is content, and the stream says so)."""
    parts = data.draw(st.lists(st.sampled_from([
        "Sure. ", "x < y ", f"<tool_call>\n{WEATHER}\n</tool_call>", f"<tool_call>{TIME}</tool_call>",
        "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>", "<tool_call>junk</tool_call>", "\n",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "</tool_call>",
    ]), max_size=5))
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    parsed = HERMES.parse(text, TOOLS)
    content, calls, stream = streamed(HERMES, text, cuts)
    if stream.broken or stream.cut_in_call:
        assert parsed.content == text and parsed.calls == ()
    else:
        assert (content, calls) == (parsed.content, [(c.name, c.arguments) for c in parsed.calls])
        for name, arguments in calls:
            assert name in TOOLS and isinstance(json.loads(arguments), dict)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "arguments": {}}',
     "", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ("The weather is fine.", "The weather is fine.", []),
    ('  {"name": "nope", "parameters": {}}', '  {"name": "nope", "parameters": {}}', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed_at_every_split(text, content, calls):
    parsed = LLAMA3_JSON.parse(text, TOOLS)
    assert parsed.content == content and parsed.calls == tuple(ParsedCall(*c) for c in calls)
    for cut in range(len(text) + 1):
        assert streamed(LLAMA3_JSON, text, [cut])[:2] == (content, calls), cut


def test_a_call_that_breaks_after_it_started_is_content_whole_and_partial_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"} oops }\n</tool_call>'
    assert HERMES.parse(text, TOOLS).calls == () and HERMES.parse(text, TOOLS).content == text
    content, calls, stream = streamed(HERMES, text, [40])
    assert stream.broken and calls == [("get_weather", '{"city": "Paris"}')]


def test_one_call_drops_what_follows_the_first():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call> tail"
    assert [c.name for c in HERMES.parse(text, TOOLS, max_calls=1).calls] == ["get_weather"]
    assert streamed(HERMES, text, [10, 90], max_calls=1)[:2] == ("", [("get_weather", '{"city": "Paris", "days": [1, 2]}')])


def test_parser_names():
    assert get_tool_parser("qwen3") is HERMES and get_tool_parser("hermes") is HERMES
    assert get_tool_parser("llama3_json") is LLAMA3_JSON
    with pytest.raises(ValueError, match="unknown tool parser 'gpt'.*hermes"):
        get_tool_parser("gpt")


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}}, "required": ["city"]}},
    {"name": "get_time", "parameters": None},
]


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON], ids=lambda p: p.name)
@pytest.mark.parametrize("one_call", [True, False])
def test_call_grammar_accepts_the_format_and_the_schema_only(smollm2_tokenizer, parser, one_call):
    """The grammar, compiled for SmolLM2's vocabulary: a call of either function in the format
    passes token by token; a wrong name, a value outside the schema, or plain text does not; two
    calls pass unless one_call."""
    from tensorrt_llm._torch.pyexecutor.sampling.guided_decoder import GrammarCompiler, GuidedDecodingParams

    compiler = GrammarCompiler(smollm2_tokenizer, vocab_size=49152, end_ids=smollm2_tokenizer.stop_token_ids)
    grammar = compiler.compile(GuidedDecodingParams(grammar=parser.grammar(FUNCTIONS, one_call=one_call)))
    key = parser.syntax.argument_keys[0]

    def call(name: str, args: str) -> str:
        body = f'{{"name": "{name}", "{key}": {args}}}'
        return f"{parser.syntax.start}\n{body}\n{parser.syntax.end}" if parser.syntax.start else body

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        for token in smollm2_tokenizer.encode(text, add_special_tokens=False):
            if not bool(matcher.allowed()[token]):
                return False
            matcher.accept(token)
        return matcher.is_complete

    joiner = "\n" if parser.syntax.end else "; "
    assert accepts(call("get_weather", '{"city": "Paris", "days": 3}'))
    assert accepts(call("get_time", "{}"))
    assert not accepts(call("get_weather", '{"city": "Rome"}'))
    assert not accepts(call("launch", "{}"))
    assert not accepts("It is sunny.")
    assert accepts(call("get_time", "{}") + joiner + call("get_weather", '{"city": "Tokyo"}')) == (not one_call)


def test_a_call_after_a_broken_one_gets_an_index_of_its_own():
    """Pinned from the property above: a call whose JSON broke after its CallStart keeps index 0,
    so the next call is 1 (a client keyed by index would otherwise merge the two)."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par' + f"<tool_call>{TIME}</tool_call>"
    stream = HERMES.stream(TOOLS)
    events = stream.push(text) + stream.finish()
    starts = [event.index for event in events if isinstance(event, CallStart)]
    assert stream.broken and starts == sorted(set(starts)) and len(starts) >= 1
