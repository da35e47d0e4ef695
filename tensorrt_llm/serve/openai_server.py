"""``OpenAIServer``: the FastAPI app of DESIGN.md §6 over one :class:`~tensorrt_llm.LLM`.

Request path::

    EdgeProtocol (http_server: framing 400, head 408 / 431, connections 503)
      -> RequestGuard (head 431, key 401, body 408 / 413, before any parsing)
      -> FastAPI (pydantic, strict: 400 on bad fields)
      -> handler: model check (404), prompt -> token ids (text through the tokenizer, on a
         worker thread), sampling params, admission (executor unhealthy or its queue at
         ``max_queue_size``: 503 with Retry-After), LLM.generate_async (executor
         validation: 400; dead or shut down executor: 503)
      -> Generation.deltas() on the event loop -> one JSON response, or SSE chunks ending
         in ``data: [DONE]`` (the chunks of all deltas that arrived together: one write)

Admission fails fast rather than queueing: a load balancer in front of several replicas
reads a 503 with ``Retry-After`` as "send it elsewhere", where a request queued behind a
stalled loop would only time out.

Nothing on the event loop waits on the executor thread: responses cross with
``call_soon_threadsafe`` (see ``RequestOutputHandle``). A client that disconnects has its
request cancelled in the executor, which frees its KV blocks. A request the executor fails
ends with HTTP 500 (503 when the executor shut down or died), or, streamed, with a final
``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import re
import reprlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY
from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown
from tensorrt_llm.llmapi import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm.serve.errors import OpenAIError, bad_request, error_body
from tensorrt_llm.serve.generation import Delta, Generation, GenerationFailed
from tensorrt_llm.serve.generation_group import GenerationGroup
from tensorrt_llm.serve.logprobs import LogprobFormatter
from tensorrt_llm.serve.metrics import ServerMetrics
from tensorrt_llm.serve.middleware import RequestGuard
from tensorrt_llm.serve.openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    ResponseFormat,
    UsageInfo,
    chat_completion_id,
    completion_id,
)
from tensorrt_llm.serve.prompts import PromptRenderer, read_chat_template
from tensorrt_llm.serve.server_config import ServerConfig
from tensorrt_llm.serve.tool_calling import (
    ToolDeltas,
    finish_reason,
    message_of,
    plan_tools,
)
from tensorrt_llm.serve.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_QUEUE_FULL_S = 1  # the queue drains by a request an iteration: come back soon (or elsewhere)
RETRY_AFTER_UNHEALTHY_S = 10  # a stalled loop may recover; a dead one will not: go elsewhere
_REQUEST_PREFIX = re.compile(r"^request \d+: ")  # the executor's internal id means nothing to a client


def _version() -> str:
    try:
        return importlib.metadata.version("tensorrt-llm-budget")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown"


class OpenAIServer:
    """Build with an LLM and the front's settings; serve ``server.app`` (with
    ``http_server.uvicorn_config`` for the edge limits). The app owns the LLM: it shuts it down
    when the app shuts down. ``api_key`` is short for ``ServerConfig(api_key=...)``."""

    def __init__(self, llm: LLM, config: ServerConfig | None = None, *, api_key: str | None = None) -> None:
        if config is not None and api_key is not None:
            raise TypeError("give the API key in config or as api_key, not both")
        self.config = config = config if config is not None else ServerConfig(api_key=api_key)
        self.llm = llm
        self.executor = llm.executor
        self.model_id: str = llm.model_id
        self.tokenizer = llm.tokenizer
        self.logprobs = LogprobFormatter(llm.tokenizer)
        self.metrics = ServerMetrics(self.executor, kv_bytes_per_token=llm.kv_bytes_per_token)
        self.created = int(time.time())
        self.version = _version()
        # generation_config.json's sampling values: what a request that leaves a field unset runs with
        self.sampling_defaults = llm.generation_defaults.sampling_kwargs()
        self.sampling_defaults.pop("max_tokens", None)  # a request's length stays OpenAI's default
        if self.sampling_defaults:
            logger.info("sampling defaults from the checkpoint's generation_config.json: %s", self.sampling_defaults)
        self.tool_parser = get_tool_parser(config.tool_parser) if config.tool_parser else None
        self.chat_template = read_chat_template(config.chat_template) if config.chat_template else (
            llm.tokenizer.chat_template if llm.tokenizer is not None else None)
        self.prompts = PromptRenderer(self.model_id, self.tokenizer, self.chat_template)
        self.fastapi = app = FastAPI(title="trtllm-serve", version=self.version, lifespan=self._lifespan)
        app.add_exception_handler(OpenAIError, self._on_openai_error)
        app.add_exception_handler(RequestValidationError, self._on_validation_error)
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)
        app.add_exception_handler(Exception, self._on_unexpected_error)
        app.get("/v1/models")(self.list_models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/health")(self.health)
        app.get("/metrics")(self.iteration_metrics)
        app.get("/prometheus/metrics")(self.prometheus_metrics)
        app.get("/version")(self.get_version)
        self.app = RequestGuard(app, config)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        yield
        await asyncio.to_thread(self.llm.shutdown)  # joins the executor thread: not on the loop

    # ------------------------------------------------------------------------------ open endpoints
    async def health(self) -> JSONResponse:
        health = self.executor.health()
        report = health.to_dict()
        report.pop("healthy")
        if health.healthy:
            report.pop("reason")
            return JSONResponse({"status": "ok", **report})
        return JSONResponse({"status": "unhealthy", **report}, status_code=503)

    async def iteration_metrics(self) -> JSONResponse:
        """The most recent iteration statistics (the executor keeps a bounded ring of them), each
        naming its ``rank``: 0 on one rank; rank 0's only under TP, every rank's under attention
        DP, ordered by iteration then rank."""
        return JSONResponse([{"rank": rank, **stats.to_dict()} for rank, stats in self.executor.iteration_stats_by_rank()])

    async def prometheus_metrics(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def get_version(self) -> dict:
        return {"version": self.version}

    # ------------------------------------------------------------------------------ /v1
    async def list_models(self) -> ModelList:
        card = ModelCard(id=self.model_id, created=self.created, max_model_len=self.llm.config.max_seq_len,
                         vocab_size=self.llm.model_config.vocab_size)
        return ModelList(data=[card])

    async def completions(self, body: CompletionRequest, raw: Request):
        self._check_model(body.model)
        prompts = body.prompts
        params = [_prompt_param(i, len(prompts)) for i in range(len(prompts))]
        prompts_ids = [await self.prompts.encode(prompt, param) for prompt, param in zip(prompts, params)]
        generation = await self._fan_out(body, prompts_ids, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        echoes = [""] * len(prompts)
        if body.echo:  # the prompt's text leads each choice's text, as OpenAI echoes it (ids checked: queued)
            echoes = [prompt if isinstance(prompt, str) else (self.tokenizer.decode(ids) if self.tokenizer is not None
                                                                 else "") for prompt, ids in zip(prompts, prompts_ids)]
        request_id, created = completion_id(), int(time.time())
        offsets: dict[int, int] = {}  # choice -> characters of its text sent so far (logprobs' text_offset)
        per_prompt = generation.generations if isinstance(generation, GenerationGroup) else [generation]
        choices_per_prompt = body.n or 1  # choice i * n + j: prompt i's sample j

        def choice_of(index: int, token_ids: list[int], text: str, finish_reason: str | None,
                      logprobs: list | None) -> CompletionChoice:
            prompt = None
            if index not in offsets:  # the choice's first chunk: its prompt's echo leads it
                i = index // choices_per_prompt
                text = echoes[i] + text
                offsets[index] = 0
                if body.echo and body.logprobs is not None:
                    prompt_ids, output = prompts_ids[i], per_prompt[i].handle.output
                    prompt = (prompt_ids, output.prompt_logprobs or [None] * len(prompt_ids))
            formatted = None
            if body.logprobs is not None:
                formatted, offsets[index] = self.logprobs.completion(logprobs or [], offsets[index], prompt)
            else:
                offsets[index] += len(text)
            return CompletionChoice(index=index, text=text, token_ids=token_ids, finish_reason=finish_reason,
                                    logprobs=formatted)

        def chunk(delta: Delta) -> CompletionResponse:
            choice = choice_of(delta.index, delta.token_ids, delta.text, delta.finish_reason, delta.logprobs)
            return CompletionResponse(id=request_id, created=created, model=self.model_id, choices=[choice])

        def usage_chunk(usage: UsageInfo) -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=self.model_id, choices=[], usage=usage)

        if body.stream:
            return self._stream(generation, raw, [], chunk, usage_chunk if body.include_usage else None,
                                continuous_usage=body.continuous_usage)
        choices = [choice_of(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs)
                   for c in await self._collect(generation, raw)]
        return CompletionResponse(id=request_id, created=created, model=self.model_id, choices=choices,
                                  usage=self._usage(generation))

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check_model(body.model)
        plan = plan_tools(body, self.tool_parser, self.chat_template)
        prompt_ids = await self.prompts.render_chat(body, plan)
        max_tokens = body.max_new_tokens or max(1, self.llm.config.max_seq_len - len(prompt_ids))
        generation = await self._submit(body, prompt_ids, max_tokens, guided=plan.grammar)
        request_id, created = chat_completion_id(), int(time.time())

        def logprobs(entries: list | None) -> ChatLogprobs | None:
            return self.logprobs.chat(entries or []) if body.logprobs else None

        def response(choices: list[ChatCompletionStreamChoice]) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_id, choices=choices)

        tool_deltas: dict[int, ToolDeltas] = {}

        def chunk(delta: Delta) -> list[ChatCompletionStreamResponse]:
            """The delta's chunks: one, or with tools one per content piece or call delta (its
            token ids and logprobs on the first, its finish reason on the last)."""
            index = delta.index
            if plan.parser is None:
                messages = [DeltaMessage(content=delta.text) if delta.text or not delta.finish_reason else DeltaMessage()]
                reason = delta.finish_reason
            else:
                calls = tool_deltas.setdefault(index, ToolDeltas(plan.stream()))
                messages = list(calls.deltas(delta.text, last=delta.finish_reason is not None)) or [DeltaMessage()]
                reason = finish_reason(delta.finish_reason, calls.calls)
            last = len(messages) - 1
            return [response([ChatCompletionStreamChoice(
                index=index, delta=message, token_ids=delta.token_ids if i == 0 else [],
                finish_reason=reason if i == last else None, logprobs=logprobs(delta.logprobs) if i == 0 else None)])
                for i, message in enumerate(messages)]

        def usage_chunk(usage: UsageInfo) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_id, choices=[],
                                                usage=usage)

        if body.stream:  # the role chunk: sent with the first token (see _stream)
            first = response([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                              for i in range(body.n or 1)])
            return self._stream(generation, raw, [first], chunk, usage_chunk if body.include_usage else None,
                                continuous_usage=body.continuous_usage)
        choices = []
        for c in await self._collect(generation, raw):
            message, calls = message_of(plan, c.text)
            choices.append(ChatCompletionChoice(index=c.index, message=message, token_ids=c.token_ids,
                                                finish_reason=finish_reason(c.finish_reason, calls),
                                                logprobs=logprobs(c.logprobs)))
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_id, choices=choices,
                                      usage=self._usage(generation))

    # ------------------------------------------------------------------------------ request parts
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}", "model")

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                      max_tokens: int, *, guided: GuidedDecodingParams | None = None) -> Generation:
        """``guided``: the grammar tools require (else ``response_format``'s, if any)."""
        params = await self._sampling_params(body, max_tokens, guided)
        self._admit()  # no await from here to the enqueue: the queue bound holds exactly
        return self._enqueue(body, params, prompt_ids)

    async def _fan_out(self, body: CompletionRequest, prompts_ids: list[list[int]],
                       max_tokens: int) -> Generation | GenerationGroup:
        """One generation per prompt: a single prompt's as :meth:`_submit` makes it; a batch's as
        a :class:`GenerationGroup`. A batch is checked whole (:meth:`_check_prompts`) and admitted
        whole before any prompt is queued; should the executor still refuse one, those already
        queued are cancelled and the request fails, naming the prompt."""
        if len(prompts_ids) == 1:
            return await self._submit(body, prompts_ids[0], max_tokens)
        self._check_prompts(prompts_ids, max_tokens)
        params = await self._sampling_params(body, max_tokens)
        self._admit()  # no await from here to the last enqueue: the batch is admitted whole
        generations: list[Generation] = []
        try:
            for i, prompt_ids in enumerate(prompts_ids):
                generations.append(self._enqueue(body, params, prompt_ids, param=_prompt_param(i, len(prompts_ids))))
        except OpenAIError:
            for generation in generations:
                generation.abort()
            raise
        return GenerationGroup(generations, choices_per_prompt=params.n)

    def _check_prompts(self, prompts_ids: list[list[int]], max_tokens: int) -> None:
        """400 naming ``prompt.<i>`` for the first prompt of a batch the executor could never
        serve (a token outside the vocabulary, no room for ``max_tokens`` in ``max_seq_len``),
        so that a bad prompt fails the request before any of it is queued. The executor checks
        each again (and more: KV blocks, chunking) when it is queued."""
        vocab_size, max_seq_len = self.llm.model_config.vocab_size, self.llm.config.max_seq_len
        for i, prompt_ids in enumerate(prompts_ids):
            param = _prompt_param(i, len(prompts_ids))
            bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param)
            if len(prompt_ids) + max_tokens > max_seq_len:
                raise bad_request(f"{param}: prompt length {len(prompt_ids)} + max_tokens {max_tokens} exceeds"
                                  f" max_seq_len {max_seq_len}", param)

    async def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                               guided: GuidedDecodingParams | None = None) -> SamplingParams:
        """The request's sampling parameters, its grammar compiled (400 naming the field)."""
        if body.stop_strings and self.tokenizer is None:
            raise bad_request(f"stop sequences need a tokenizer and model {self.model_id!r} has none", "stop")
        # A field the request leaves unset takes the checkpoint's generation_config.json value (as
        # vLLM does), else OpenAI's default. Beam search ranks log-probabilities: no sampling defaults.
        defaults = {} if body.use_beam_search else self.sampling_defaults
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=(0.0 if body.use_beam_search else defaults.get("temperature", 1.0))
                if body.temperature is None else body.temperature,
                top_k=defaults.get("top_k", 0) if body.top_k is None else body.top_k_value,
                top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
                min_p=defaults.get("min_p", 0.0) if body.min_p is None else body.min_p,
                seed=body.seed,
                ignore_eos=bool(body.ignore_eos),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                n=body.n or 1,
                best_of=body.best_of,
                use_beam_search=bool(body.use_beam_search),
                length_penalty=body.length_penalty,
                early_stopping=body.early_stopping_value,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=defaults.get("repetition_penalty", 1.0)
                if body.repetition_penalty is None else body.repetition_penalty,
                min_tokens=body.min_tokens or 0,
                logprobs=_logprobs_asked(body),
                prompt_logprobs=body.logprobs if getattr(body, "echo", False) else None,
                guided_decoding=guided or _guided_decoding(body.response_format),
            )
        except ValueError as error:
            raise bad_request(str(error)) from None
        if params.guided_decoding is not None:  # compiled off the loop; generate_async finds it cached
            param = "tools" if guided is not None else "response_format"
            try:
                await asyncio.to_thread(self.llm.compile_grammar, params.guided_decoding)
            except ValueError as error:
                raise bad_request(str(error).replace("guided_decoding", param), param) from None
        return params

    def _enqueue(self, body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
                 prompt_ids: list[int], *, param: str | None = None) -> Generation:
        """Queue one prompt (admitted by the caller). ``param``: what the executor's refusal
        names (a batch's ``prompt.<i>``)."""
        priority = DEFAULT_PRIORITY if body.priority is None else body.priority
        metrics = self.metrics.request(priority)
        try:
            handle = self.llm.generate_async(prompt_ids, params, priority=priority)
        except ExecutorShutdown as error:
            raise self._reject("unhealthy", f"the server cannot take requests: {error}", RETRY_AFTER_UNHEALTHY_S) from None
        except ValueError as error:  # InvalidRequestError included: the executor could never serve it
            message = _REQUEST_PREFIX.sub("", str(error))
            raise bad_request(message if param is None else f"{param}: {message}", param) from None
        return Generation(handle, has_text=self.tokenizer is not None, stop_strings=body.stop_strings,
                          metrics=metrics, ranked=params.ranks_samples)

    def _admit(self) -> None:
        """Refuse (503, Retry-After) instead of queueing behind an executor that is unhealthy
        (its loop stalled past ``health_check_timeout_s``, died or shut down: what ``/health``
        reports) or whose waiting requests have reached ``max_queue_size``."""
        health = self.executor.health()
        if not health.healthy:
            raise self._reject("unhealthy", f"the server cannot take requests: {health.reason}",
                               RETRY_AFTER_UNHEALTHY_S)
        limit = self.config.max_queue_size
        if limit is not None and (waiting := self.metrics.load().waiting) >= limit:
            raise self._reject("queue_full", f"the server cannot take requests: {waiting} are waiting"
                                             f" (max_queue_size={limit})", RETRY_AFTER_QUEUE_FULL_S)

    def _reject(self, reason: str, message: str, retry_after_s: int) -> OpenAIError:
        self.metrics.rejected(reason)
        return OpenAIError(503, message, headers={"Retry-After": str(retry_after_s)})

    @staticmethod
    def _usage(generation: Generation | GenerationGroup) -> UsageInfo:
        """Usage so far: cumulative while streaming, whole at the end."""
        return UsageInfo.of(generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)

    async def _collect(self, generation: Generation | GenerationGroup, raw: Request) -> list[_Collected]:
        """Every choice, whole, in index order."""
        choices: dict[int, _Collected] = {}
        watcher = asyncio.create_task(_abort_on_disconnect(raw, generation))
        try:
            async for delta in generation.deltas():
                choice = choices.setdefault(delta.index, _Collected(delta.index))
                choice.token_ids += delta.token_ids
                choice.texts.append(delta.text)
                choice.finish_reason = delta.finish_reason
                if delta.logprobs is not None:
                    choice.logprobs += delta.logprobs
        except GenerationFailed as error:
            raise OpenAIError(error.status, error.message) from None
        finally:
            watcher.cancel()
        return [choices[index] for index in sorted(choices)]

    def _stream(self, generation: Generation | GenerationGroup, raw: Request, preamble: list, chunk: Callable,
                usage_chunk: Callable | None, *, continuous_usage: bool = False) -> StreamingResponse:
        """SSE events: ``preamble``, one ``chunk(delta)`` per delta (each with the usage so far
        when ``continuous_usage``), the ``usage_chunk`` if asked for, ``[DONE]``.

        The preamble (chat's role chunk) goes out with the first delta, not when the request is
        accepted: benchmark clients (``vllm bench serve``) stamp the time to first token at the
        first chunk that has choices, and vLLM and upstream send the role chunk with the first
        token too. It carries no token: with ``continuous_usage`` its ``completion_tokens`` is 0."""

        def event(response, usage: UsageInfo | None = None) -> str:
            if continuous_usage:
                response.usage = usage or self._usage(generation)
            return _sse(response.model_dump_json())

        def opening() -> Iterator[str]:
            nothing_yet = UsageInfo.of(generation.prompt_tokens, 0, generation.cached_tokens)
            for first in preamble:
                yield event(first, nothing_yet)
            preamble.clear()

        async def events() -> AsyncIterator[str]:
            # One write per wake-up, not per event: the events of every delta that arrived while
            # the loop was busy go out in one piece (each still its own ``data:`` event), and the
            # last delta's go out with the usage chunk and [DONE]. A loop that falls behind under
            # many streams then pays the send path (ASGI, h11, a socket write) once per batch.
            watcher = asyncio.create_task(_abort_on_disconnect(raw, generation))
            pending: list[str] = []
            try:
                async with contextlib.aclosing(generation.delta_batches()) as batches:
                    async for batch in batches:
                        for delta in batch:
                            pending.extend(opening())
                            pending.extend(event(response) for response in _as_list(chunk(delta)))
                        if pending and not generation.finished:
                            yield "".join(pending)
                            pending.clear()
                pending.extend(opening())  # a stream with no delta still opens
                if usage_chunk is not None:
                    pending.append(_sse(usage_chunk(self._usage(generation)).model_dump_json()))
            except GenerationFailed as error:  # after the events of the deltas before it
                pending.append(_sse(json.dumps(error_body(error.status, error.message))))
            except Exception as error:  # noqa: BLE001 - a bug: the stream still ends, with the error
                logger.exception("request %s: the stream failed", _request_ids(generation))
                generation.abort()
                pending.append(_sse(json.dumps(error_body(500, f"internal error: {type(error).__name__}: {error}"))))
            finally:
                watcher.cancel()
            pending.append(_sse("[DONE]"))
            yield "".join(pending)

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------------------ errors
    # Each refusal logs one line; an unexpected error is logged once, with its traceback, by
    # RequestGuard (starlette re-raises it after this handler's answer).
    async def _on_openai_error(self, request: Request, error: OpenAIError) -> JSONResponse:
        _log_refusal(request, error.status, error.message)
        return error.response()

    async def _on_validation_error(self, request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(error.errors())
        _log_refusal(request, 400, message)
        return JSONResponse(error_body(400, message, param), status_code=400)

    async def _on_http_error(self, request: Request, error: StarletteHTTPException) -> JSONResponse:
        _log_refusal(request, error.status_code, str(error.detail))
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code,
                            headers=error.headers)

    async def _on_unexpected_error(self, request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}: {error}"), status_code=500)


