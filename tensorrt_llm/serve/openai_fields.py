"""Every request field of ``/v1/completions`` and ``/v1/chat/completions``, and what the server
does with it: the one table (``docs/openai-api.md`` prints it; a test walks it over HTTP).

Each field is one of:

* ``SERVED``: it does what OpenAI defines (or vLLM / upstream TensorRT-LLM, for their extensions).
* ``IGNORED``: an OpenAI field that changes nothing this server produces (``store``,
  ``metadata``, ``user``, ...). It is accepted and type-checked like any field, and a debug log
  line names it, as vLLM accepts what it does not use.
* ``REFUSED``: an OpenAI field that would change the output and is not implemented
  (``logit_bias``, ``suffix``, ``audio``, ...). Only its neutral values are taken (``null``, or the
  value that means "off"); any other is a 400 naming the field.

A name in no row (a typo, a field of another server) is a 400 naming it. The request models in
``openai_protocol`` declare exactly these fields (a test checks both agree), with their types;
this module only classifies them, and imports nothing of the server.

Names with a dot are keys of a nested object (``stream_options.continuous_usage_stats``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

COMPLETIONS = "completions"
CHAT = "chat"
BOTH = frozenset({COMPLETIONS, CHAT})


class Disposition(enum.Enum):
    SERVED = "served"
    IGNORED = "ignored"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class FieldRule:
    """One field: what is done with it, on which endpoints, and why.

    ``neutral``: for a REFUSED field, the values that mean "off" and are taken. ``example``: a
    request fragment (this field, and what it needs beside it) that a served or ignored field is
    answered 200 for, and a refused field 400: the table-walking test sends it (``chat_example``
    instead on the chat endpoint, where given; empty: the minimal request holds the field)."""

    name: str
    disposition: Disposition
    endpoints: frozenset[str]
    origin: str  # "openai", "vllm" or "trtllm": where the name and its meaning come from
    note: str
    example: Mapping[str, Any] = field(default_factory=dict)
    neutral: tuple = ()
    chat_example: Mapping[str, Any] | None = None

    def example_for(self, endpoint: str) -> Mapping[str, Any]:
        return self.chat_example if endpoint == CHAT and self.chat_example is not None else self.example


_S, _I, _R = Disposition.SERVED, Disposition.IGNORED, Disposition.REFUSED
_BEAM = {"use_beam_search": True, "best_of": 2, "temperature": 0}
_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}

FIELDS: tuple[FieldRule, ...] = (
    # ---- the request itself
    FieldRule("model", _S, BOTH, "openai",
              "must name the served model (404 otherwise); left out: the served model (vLLM's rule)"),
    FieldRule("prompt", _S, frozenset({COMPLETIONS}), "openai",
              "text or token ids, or a batch of up to 16 (a list of texts or of token-id lists): choice i * n + j"
              " is prompt i's sample j; a bad prompt is a 400 naming prompt.<i>"),
    FieldRule("messages", _S, frozenset({CHAT}), "openai",
              "roles system, developer, user, assistant (with tool_calls), tool; text content only"),
    # ---- length
    FieldRule("max_tokens", _S, BOTH, "openai",
              "an integer (an integral float such as 16.0 is taken); chat: the same field as max_completion_tokens",
              {"max_tokens": 2.0}),
    FieldRule("max_completion_tokens", _S, frozenset({CHAT}), "openai",
              "with max_tokens too and a different value, max_completion_tokens wins (vLLM's rule)",
              {"max_completion_tokens": 2, "max_tokens": 3}),
    FieldRule("min_tokens", _S, BOTH, "vllm", "end-of-generation ids are masked until this many tokens", {"min_tokens": 1}),
    FieldRule("ignore_eos", _S, BOTH, "vllm", "generate max_tokens whatever the model ends with", {"ignore_eos": True}),
    FieldRule("stop", _S, BOTH, "openai", "up to 4 stop strings", {"stop": ["\n\n"]}),
    FieldRule("stop_token_ids", _S, BOTH, "vllm", "extra ids that end the output", {"stop_token_ids": [2]}),
    # ---- sampling
    FieldRule("temperature", _S, BOTH, "openai", "[0, 2]; below 1e-5 greedy", {"temperature": 0.5}),
    FieldRule("top_p", _S, BOTH, "openai", "(0, 1]", {"top_p": 0.9}),
    FieldRule("top_k", _S, BOTH, "vllm", "0 or -1: off", {"top_k": 5}),
    FieldRule("min_p", _S, BOTH, "vllm", "[0, 1], 0: off; keeps tokens at least min_p times as likely as the likeliest",
              {"min_p": 0.1, "temperature": 1.0}),
    FieldRule("seed", _S, BOTH, "openai", "[0, 2**64)", {"seed": 3, "temperature": 1.0}),
    FieldRule("n", _S, BOTH, "openai", "1..16 choices", {"n": 2}),
    FieldRule("presence_penalty", _S, BOTH, "openai", "[-2, 2], over the output", {"presence_penalty": 0.5}),
    FieldRule("frequency_penalty", _S, BOTH, "openai", "[-2, 2], over the output", {"frequency_penalty": 0.5}),
    FieldRule("repetition_penalty", _S, BOTH, "vllm", "over prompt and output", {"repetition_penalty": 1.1}),
    FieldRule("best_of", _S, BOTH, "openai", "samples drawn, the n best by cumulative logprob returned", {"best_of": 2}),
    FieldRule("use_beam_search", _S, BOTH, "trtllm", "best_of beams, the n best returned", _BEAM),
    FieldRule("length_penalty", _S, BOTH, "trtllm", "beam search", {**_BEAM, "length_penalty": 1.0}),
    FieldRule("early_stopping", _S, BOTH, "trtllm", "beam search: true, false or \"never\"",
              {**_BEAM, "early_stopping": True}),
    FieldRule("response_format", _S, BOTH, "openai", "text, json_object or json_schema (grammar-enforced)",
              {"response_format": {"type": "json_object"}}),
    FieldRule("priority", _S, BOTH, "trtllm",
              "[0, 1], 0.5 by default: who waits first under scheduler_config.waiting_queue_policy priority",
              {"priority": 0.9}),
    FieldRule("chat_template_kwargs", _S, frozenset({CHAT}), "vllm",
              "extra variables for the chat template (enable_thinking, ...), beside the messages",
              {"chat_template_kwargs": {"enable_thinking": False}}),
    # ---- log-probabilities and echo
    FieldRule("logprobs", _S, BOTH, "openai", "completions: top-k count (0..20); chat: true / false", {"logprobs": 2},
              chat_example={"logprobs": True}),
    FieldRule("top_logprobs", _S, frozenset({CHAT}), "openai", "0..20, with logprobs: true",
              {"logprobs": True, "top_logprobs": 2}),
    FieldRule("echo", _S, frozenset({COMPLETIONS}), "openai", "the prompt leads the text", {"echo": True}),
    # ---- streaming
    FieldRule("stream", _S, BOTH, "openai", "server-sent events ending in [DONE]", {"stream": True}),
    FieldRule("stream_options", _S, BOTH, "openai", "needs stream: true", {"stream": True, "stream_options": {}}),
    FieldRule("stream_options.include_usage", _S, BOTH, "openai",
              "a usage chunk before [DONE]; true when stream_options is given (upstream's and vLLM's default)",
              {"stream": True, "stream_options": {"include_usage": True}}),
    FieldRule("stream_options.continuous_usage_stats", _S, BOTH, "vllm",
              "with include_usage: cumulative usage on every chunk",
              {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    FieldRule("stream_options.include_obfuscation", _I, BOTH, "openai",
              "OpenAI pads chunks against side channels; nothing is padded here",
              {"stream": True, "stream_options": {"include_obfuscation": True}}),
    # ---- tools
    FieldRule("tools", _S, frozenset({CHAT}), "openai", "function tools, rendered by the chat template",
              {"tools": [_TOOL], "tool_choice": "none"}),
    FieldRule("tool_choice", _S, frozenset({CHAT}), "openai",
              "none, auto (default with tools), required, or a named function; all but none need --tool_parser",
              {"tool_choice": "none"}),
    FieldRule("parallel_tool_calls", _S, frozenset({CHAT}), "openai",
              "false: at most one call (required / named: the grammar allows one; auto: the first is kept)",
              {"parallel_tool_calls": False}),
    # ---- accepted, changing nothing here
    FieldRule("user", _I, BOTH, "openai", "an end-user id for the operator's logs", {"user": "u-1"}),
    FieldRule("store", _I, frozenset({CHAT}), "openai", "nothing is stored", {"store": False}),
    FieldRule("metadata", _I, frozenset({CHAT}), "openai", "tags for stored completions; nothing is stored",
              {"metadata": {"run": "a"}}),
    FieldRule("service_tier", _I, frozenset({CHAT}), "openai", "one tier here", {"service_tier": "auto"}),
    FieldRule("safety_identifier", _I, frozenset({CHAT}), "openai", "for OpenAI's abuse detection",
              {"safety_identifier": "s-1"}),
    FieldRule("prompt_cache_key", _I, frozenset({CHAT}), "openai",
              "a routing hint; the prefix cache here matches prompts by their tokens", {"prompt_cache_key": "k"}),
    FieldRule("prompt_cache_retention", _I, frozenset({CHAT}), "openai", "cached blocks live until evicted (LRU)",
              {"prompt_cache_retention": "24h"}),
    FieldRule("prompt_cache_options", _I, frozenset({CHAT}), "openai", "cache breakpoints: the prefix cache is per block",
              {"prompt_cache_options": {}}),
    FieldRule("prediction", _I, frozenset({CHAT}), "openai", "a latency hint (predicted output); the output is the same",
              {"prediction": {"type": "content", "content": "x"}}),
    FieldRule("reasoning_effort", _I, frozenset({CHAT}), "openai",
              "no reasoning setting is rendered into the template here", {"reasoning_effort": "low"}),
    FieldRule("spaces_between_special_tokens", _I, BOTH, "vllm",
              "the tokenizers here are fast ones, whose decoding has no such choice",
              {"spaces_between_special_tokens": False}),
    # ---- refused unless neutral
    FieldRule("skip_special_tokens", _R, BOTH, "vllm",
              "special tokens are always left out of the text (token_ids has every id)",
              {"skip_special_tokens": False}, (None, True)),
    FieldRule("logit_bias", _R, BOTH, "openai", "no logit bias is applied", {"logit_bias": {"5": 1.0}}, (None, {})),
    FieldRule("suffix", _R, frozenset({COMPLETIONS}), "openai", "no text is inserted", {"suffix": "x"}, (None, "")),
    FieldRule("audio", _R, frozenset({CHAT}), "openai", "text output only", {"audio": {"voice": "alloy"}}, (None,)),
    FieldRule("modalities", _R, frozenset({CHAT}), "openai", "text output only", {"modalities": ["audio"]},
              (None, ["text"])),
    FieldRule("functions", _R, frozenset({CHAT}), "openai", "the deprecated function calling: use tools",
              {"functions": [_TOOL["function"]]}, (None,)),
    FieldRule("function_call", _R, frozenset({CHAT}), "openai", "the deprecated function calling: use tool_choice",
              {"function_call": "auto"}, (None,)),
    FieldRule("web_search_options", _R, frozenset({CHAT}), "openai", "no web search", {"web_search_options": {}}, (None,)),
    FieldRule("moderation", _R, frozenset({CHAT}), "openai", "no moderation is run", {"moderation": {}}, (None,)),
    FieldRule("verbosity", _R, frozenset({CHAT}), "openai", "the length is not steered", {"verbosity": "low"}, (None,)),
)

_BY_KEY = {(rule.name, endpoint): rule for rule in FIELDS for endpoint in rule.endpoints}


def rules(endpoint: str) -> tuple[FieldRule, ...]:
    """The rows of one endpoint (``COMPLETIONS`` or ``CHAT``), in table order."""
    return tuple(rule for rule in FIELDS if endpoint in rule.endpoints)


def rule(name: str, endpoint: str) -> FieldRule | None:
    return _BY_KEY.get((name, endpoint))


def top_level_names(endpoint: str) -> frozenset[str]:
    """The request's own keys (not nested ones) on ``endpoint``: what its model declares."""
    return frozenset(r.name for r in rules(endpoint) if "." not in r.name)


def ignored_given(endpoint: str, values: Mapping[str, Any]) -> list[str]:
    """The IGNORED fields among ``values`` (a request's keys, nested ones dotted) set to something
    other than null: what the server logs at debug level."""
    return [name for name, value in values.items()
            if value is not None and (r := rule(name, endpoint)) is not None and r.disposition is _I]


def refusal(name: str, endpoint: str, value: Any) -> str | None:
    """Why ``value`` is refused for field ``name`` (a REFUSED field at a value that is not
    neutral), or None. Booleans and numbers are told apart: ``0`` is not ``false``."""
    r = rule(name, endpoint)
    if r is None or r.disposition is not _R:
        return None
    if any(value == neutral and isinstance(value, bool) == isinstance(neutral, bool) for neutral in r.neutral):
        return None
    return f"{name}={value!r:.100} is not supported: {r.note}"
