"""Following a submitted request: :class:`RequestOutputHandle` folds the executor's responses for
each of its samples into a :class:`RequestOutput` (tokens, text, log-probabilities), streamed or
awaited, and fans the samples out (``n``, ``best_of``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, NamedTuple

from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown, RequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import TokenLogprob
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm.llmapi.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error"
    # With a tokenizer: the text of token_ids so far (control tokens left out; a character whose
    # bytes have not all arrived is held back until they do), and what the last step added to it.
    text: str | None = None
    text_diff: str = ""
    # With SamplingParams.logprobs: one entry per token of token_ids; and their sum.
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    prompt: str | None = None  # the prompt text, when the prompt was text
    generated_tokens: int = 0  # over every sample, those best_of drops included
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Prompt tokens whose KV the first sample reused from the prefix cache, from the executor's
    # response that carried its first token (None until then).
    cached_tokens: int | None = None

    @property
    def text(self) -> str | None:
        """The generated text (None for a model without a tokenizer)."""
        return self.outputs[0].text


class _Event(NamedTuple):
    """One executor response for sample ``index``, with the logprobs of its new tokens."""

    index: int
    response: Response
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on sample 0's first response, when asked for


class RequestOutputHandle:
    """A submitted request: iterate it to stream, ``result()`` to wait, ``abort()`` to cancel.

    A handle created inside a running asyncio event loop is consumed from that loop with
    ``async for`` and ``await aresult()``: each response crosses from the executor thread
    with ``loop.call_soon_threadsafe``, so the loop never blocks on the executor. Any other
    handle is consumed with ``for`` and ``result()``.

    Several samples (``n``, ``best_of``): one executor request each. Sample 0 is submitted
    first; the others when its first response arrives (its prompt is computed and its full
    blocks are in the prefix cache, which they claim). The request is finished when every
    sample is; one sample failing fails the request and cancels the others. With ``best_of >
    n`` the ``n`` samples with the highest cumulative log-probability are kept, at the end.
    """

    def __init__(self, executor, tokenizer: Tokenizer | None, requests: list[LlmRequest], prompt: str | None = None, *,
                 keep: int | None = None, report_logprobs: bool = False) -> None:
        """``executor``: what ``LLM`` serves with (``enqueue_request``, ``cancel_request``);
        ``requests``: one per sample, all of one prompt; ``keep``: the samples returned (best_of)."""
        self._executor = executor
        self._tokenizer = tokenizer
        self._requests = requests
        self._keep = keep if keep is not None else len(requests)
        self._report_logprobs = report_logprobs
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._events: queue.Queue[_Event] | None = None if self._loop else queue.Queue()
        self._aevents: asyncio.Queue[_Event] | None = asyncio.Queue() if self._loop else None
        first = requests[0]
        self.output = RequestOutput(
            first.request_id, list(first.input_token_ids), [CompletionOutput(i) for i in range(len(requests))],
            prompt=prompt,
        )
        self._detokenizers = [None if tokenizer is None else IncrementalDetokenizer(tokenizer) for _ in requests]
        for completion in self.output.outputs:
            if tokenizer is not None:
                completion.text = ""
            if any(r.sampling_config.logprobs is not None for r in requests):
                completion.logprobs, completion.cumulative_logprob = [], 0.0
        self._logprobs_sent = [0] * len(requests)  # executor thread only
        self._prompt_logprobs_sent = False  # executor thread only
        self._fan_out_lock = threading.Lock()
        self._submitted = 0  # samples handed to the executor (under _fan_out_lock)
        self._aborted = False

    @property
    def request_id(self) -> int:
        return self._requests[0].request_id

    def first_submission(self) -> tuple[LlmRequest, Callable[[LlmRequest, Response], None]]:
        """Sample 0 and its callback, for the caller to enqueue now (``LLM`` enqueues every
        prompt's first sample in one submission); the other samples follow its first response."""
        with self._fan_out_lock:
            self._submitted = 1
        return self._requests[0], functools.partial(self._on_response, 0)

    def _fan_out(self) -> None:
        """Submit samples 1.. (executor thread, on sample 0's first response). A sample the
        executor no longer takes ends with its error."""
        with self._fan_out_lock:
            if self._aborted or self._submitted != 1:
                return
            for index in range(1, len(self._requests)):
                request = self._requests[index]
                try:
                    self._executor.enqueue_request(request, functools.partial(self._on_response, index))
                except ExecutorShutdown as error:
                    self._post(_Event(index, Response(request.request_id, [], True, f"ExecutorShutdown: {error}")))
            self._submitted = len(self._requests)

    def _on_response(self, index: int, request: LlmRequest, response: Response) -> None:
        """Runs on the executor thread; never blocks, never raises into it."""
        logprobs: tuple[TokenLogprob, ...] = ()
        if request.sampling_config.logprobs is not None and response.new_token_ids:
            sent = self._logprobs_sent[index]
            logprobs = tuple(request.py_logprobs[sent : sent + len(response.new_token_ids)])
            self._logprobs_sent[index] = sent + len(logprobs)
        prompt_logprobs = None
        if index == 0 and request.sampling_config.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            self._prompt_logprobs_sent = True
            prompt_logprobs = list(request.py_prompt_logprobs)
        self._post(_Event(index, response, logprobs, prompt_logprobs))
        if index == 0 and len(self._requests) > 1:
            self._fan_out()

    def _post(self, event: _Event) -> None:
        if self._loop is None:
            self._events.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._aevents.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is waiting for this request any more
            pass

    def _apply(self, event: _Event) -> None:
        """Fold one executor response into ``output``. Text that cannot be decoded (an id the
        tokenizer does not know) fails this request alone, as an executor error would: it is
        cancelled in the executor and its output finishes with a DetokenizationError."""
        index, response = event.index, event.response
        if index == 0 and response.cached_tokens is not None and self.output.cached_tokens is None:
            self.output.cached_tokens = response.cached_tokens
        if response.beams is not None:
            self._apply_beams(response)
            return
        completion = self.output.outputs[index]
        completion.token_ids.extend(response.new_token_ids)
        self.output.generated_tokens += len(response.new_token_ids)
        if event.prompt_logprobs is not None:
            self.output.prompt_logprobs = event.prompt_logprobs
        if completion.logprobs is not None:
            completion.logprobs.extend(event.logprobs)
            completion.cumulative_logprob += sum(entry.logprob for entry in event.logprobs)
        finished, error = response.finished, response.error
        detokenizer = self._detokenizers[index]
        if detokenizer is not None:
            try:
                completion.text_diff = detokenizer.step(response.new_token_ids)
                if finished:
                    completion.text_diff += detokenizer.flush()
            except Exception as failure:  # noqa: BLE001 - whatever decoding raises is this request's alone
                completion.text_diff = ""
                error = error or f"DetokenizationError: request {self.request_id}: {type(failure).__name__}: {failure}"
                logger.error("%s", error)
                finished = True
            completion.text += completion.text_diff
        if error and self.output.error is None:
            self.output.error = error
            self.abort()  # the other samples stop; what they still send is folded in and ends them
        if finished and completion.finish_reason is None:
            if error:
                completion.finish_reason = "error"
            elif response.cancelled:
                completion.finish_reason = "cancelled"
            elif len(completion.token_ids) >= self._requests[index].max_new_tokens:
                completion.finish_reason = "length"
            else:
                completion.finish_reason = "stop"
        if all(c.finish_reason is not None for c in self.output.outputs):
            self.output.finished = True
            self._rank()

    def _apply_beams(self, response: Response) -> None:
        """A beam search's one response: an output per returned beam, best first, with its
        cumulative log-probability; ``finish_reason`` "stop" for a beam that ended on an end
        token, "length" for one cut at ``max_tokens``."""
        outputs = []
        for index, beam in enumerate(response.beams):
            completion = CompletionOutput(index, list(beam.tokens), "stop" if beam.finished else "length",
                                          cumulative_logprob=beam.cum_logprob)
            if self._tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self._tokenizer)
                try:
                    completion.text = completion.text_diff = detokenizer.step(completion.token_ids) + detokenizer.flush()
                except Exception as failure:  # noqa: BLE001 - whatever decoding raises is this request's alone
                    self.output.error = f"DetokenizationError: request {self.request_id}: {type(failure).__name__}: {failure}"
                    completion.finish_reason, completion.text = "error", ""
            outputs.append(completion)
        self.output.outputs = outputs
        self.output.generated_tokens += sum(len(c.token_ids) for c in outputs)
        self.output.finished = True

    def _rank(self) -> None:
        """``best_of``: keep the ``keep`` samples with the highest cumulative log-probability."""
        outputs = self.output.outputs
        if self._keep < len(outputs):
            outputs = sorted(outputs, key=lambda c: c.cumulative_logprob, reverse=True)[: self._keep]
            for index, completion in enumerate(outputs):
                completion.index = index
            self.output.outputs = outputs
        if not self._report_logprobs:
            for completion in outputs:
                completion.logprobs = completion.cumulative_logprob = None

    def __iter__(self) -> Iterator[RequestOutput]:
        """Yields the output after each step that changed it, until it is finished."""
        self._check_mode(asynchronous=False)
        while not self.output.finished:
            self._apply(self._events.get())
            yield self.output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """``__iter__`` for a handle created in an event loop, awaited on that loop."""
        self._check_mode(asynchronous=True)
        while not self.output.finished:
            self._apply(await self._aevents.get())
            yield self.output

    def poll(self) -> RequestOutput | None:
        """The output with the next response that has already arrived folded in, or None when
        none is waiting (or the output is finished); never waits. A consumer that was busy drains
        what arrived meanwhile with it, each response folded in alone as ``async for`` / ``for``
        would (a streaming server writes them out together: one write per wake-up, not per token)."""
        if self.output.finished:
            return None
        try:
            event = self._aevents.get_nowait() if self._loop is not None else self._events.get_nowait()
        except (asyncio.QueueEmpty, queue.Empty):
            return None
        self._apply(event)
        return self.output

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the final output; raises RequestError if the request failed."""
        self._check_mode(asynchronous=False)
        while not self.output.finished:
            self._apply(self._events.get(timeout=timeout))
        return self._final()

    async def aresult(self) -> RequestOutput:
        """``result()`` for a handle created in an event loop."""
        self._check_mode(asynchronous=True)
        while not self.output.finished:
            self._apply(await self._aevents.get())
        return self._final()

    def _final(self) -> RequestOutput:
        if self.output.error:
            raise RequestError(self.request_id, self.output.error)
        return self.output

    def _check_mode(self, *, asynchronous: bool) -> None:
        if asynchronous != (self._loop is not None):
            how = "async for / await aresult()" if self._loop else "for / result()"
            raise RuntimeError(f"request {self.request_id}: this handle is consumed with {how}")

    def abort(self, index: int | None = None) -> None:
        """Cancel every sample (or sample ``index``); a sample not submitted yet ends cancelled here."""
        indices = range(len(self._requests)) if index is None else (index,)
        with self._fan_out_lock:
            if index is None:
                self._aborted = True
            for i in indices:
                request = self._requests[i]
                if i < self._submitted:
                    self._executor.cancel_request(request.request_id)
                elif index is None:
                    self._post(_Event(i, Response(request.request_id, [], True, cancelled=True)))
