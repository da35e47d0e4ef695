"""What every tool-call parser shares: the call values, the streaming state machine, the grammar.

A model writes a call as a JSON object ``{"name": NAME, "arguments": {...}}`` (the key of the
arguments is the format's: Llama 3 writes ``parameters``), framed by its format's markers. A
parser is a :class:`CallSyntax` (those markers and keys) over one machine,
:class:`ToolCallStream`, which reads the generated text as it comes::

    text ──► TEXT ──start──► BODY: {"name": "f", "arguments": { ... } }  ──end──► TEXT ...
             content         │ head read, f a tool: CallStart      │ the body closes: check it,
             (held back where│ then each scanned character of the  │ then its end marker (or the
             a marker could  │ arguments object: CallArgs fragment │ separator before the next)
             begin)          │ (joined, the arguments as written)  │

* A body that is no call of a known tool (not JSON, an unknown name, arguments that are not an
  object) is content: the text goes out as it was written, the marker included.
* A body whose keys do not come name first is sent whole once it closes and parses.
* Streamed, a call already started cannot be taken back: if the model breaks its JSON after
  that, the call stays as sent and the rest is content (``broken``). The whole-text
  :func:`parse` runs the same machine and, for such a text, returns it all as content instead.

The grammar (``tool_choice`` ``required`` or a named function) is the format's own framing
around a JSON schema per function (its name a constant, its arguments the function's
``parameters``), so a model constrained to call writes what it was trained to write.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

#: JSON in the grammar without free whitespace (as ``response_format``; see ``guided_decoder``).
GRAMMAR_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A whole output: the text that is not a call, and the calls in order."""

    content: str
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's position among this output's calls
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    fragment: str


