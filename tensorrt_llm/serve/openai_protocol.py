"""Pydantic models of the OpenAI completions and chat completions API, as this server supports it.

Requests are validated strictly at the edge, so that nothing a client sends can reach the
executor in a form it cannot serve (a bad request fails alone):

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
* What is done with each field is one table, ``openai_fields``: served, ignored (an OpenAI field
  that changes nothing here: accepted, type-checked, logged at debug level) or refused unless
  neutral (``suffix``, ``logit_bias``, ``audio``, ...: 400 naming it). An argument in no row is an
  error naming it (``extra="forbid"``). Integer fields take an integral float (``16.0``, as
  vLLM's lax parsing does); ``16.5`` is refused naming the field. ``best_of > n`` cannot stream (the best samples are known at the end only),
  ``top_logprobs`` needs ``logprobs: true``, as OpenAI and vLLM refuse them. ``echo`` with
  ``logprobs`` reports the prompt tokens' log-probabilities too (the first one's is null).
* Sampling fields beyond OpenAI's, as vLLM takes them: ``top_k``, ``min_p``, ``repetition_penalty``,
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

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tensorrt_llm._torch.pyexecutor.sampling_config import SEED_LIMIT
from tensorrt_llm.serve import openai_fields
from tensorrt_llm.serve.openai_fields import CHAT, COMPLETIONS

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COUNT = 2**31 - 1  # a token count beyond int32 is no count any model serves
MAX_SAMPLES = 16  # n and best_of: each sample is an executor request of its own
MAX_PROMPTS = MAX_SAMPLES  # completions' prompts a request: each prompt is executor requests of its own too
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


def _integral(value: Any, info: ValidationInfo) -> Any:
    """An integral float (``16.0``) as its int, as vLLM's lax parsing takes it; any other float
    is refused naming the field (booleans stay refused by the strict int check)."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{info.field_name} must be an integer, got {value!r}")
        return int(value)
    return value


#: An integer field: an int, or a float with no fractional part.
Int = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    #: Whose rows of the field table hold for it (a request model of an endpoint), or None.
    ENDPOINT: ClassVar[str | None] = None

    @field_validator("*")
    @classmethod
    def _valid_and_neutral(cls, value: Any, info) -> Any:
        if (bad := _first_invalid_text(value)) is not None:
            surrogate = next(ch for ch in bad if 0xD800 <= ord(ch) <= 0xDFFF)
            raise ValueError(f"{info.field_name} is not valid Unicode: it holds the lone surrogate"
                             f" {surrogate!r} (send UTF-8 text)")
        if cls.ENDPOINT is not None and (why := openai_fields.refusal(info.field_name, cls.ENDPOINT, value)):
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _log_ignored(self):
        if self.ENDPOINT is not None:
            given = {name: getattr(self, name) for name in self.model_fields_set}
            if isinstance(options := given.get("stream_options"), StreamOptions):
                given |= {f"stream_options.{k}": getattr(options, k) for k in options.model_fields_set}
            if ignored := openai_fields.ignored_given(self.ENDPOINT, given):
                logger.debug("request fields ignored (they change nothing here): %s", ", ".join(sorted(ignored)))
        return self


