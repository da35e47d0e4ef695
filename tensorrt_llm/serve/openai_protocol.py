"""Pydantic models of the OpenAI completions and chat completions API, as this server supports it.

Requests refuse what the server does not do rather than ignore it: an argument it does not
know is an error naming it (``extra="forbid"``), and ``n``, ``best_of``, ``echo``,
``logprobs``, penalties and ``logit_bias`` must keep their neutral values. Responses follow
OpenAI's shapes; a choice also carries ``token_ids`` (the generated ids), which is the only
output a model without a tokenizer has.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit


#: Arguments accepted only at a neutral value: name -> (the values accepted, why no other is).
_ONLY_NEUTRAL: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "this server returns exactly one choice per request (n must be 1)"),
    "best_of": ((None, 1), "this server generates one sequence per request"),
    "echo": ((False,), "this server does not echo the prompt"),
    "logprobs": ((None, False), "this server does not compute log-probabilities"),
    "top_logprobs": ((None,), "this server does not compute log-probabilities"),
    "suffix": ((None, ""), "this server does not insert text"),
    "presence_penalty": ((0, 0.0), "this server applies no penalties"),
    "frequency_penalty": ((0, 0.0), "this server applies no penalties"),
    "logit_bias": ((None, {}), "this server applies no logit bias"),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _only_neutral(cls, value: Any, info) -> Any:
        accepted, why = _ONLY_NEUTRAL.get(info.field_name, (None, None))
        if accepted is not None and value not in accepted:
            raise ValueError(f"{info.field_name}={value!r} is not supported: {why}")
        return value


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; does not change the output
    ignore_eos: bool = False  # extension (as vLLM): generate max_tokens whatever end-of-generation tokens come

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("a stop sequence must not be empty")
        return strings

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingRequest):
    """``prompt``: a string or a list of token ids (one prompt; a batch of prompts is refused)."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            if all(isinstance(p, (str, list)) for p in prompt):
                raise ValueError(f"a batch of {len(prompt)} prompts is not supported: send one prompt per request")
        raise ValueError("prompt must be a string or a list of integer token ids")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict] | None) -> str:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        parts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(TextContentPart.model_validate(part).text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(f"response_format {value.get('type')!r} is not supported: only 'text'")
        return value

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def _now() -> int:
    return int(time.time())


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str


class _Choice(BaseModel):
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)  # what this choice (or chunk) generated


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    """A whole completion, or one streamed chunk of it (``usage`` only on the last chunk, if asked)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_Choice):
    message: ChatCompletionMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(_Choice):
    delta: DeltaMessage


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tensorrt_llm"
    max_model_len: int  # as vLLM reports it: the longest prompt + output the server accepts
    vocab_size: int  # token ids a prompt may hold are [0, vocab_size)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