StreamEvent = Content | CallStart | CallArgs


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a format frames its calls.

    ``start``: the text that opens a call (None: a call is a bare JSON object, and only at the
    start of the output or after ``separator``); ``end``: the text that closes it (None: the
    object's closing brace); ``prefix``: optional text before the first call (Llama 3's
    ``<|python_tag|>``); ``argument_keys``: the keys the arguments may come under, the first
    the one the grammar writes; ``content_between``: whether text may surround the calls.
    """

    start: str | None
    end: str | None
    argument_keys: tuple[str, ...]
    separator: str | None = None
    prefix: str | None = None
    content_between: bool = True
    grammar_joiner: str = "\n"  # what the grammar writes between two calls

    def head_pattern(self) -> re.Pattern:
        keys = "|".join(map(re.escape, self.argument_keys))
        return re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:' + keys + r')"\s*:\s*(?=\S)')


_TEXT, _BODY, _AFTER, _DONE = "text", "body", "after", "done"


@dataclass(slots=True)
class _Body:
    """One call's text from its ``{`` on, scanned for the object's end."""

    raw_start: str  # the marker that opened it ("" for a bare object), for the content fallback
    text: str = ""
    scanned: int = 0  # characters of text scanned
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    closed: bool = False
    index: int | None = None  # set once the call is started (CallStart sent)
    args_from: int | None = None  # where the arguments value starts in text
    args_sent: int = 0  # characters of the arguments value sent
    args_done: bool = False


class ToolCallStream:
    """One choice's text in, :data:`StreamEvent` values out (see the module docstring).

    ``tool_names``: the functions a call may name; ``max_calls``: 1 for ``parallel_tool_calls:
    false`` (text after the first call is dropped), else None."""

    def __init__(self, syntax: CallSyntax, tool_names: Iterable[str], *, max_calls: int | None = None) -> None:
        self.syntax = syntax
        self.tool_names = frozenset(tool_names)
        self.max_calls = max_calls
        self._head = syntax.head_pattern()
        self._buffer = ""
        self._state = _TEXT
        self._body: _Body | None = None
        self._started = False  # any non-space text seen (Llama 3: the first character decides)
        self.calls: list[ParsedCall] = []  # completed, valid calls
        self._num_started = 0  # calls sent a CallStart, a broken one included: each index is new
        self.broken = False  # a started call whose JSON broke (streamed: it stays as sent)
        self.cut_in_call = False  # set by finish: the output ended inside a started call

    def push(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        """The output ended: whatever was held back goes out as content (an unfinished body that
        was not started as a call included)."""
        events: list[StreamEvent] = []
        while self._step(events, final=True):
            pass
        body = self._body
        if body is not None and body.index is None and self._state == _BODY:
            events.append(Content(body.raw_start + body.text))
        elif self._state in (_TEXT, _AFTER) and self._buffer:
            if self._state == _TEXT:
                events.append(Content(self._buffer))
            elif self._buffer.strip():
                self.broken = True
                events.append(Content(self._buffer))
        self.cut_in_call = body is not None and body.index is not None and not body.closed
        self._buffer, self._body = "", None
        return _merged(events)

    # ---- the machine
    def _step(self, events: list[StreamEvent], final: bool = False) -> bool:
        if self._state == _TEXT:
            return self._step_text(events, final)
        if self._state == _BODY:
            return self._step_body(events)
        if self._state == _AFTER:
            return self._step_after(events, final)
        self._buffer = ""  # _DONE: one call was all that was asked for; the rest is dropped
        return False

    def _step_text(self, events: list[StreamEvent], final: bool) -> bool:
        syntax, buffer = self.syntax, self._buffer
        if syntax.start is None:  # a bare object: only first (after an optional prefix and spaces)
            if not self._started:
                stripped = buffer.lstrip()
                if syntax.prefix and stripped.startswith(syntax.prefix):
                    stripped = stripped[len(syntax.prefix):].lstrip()
                elif syntax.prefix and syntax.prefix.startswith(stripped) and not final:
                    return False  # the prefix may be coming
                if not stripped:
                    return False
                self._started = True
                if stripped.startswith("{"):
                    self._open_body(buffer[: len(buffer) - len(stripped)], stripped)
                    return True
            if buffer:  # not a call: the whole output is content
                events.append(Content(buffer))
                self._buffer = ""
            return False
        at = buffer.find(syntax.start)
        if at >= 0:
            if at:
                events.append(Content(buffer[:at]))
            self._open_body(syntax.start, buffer[at + len(syntax.start):])
            return True
        keep = 0 if final else _partial_suffix(buffer, syntax.start)
        if len(buffer) > keep:
            events.append(Content(buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep:]
        return False

    def _start_index(self) -> int:
        """The next call's index: a call that broke after its CallStart keeps its index, so the
        calls after it never reuse one a client has already seen."""
        self._num_started += 1
        return self._num_started - 1

    def _open_body(self, raw_start: str, rest: str) -> None:
        self._state, self._body, self._buffer = _BODY, _Body(raw_start), ""
        self._body.text = rest

    def _step_body(self, events: list[StreamEvent]) -> bool:
        body = self._body
        body.text += self._buffer
        self._buffer = ""
        if body.text.lstrip() and not body.text.lstrip().startswith("{"):
            return self._not_a_call(events)
        self._scan(body)
        if body.index is None and body.args_from is None:
            match = self._head.match(body.text)
            if match and match.group(1) in self.tool_names and body.text[match.end()] == "{":
                body.args_from = match.end()
                body.index = self._start_index()
                events.append(CallStart(body.index, match.group(1)))
        if body.index is not None and not body.args_done:
            self._send_args(body, events)
        if not body.closed:
            return False
        rest = body.text[body.scanned:]
        body.text = body.text[: body.scanned]
        call = _as_call(body.text, self.syntax.argument_keys, self.tool_names)
        if body.index is None:  # not started: sent whole if it is a call, else it was content
            if call is None:
                self._buffer = rest
                return self._not_a_call(events, rest_taken=True)
            body.index = self._start_index()
            events += [CallStart(body.index, call.name), CallArgs(body.index, call.arguments)]
        elif call is None or not body.args_done:
            self.broken = True
        if call is not None and not self.broken:
            self.calls.append(call)
        self._state, self._buffer = _AFTER, rest
        return True

    def _step_after(self, events: list[StreamEvent], final: bool) -> bool:
        """After a body: its end marker (or, bare objects, the separator before the next). An
        output that ends right after a complete body (its end marker missing or cut) keeps it."""
        syntax = self.syntax
        if not self.broken:
            marker = syntax.end if syntax.end is not None else syntax.separator
            stripped = self._buffer.lstrip()
            if marker is not None and stripped.startswith(marker):
                self._buffer = stripped[len(marker):]
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    self._state = _DONE
                elif syntax.end is not None:
                    self._state = _TEXT
                else:
                    self._open_body("", self._buffer)
                return True
            if not stripped or (marker is not None and marker.startswith(stripped)):
                if final:
                    self._buffer = ""
                return False  # the marker may be coming (or the output ended: the call stands)
            self.broken = True  # something else follows a call
        self._state, self._started = _TEXT, True  # content from here on (markers still found)
        return True

    def _not_a_call(self, events: list[StreamEvent], rest_taken: bool = False) -> bool:
        """The body is no call: its text (and the marker) is content; scanning goes on after it."""
        body = self._body
        text = body.raw_start + body.text + ("" if rest_taken else self._buffer)
        rest = self._buffer if rest_taken else ""
        self._body, self._buffer = None, ""
        self._state, self._started = _TEXT, True
        if self.syntax.start is None:  # bare objects: the whole output is content from here
            events.append(Content(text + rest))
            return False
        if self.syntax.start and text.startswith(self.syntax.start):
            events.append(Content(self.syntax.start))  # not searched again: a marker and junk stay text
            text = text[len(self.syntax.start):]
        self._buffer = text + rest
        return True

    @staticmethod
    def _scan(body: _Body) -> None:
        """Advance the brace scanner over the new characters, up to the object's end."""
        text, i = body.text, body.scanned
        while i < len(text) and not body.closed:
            ch = text[i]
            if body.in_string:
                if body.escape:
                    body.escape = False
                elif ch == "\\":
                    body.escape = True
                elif ch == '"':
                    body.in_string = False
            elif ch == '"':
                body.in_string = True
            elif ch in "{[":
                body.depth += 1
            elif ch in "}]":
                body.depth -= 1
                if body.depth == 0:
                    body.closed = True
            i += 1
        body.scanned = i

    @staticmethod
    def _send_args(body: _Body, events: list[StreamEvent]) -> None:
        """Send the scanned part of the arguments object (it ends where its own brace closes)."""
        start = body.args_from
        scanner = _Body("", text=body.text[start: body.scanned])
        ToolCallStream._scan(scanner)  # where the arguments object closes, if it has
        end = start + scanner.scanned
        if end > start + body.args_sent:
            events.append(CallArgs(body.index, body.text[start + body.args_sent: end]))
            body.args_sent = end - start
        body.args_done = scanner.closed


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Adjacent content joined (and empty content dropped): one delta per kind."""
    out: list[StreamEvent] = []
    for event in events:
        if isinstance(event, Content):
            if not event.text:
                continue
            if out and isinstance(out[-1], Content):
                out[-1] = Content(out[-1].text + event.text)
                continue
        out.append(event)
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: it may be one)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _as_call(body: str, argument_keys: Sequence[str], tool_names: frozenset[str]) -> ParsedCall | None:
    """The call ``body`` is: a JSON object with a known ``name`` and an object of arguments under
    one of ``argument_keys`` (nothing else); else None. The arguments are the text the model
    wrote, when it wrote the name first, else the object written again."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    keys = [key for key in argument_keys if key in value]
    if len(keys) != 1 or set(value) != {"name", keys[0]} or not isinstance(value[keys[0]], dict):
        return None
    return ParsedCall(value["name"], _arguments_text(body, keys[0], value[keys[0]]))


