"""Pydantic models of the OpenAI completions and chat completions API, as this server supports it.

Requests are validated strictly at the edge, so that nothing a client sends can reach the
executor in a form it cannot serve (issue 21):

* Types are not coerced (pydantic strict mode): ``"stream": "yes"``, ``1`` or ``"true"``,
  ``"n": true``, ``"seed": "1"`` are refused. An integer is taken where a number is expected
  (``"temperature": 1``), as OpenAI takes it; ``null`` is taken where OpenAI's schema allows it
  and means the default. ``NaN`` and ``Infinity`` (which Python's JSON parser reads) are refused.
* Numbers are bounded: ``seed`` in [0, 2**64) (upstream's unsigned 64-bit seed), counts
  (``max_tokens``, ``max_completion_tokens``) in [1, 2**31), ``temperature`` in [0, 2],
  ``top_p`` in (0, 1]. A ``temperature`` below 1e-5 (``GREEDY_BELOW_TEMPERATURE``: 5e-324, 1e-310
  ...) is taken and sampled greedily, as vLLM's ``_SAMPLING_EPS`` did; see ``SamplingConfig``.
* Text must be valid Unicode: a lone surrogate (JSON ``"\\ud800"``) anywhere in a request, in
  ``prompt``, ``stop``, ``messages`` or any other field, is refused naming the field; the
  tokenizer would fail on it.
* An argument the server does not know is an error naming it (``extra="forbid"``), and
  ``suffix`` and ``logit_bias`` must keep their neutral values (nothing here inserts text or
  biases logits). ``best_of > n`` cannot stream (the best samples are known at the end only),
  ``top_logprobs`` needs ``logprobs: true``, as OpenAI and vLLM refuse them. ``echo`` with
  ``logprobs`` reports the prompt tokens' log-probabilities too (the first one's is null).
* Sampling fields beyond OpenAI's, as vLLM takes them: ``top_k``, ``repetition_penalty``,
  ``min_tokens``, ``stop_token_ids``, ``ignore_eos``. Beam search, as upstream's ``trtllm-serve``
  takes it (both endpoints): ``use_beam_search`` (``best_of`` beams, default ``n``; the ``n``
  best returned, whole, at the end, also when streamed), ``length_penalty``, ``early_stopping``
  (true, false or "never"). Structured output: ``response_format``
  ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`` (both endpoints, as vLLM).

Every refusal is a 400 with the OpenAI error body. Responses follow OpenAI's shapes; a choice
also carries ``token_ids`` (the generated ids), which is the only output a model without a
tokenizer has.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tensorrt_llm._torch.pyexecutor.llm_request import SEED_LIMIT

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COUNT = 2**31 - 1  # a token count beyond int32 is no count any model serves


#: Arguments accepted only at a neutral value: name -> (the values accepted, why no other is).
_ONLY_NEUTRAL: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "this server does not insert text"),
    "logit_bias": ((None, {}), "this server applies no logit bias"),
}
MAX_SAMPLES = 16  # n and best_of: each sample is an executor request of its own
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)


def _first_invalid_text(value: Any) -> str | None:
    """The first string in ``value`` (nested lists and dicts, keys included) that is not valid
    Unicode, i.e. that holds a lone surrogate and so cannot be encoded to UTF-8. Iterative: JSON
    nests as deep as its parser lets it, deeper than a recursion here could follow."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending.extend(reversed([part for pair in item.items() for part in pair]))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
    return None


def _same(value: Any, neutral: Any) -> bool:
    """Equal and both booleans or neither: ``logprobs: 0`` is a count, not ``false``."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_and_neutral(cls, value: Any, info) -> Any:
        if (bad := _first_invalid_text(value)) is not None:
            surrogate = next(ch for ch in bad if 0xD800 <= ord(ch) <= 0xDFFF)
            raise ValueError(f"{info.field_name} is not valid Unicode: it holds the lone surrogate"
                             f" {surrogate!r} (send UTF-8 text)")
        accepted, why = _ONLY_NEUTRAL.get(info.field_name, (None, None))
        if accepted is not None and not any(_same(value, neutral) for neutral in accepted):
            raise ValueError(f"{info.field_name}={value!r} is not supported: {why}")
        return value


class StreamOptions(_Request):
    include_usage: bool | None = False


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``: ``schema`` is the JSON schema the output follows."""

    name: str
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Request):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given with type 'json_schema', and only then")
        return self


class _SamplingRequest(_Request):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Any = None  # a string or a list of strings (checked by hand: a union would name its branches in errors)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_SAMPLES)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; does not change the output
    response_format: ResponseFormat | None = None
    # Extensions, as vLLM names them:
    ignore_eos: bool | None = False  # generate max_tokens whatever end-of-generation tokens come
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT)  # 0 or -1 (vLLM's "off"): no top-k filter
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)
    stop_token_ids: list[int] | None = None
    # Beam search, as upstream's trtllm-serve: best_of beams (default n), the n best returned.
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(None, ge=-100.0, le=100.0)
    early_stopping: bool | Literal["never"] | None = None

    @model_validator(mode="after")
    def _samples(self):
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({n})")
        if self.best_of is not None and self.best_of > n and self.stream and not self.use_beam_search:
            raise ValueError("best_of > n cannot stream: the best samples are known only when all have finished")
        return self

    @property
    def early_stopping_value(self) -> int | None:
        """Upstream's integer encoding: false 0, true 1, "never" 2; None: the engine's default."""
        if self.early_stopping is None:
            return None
        return 2 if self.early_stopping == "never" else int(self.early_stopping)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: Any) -> list[str]:
        strings = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError("stop must be a string or a list of strings")
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
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(not 0 <= t < 2**31 for t in ids):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        return ids

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def top_k_value(self) -> int:
        return 0 if self.top_k is None or self.top_k == -1 else self.top_k


class CompletionRequest(_SamplingRequest):
    """``prompt``: a string or a list of token ids (one prompt; a batch of prompts is refused)."""

    prompt: Any
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None  # a string, a list of text parts, or null (checked by hand, as ``stop``)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> str:
        """The message's text: a string, or the text parts joined (``{"type": "text", "text": str}``)."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string, a list of content parts or null")
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got type {kind!r}")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError('a text content part is {"type": "text", "text": <string>}')
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat's ``choice.logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The completions API's ``choice.logprobs`` (the legacy shape): parallel lists per token;
    ``text_offset`` is each token's character offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)  # what this choice (or chunk) generated


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


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
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


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