class StreamOptions(_Request):
    # Upstream's and vLLM's default: a stream_options object asks for the usage chunk unless it says not.
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False  # with include_usage: cumulative usage on every chunk
    include_obfuscation: bool | None = None  # ignored (openai_fields)


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

    model: str | None = None  # None: the served model, as vLLM takes a request that names none
    max_tokens: Int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: Int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Any = None  # a string or a list of strings (checked by hand: a union would name its branches in errors)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Int | None = Field(1, ge=1, le=MAX_SAMPLES)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # refused unless empty (openai_fields)
    user: str | None = None  # ignored: an end-user id for the operator's logs
    response_format: ResponseFormat | None = None
    # Extensions, as vLLM names them:
    ignore_eos: bool | None = False  # generate max_tokens whatever end-of-generation tokens come
    top_k: Int | None = Field(None, ge=-1, le=MAX_COUNT)  # 0 or -1 (vLLM's "off"): no top-k filter
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: Int | None = Field(None, ge=0, le=MAX_COUNT)
    stop_token_ids: list[int] | None = None
    # Beam search, as upstream's trtllm-serve: best_of beams (default n), the n best returned.
    best_of: Int | None = Field(None, ge=1, le=MAX_SAMPLES)
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(None, ge=-100.0, le=100.0)
    early_stopping: bool | Literal["never"] | None = None
    # Upstream's request priority in [0, 1] (0.5 when absent): who waits first under
    # scheduler_config.waiting_queue_policy "priority"; accepted and ignored under "fcfs".
    priority: float | None = Field(None, ge=0.0, le=1.0)
    # vLLM's detokenization switches: the text never holds special tokens here (true is taken,
    # false refused: openai_fields), and the fast tokenizers have no spacing choice (ignored).
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None

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

    @property
    def continuous_usage(self) -> bool:
        """Cumulative usage on every chunk (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

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
    """``prompt``: one prompt (a string or a list of token ids), or a batch of up to
    ``MAX_PROMPTS`` (a list of strings, or a list of token-id lists; a batch of one is one
    prompt). Each prompt of a batch is generated on its own, as OpenAI and vLLM serve it."""

    ENDPOINT: ClassVar[str] = COMPLETIONS
    prompt: Any
    echo: bool | None = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None  # refused unless empty (openai_fields)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> str | list[int] | list[str] | list[list[int]]:
        """One prompt as itself; a batch as a list of at least two prompts of one kind. Whether
        each is empty, too long or within the vocabulary is the server's check (400 ``prompt.<i>``)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_token_id(t) for t in prompt)):
            return prompt
        if isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt)):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"a batch of {len(prompt)} prompts is too large: at most {MAX_PROMPTS} a request")
            return prompt
        raise ValueError("prompt must be a string, a list of integer token ids, a list of strings or a list of"
                         " token-id lists")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order (one for a single prompt)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt
        return [prompt]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(content: Any) -> str:
    """A message's text: a string, the text parts joined (``{"type": "text", "text": str}``), or
    "" for null."""
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


class FunctionCallParam(_Request):
    """A call an assistant made, as a client sends it back: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    """One message. ``tool_calls``: an assistant's calls (its content may then be null);
    ``tool_call_id``: the call a ``tool`` message answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, a list of text parts, or null (checked by hand, as ``stop``)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> str:
        return _text(content)

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are an assistant's, not a {self.role} message's")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only a tool message has one")
        return self


#: Template variables and arguments of ``Tokenizer.apply_chat_template`` a request sets itself.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "chat_template", "tokenize"})

#: OpenAI's rule for a function's name.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # the arguments always follow the schema when the grammar enforces them


class ChatCompletionToolsParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    ENDPOINT: ClassVar[str] = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionToolsParam] | None = Field(None, min_length=1)  # OpenAI refuses [] too
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (``{"enable_thinking": false}``)
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored (openai_fields): they change nothing this server produces.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    # Refused unless neutral (openai_fields): they would change the output, and are not implemented.
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    moderation: Any = None
    verbosity: Any = None

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """What the request itself gives the template (the conversation, its tools) cannot be set twice."""
        taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request gives them")
        return kwargs

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ChatCompletionToolsParam] | None) -> list[ChatCompletionToolsParam] | None:
        names = [tool.function.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice, info: ValidationInfo):
        """Checked here (``tools`` is validated before it), so that the error names tool_choice."""
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools"
                             f" ({', '.join(names)})")
        return choice

    @property
    def tool_choice_value(self) -> str:
        """``none``, ``auto``, ``required``, or ``function`` (a named one); OpenAI's default:
        ``auto`` with tools, ``none`` without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` and ``max_tokens`` are one field; given both, with different
        values, ``max_completion_tokens`` (OpenAI's current name) wins, as vLLM decides."""
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                logger.debug("max_tokens=%d and max_completion_tokens=%d: max_completion_tokens is used",
                             self.max_tokens, self.max_completion_tokens)
            return self.max_completion_tokens
        return self.max_tokens


# ---------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # None until the first token is out

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "UsageInfo":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def _now() -> int:
    return int(time.time())


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_now)  # the server gives every chunk of one response the same
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has ``id``, ``type`` and ``function.name`` (and
    ``arguments: ""``), the next ones ``arguments`` fragments; joined, they are the call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


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
    tool_calls: list[DeltaToolCall] | None = None


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