def _arguments_text(body: str, key: str, arguments: dict) -> str:
    head = re.match(r'\s*\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"' + re.escape(key) + r'"\s*:\s*', body)
    if head is not None:
        tail = body[head.end():].rstrip()
        if tail.endswith("}"):
            text = tail[:-1].rstrip()
            try:
                if json.loads(text) == arguments:
                    return text
            except ValueError:
                pass
    return json.dumps(arguments, ensure_ascii=False)


def parse_whole(syntax: CallSyntax, text: str, tool_names: Iterable[str], *, max_calls: int | None = None) -> ParsedOutput:
    """``text``, whole, read as :class:`ToolCallStream` reads it streamed; where a started call
    broke, it is all content (nothing was sent yet that would have to stand)."""
    stream = ToolCallStream(syntax, tool_names, max_calls=max_calls)
    events = stream.push(text) + stream.finish()
    if stream.broken or stream.cut_in_call:
        return ParsedOutput(text, ())
    content = "".join(e.text for e in events if isinstance(e, Content))
    return ParsedOutput(content, tuple(stream.calls))


def call_schema(syntax: CallSyntax, functions: Sequence[Mapping]) -> dict:
    """The JSON schema of one call body of ``functions`` (OpenAI function definitions): the
    name a constant, then the arguments object the function's ``parameters`` describe."""
    key = syntax.argument_keys[0]
    return {"x-guidance": GRAMMAR_JSON_OPTIONS, "anyOf": [
        {"type": "object",
         "properties": {"name": {"const": f["name"]},
                        key: f.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}},
         "required": ["name", key], "additionalProperties": False}
        for f in functions]}


def call_grammar(syntax: CallSyntax, functions: Sequence[Mapping], *, one_call: bool) -> str:
    """A Lark grammar (llguidance's dialect) of the output when a call is required: one call of
    ``functions`` or (unless ``one_call``) several, framed as the format frames them."""
    start = json.dumps(syntax.start + "\n") if syntax.start else None
    end = json.dumps("\n" + syntax.end) if syntax.end else None
    call = " ".join(part for part in (start, "body", end) if part)
    joiner = json.dumps(syntax.grammar_joiner if syntax.end else (syntax.separator or ";") + " ")
    repeat = "" if one_call else f" ({joiner} call)*"
    return (f"start: call{repeat}\n"
            f"call: {call}\n"
            f"body: %json {json.dumps(call_schema(syntax, functions))}\n")


@dataclass(frozen=True, slots=True)
class ToolParser:
    """A named format (``--tool_parser NAME``): its syntax and what is derived from it."""

    name: str
    syntax: CallSyntax
    description: str = ""
    aliases: tuple[str, ...] = field(default=())

    def stream(self, tool_names: Iterable[str], *, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self.syntax, tool_names, max_calls=max_calls)

    def parse(self, text: str, tool_names: Iterable[str], *, max_calls: int | None = None) -> ParsedOutput:
        return parse_whole(self.syntax, text, tool_names, max_calls=max_calls)

    def grammar(self, functions: Sequence[Mapping], *, one_call: bool) -> str:
        return call_grammar(self.syntax, functions, one_call=one_call)
