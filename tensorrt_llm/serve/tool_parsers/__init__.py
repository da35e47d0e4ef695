"""Tool-call parsers, chosen by ``trtllm-serve --tool_parser NAME`` (upstream's flag; the names
are upstream's and vLLM's):

==============  ======================================================================  ==============
name            what the model writes                                                    models
==============  ======================================================================  ==============
``hermes``      ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any     Hermes 2/3,
(``qwen3``,     number, text around them                                                 Qwen 2.5 / 3
``qwen``)
``llama3_json`` ``{"name": "f", "parameters": {...}}`` as the whole output (after an      Llama 3.1-3.3
                optional ``<|python_tag|>``), several separated by ``;``
==============  ======================================================================  ==============

Each is a :class:`~base.CallSyntax` over the one machine in ``base``; nothing here imports the
server or torch.
"""

from __future__ import annotations

from tensorrt_llm.serve.tool_parsers.base import (
    CallArgs,
    CallStart,
    CallSyntax,
    Content,
    ParsedCall,
    ParsedOutput,
    StreamEvent,
    ToolCallStream,
    ToolParser,
)

HERMES = ToolParser(
    "hermes",
    CallSyntax(start="<tool_call>", end="</tool_call>", argument_keys=("arguments",)),
    "Hermes / Qwen: <tool_call> JSON </tool_call> blocks, text around them",
    aliases=("qwen3", "qwen"),
)
LLAMA3_JSON = ToolParser(
    "llama3_json",
    CallSyntax(start=None, end=None, argument_keys=("parameters", "arguments"), separator=";",
               prefix="<|python_tag|>", content_between=False),
    'Llama 3.1+: the output is {"name": ..., "parameters": {...}} objects separated by ;',
)

#: Every parser by each of its names.
TOOL_PARSERS: dict[str, ToolParser] = {
    name: parser for parser in (HERMES, LLAMA3_JSON) for name in (parser.name, *parser.aliases)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ValueError listing the names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "CallArgs", "CallStart", "CallSyntax", "Content", "HERMES", "LLAMA3_JSON", "ParsedCall", "ParsedOutput",
    "StreamEvent", "TOOL_PARSERS", "ToolCallStream", "ToolParser", "get_tool_parser",
]