@dataclass(slots=True)
class _Collected:
    """One choice of a non-streamed answer, gathered from its deltas."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _logprobs_asked(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per token the answer lists (None: no logprobs): completions' ``logprobs: k``,
    chat's ``logprobs: true`` with ``top_logprobs: k`` (0 when absent)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


def _guided_decoding(response_format: ResponseFormat | None) -> GuidedDecodingParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GuidedDecodingParams(json_object=True)
    schema = response_format.json_schema.schema_
    return GuidedDecodingParams(json=schema if schema is not None else {})


def _as_list(chunks) -> list:
    """A chunk builder's answer: one chunk, or several (a delta that ends a tool call)."""
    return chunks if isinstance(chunks, list) else [chunks]


def _prompt_param(index: int, count: int) -> str:
    """What an error about a completions request's prompt ``index`` names: ``prompt`` for a
    single prompt, ``prompt.<index>`` in a batch (as pydantic names a list's items)."""
    return "prompt" if count == 1 else f"prompt.{index}"


def _request_ids(generation: Generation | GenerationGroup) -> str:
    """The executor request id(s) a log line names."""
    if isinstance(generation, GenerationGroup):
        return ", ".join(str(i) for i in generation.request_ids)
    return str(generation.handle.request_id)


def _log_refusal(request: Request, status: int, message: str) -> None:
    logger.info("refused %s %s: %d %.300s", request.method, request.url.path, status, message)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _abort_on_disconnect(raw: Request, generation: Generation | GenerationGroup) -> None:
    """Cancel the request (every prompt's generation of a batch) when the client goes away (the
    body has been read: only ``http.disconnect`` can arrive now)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            if not generation.finished:
                logger.info("client disconnected: cancelling request %s", _request_ids(generation))
            generation.abort()
            return


def _describe_validation_error(errors) -> tuple[str, str | None]:
    """OpenAI-style message and param for the first pydantic error of a request body."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind, msg = first.get("type", ""), first.get("msg", "invalid request")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", msg)
        return f"malformed JSON body: {detail}", None
    if kind == "extra_forbidden":
        return f"unrecognized request argument {param!r}: this server does not support it", param
    if kind == "missing":
        return f"{param} is required", param
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return msg, param
    if param is None:
        return f"invalid request body: {msg}", None
    return f"{param}: {msg} (got {_short_repr(first.get('input'))})", param


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 100
_REPR.maxlevel = 3


def _short_repr(value) -> str:
    """``repr`` bounded in length and depth (an input may be a 16 MiB list, or nested 1000 deep)."""
    return _REPR.repr(value)
