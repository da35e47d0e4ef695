"""One request's life on the event loop: executor outputs in, text deltas out.

:class:`Generation` consumes a request handle created on the event loop (each executor
response crosses threads with ``loop.call_soon_threadsafe``: the loop never blocks on the
executor) and yields :class:`Delta` values (one at a time, or in batches: all that arrived
while the loop was busy, which a stream writes out together): the new token ids, the new
text (the handle's incremental detokenizer never splits a UTF-8 character) with stop strings
applied, and, on the last one, the finish reason. Whatever way it ends — finished, stop string, executor
error, client gone — the request leaves the executor (``abort`` is idempotent) and its
metrics are recorded once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from tensorrt_llm._torch.pyexecutor.sampling_config import TokenLogprob
from tensorrt_llm.llmapi import RequestOutputHandle
from tensorrt_llm.serve.metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled", on the choice's last delta only
    index: int = 0  # the choice (sample) it belongs to
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when logprobs were asked for


class GenerationFailed(Exception):
    """The request ended with an error: the executor's (a failed batch, NaN logits, a dead loop) or its
    text's (an id the tokenizer cannot decode, see ``RequestOutputHandle._apply``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class StopStringMatcher:
    """Cuts streamed text at the first stop string to be completed; holds back any tail that
    could start one.

    ``push`` returns the text that is safe to emit and whether a stop string was found (the
    text before it is emitted; it and everything after are dropped). Text held back is
    released by ``flush`` once generation ends without a stop.
    """

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self.stop_strings = stop_strings
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stop_strings:
            return text, False
        buffer = self._pending + text
        # Generation stops the moment the first stop string is complete: the earliest *end* wins
        # (then the earliest start), so the cut is the same however the text was split into
        # deltas. The earliest start alone would let a stop completed later in the same delta
        # reach back before one that had already ended.
        hits = [(i + len(s), i) for s in self.stop_strings if (i := buffer.find(s)) >= 0]
        if hits:
            self._pending = ""
            return buffer[: min(hits)[1]], True
        hold = self._partial_stop_len(buffer)
        self._pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _partial_stop_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(len(buffer), max(len(s) for s in self.stop_strings) - 1)
        for length in range(longest, 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return length
        return 0


class _Choice:
    """What one choice has sent so far."""

    __slots__ = ("stops", "tokens", "chars", "logprobs", "finish_reason")

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self.stops = StopStringMatcher(stop_strings)
        self.tokens = self.chars = self.logprobs = 0
        self.finish_reason: str | None = None


async def flattened(batches: AsyncIterator[Iterator[Delta]]) -> AsyncIterator[Delta]:
    """The deltas of ``batches`` (a ``delta_batches()``) one at a time; closing this closes
    ``batches`` at once (its ``finally`` aborts a request whose consumer left)."""
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for delta in batch:
                yield delta


class Generation:
    """A submitted request seen from the event loop; iterate :meth:`deltas` once.

    Each sample is a choice with its own stop strings; a choice that meets one is cut there and
    its sample cancelled, the others go on. With ``best_of > n`` (``ranked``) the choices are
    known only at the end: each is sent whole then, stop strings applied to its text."""

    def __init__(self, handle: RequestOutputHandle, *, has_text: bool, stop_strings: tuple[str, ...],
                 metrics: RequestMetrics, ranked: bool = False) -> None:
        self.handle = handle
        self.has_text = has_text
        self.prompt_tokens = len(handle.output.prompt_token_ids)
        self._stop_strings = stop_strings
        self._ranked = ranked
        self._choices = [_Choice(stop_strings) for _ in handle.output.outputs]
        self._metrics = metrics
        self._counted = 0  # generated tokens reported to the metrics
        self._finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over every sample (what usage reports)."""
        return self.handle.output.generated_tokens

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the executor reused from the prefix cache for this request (its first
        sample's), known once its first token is out; None before."""
        return self.handle.output.cached_tokens

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    def abort(self) -> None:
        """Cancel the request in the executor (the client left); its KV blocks are freed there."""
        if not self.finished:
            self.handle.abort()

    def deltas(self) -> AsyncIterator[Delta]:
        """Each delta as it comes (:meth:`delta_batches`, flattened). Raises GenerationFailed when
        the executor fails the request."""
        return flattened(self.delta_batches())

    async def delta_batches(self) -> AsyncIterator[Iterator[Delta]]:
        """The deltas, grouped by wake-up: each batch holds the deltas of the executor response
        that woke the loop and of every response that had arrived by then (a stream that fell
        behind catches up in one write instead of one per token). A batch is lazy: each response
        is folded into ``handle.output`` only when its deltas are asked for, so the request's
        state (its usage so far) is, at each delta, what :meth:`deltas` shows at it. Exhaust each
        batch before asking for the next. Iterating a batch raises GenerationFailed when the
        executor fails the request (after the deltas of the responses before the failure)."""
        try:
            async for output in self.handle:
                yield self._caught_up(output)
                if self.finished:
                    return
        finally:
            if not self.finished:  # the consumer went away (client disconnect) before the end
                self._finish("cancelled")
                self.handle.abort()

    def _caught_up(self, output) -> Iterator[Delta]:
        """The deltas of ``output``, then of each response already waiting (none is awaited)."""
        while True:
            yield from self._deltas_of(output)
            if self.finished:
                return
            output = self.handle.poll()
            if output is None:
                return

    def _deltas_of(self, output) -> Iterator[Delta]:
        """What one executor response added; finishes the generation on its last."""
        new = output.generated_tokens - self._counted
        self._counted = output.generated_tokens
        self._metrics.tokens(new, self.prompt_tokens)
        if output.error:
            self._finish("error")
            raise GenerationFailed(output.error, 503 if output.error.startswith("ExecutorShutdown") else 500)
        if self._ranked:
            if output.finished:
                for completion in output.outputs:
                    yield self._whole(completion)
                self._finish(output.outputs[0].finish_reason)
            return
        for completion in output.outputs:
            delta = self._delta(completion)
            if delta is not None:
                yield delta
        if all(choice.finish_reason is not None for choice in self._choices):
            self._finish(self._choices[0].finish_reason)

    def _delta(self, completion) -> Delta | None:
        """What ``completion`` added since its last delta, or None."""
        choice = self._choices[completion.index]
        if choice.finish_reason is not None:
            return None  # cut by a stop string: what its cancelled sample still sends is dropped
        new_ids = completion.token_ids[choice.tokens :]
        choice.tokens = len(completion.token_ids)
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[choice.logprobs : choice.logprobs + len(new_ids)]
            choice.logprobs += len(logprobs)
        text = ""
        if self.has_text:
            text = completion.text[choice.chars :]
            choice.chars = len(completion.text)
        text, stopped = choice.stops.push(text)
        if stopped:
            choice.finish_reason = "stop"
            self.handle.abort(completion.index)  # the executor stops generating and frees the blocks
            return Delta(new_ids, text, "stop", completion.index, logprobs)
        if completion.finish_reason is not None:
            choice.finish_reason = completion.finish_reason
            return Delta(new_ids, text + choice.stops.flush(), completion.finish_reason, completion.index, logprobs)
        if new_ids or text:
            return Delta(new_ids, text, None, completion.index, logprobs)
        return None

    def _whole(self, completion) -> Delta:
        """A ranked choice, all at once."""
        stops = StopStringMatcher(self._stop_strings)
        text, stopped = stops.push(completion.text if self.has_text else "")
        reason = "stop" if stopped else completion.finish_reason
        return Delta(list(completion.token_ids), text if stopped else text + stops.flush(), reason, completion.index,
                     completion.logprobs)

    def _finish(self, reason: str) -> None:
        self._finish_reason = reason
        self._metrics.finished(reason)
