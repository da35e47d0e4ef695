"""One request's life on the event loop: executor outputs in, text deltas out.

:class:`Generation` consumes a request handle created on the event loop (each executor
response crosses threads with ``loop.call_soon_threadsafe``: the loop never blocks on the
executor) and yields :class:`Delta` values: the new token ids, the new text (the handle's
incremental detokenizer never splits a UTF-8 character) with stop strings applied, and, on
the last one, the finish reason. Whatever way it ends — finished, stop string, executor
error, client gone — the request leaves the executor (``abort`` is idempotent) and its
metrics are recorded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from tensorrt_llm.llmapi import RequestOutputHandle
from tensorrt_llm.serve.metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled", on the last delta only


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


class Generation:
    """A submitted request seen from the event loop; iterate :meth:`deltas` once."""

    def __init__(self, handle: RequestOutputHandle, *, has_text: bool, stop_strings: tuple[str, ...],
                 metrics: RequestMetrics) -> None:
        self.handle = handle
        self.has_text = has_text
        self.prompt_tokens = len(handle.output.prompt_token_ids)
        self.completion_tokens = 0
        self._stops = StopStringMatcher(stop_strings)
        self._metrics = metrics
        self._finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    def abort(self) -> None:
        """Cancel the request in the executor (the client left); its KV blocks are freed there."""
        if not self.finished:
            self.handle.abort()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Raises GenerationFailed when the executor fails the request."""
        try:
            async for output in self.handle:
                completion = output.outputs[0]
                new_ids = completion.token_ids[self.completion_tokens :]
                self.completion_tokens = len(completion.token_ids)
                self._metrics.tokens(len(new_ids), self.prompt_tokens)
                if output.error:
                    self._finish("error")
                    raise GenerationFailed(output.error, 503 if output.error.startswith("ExecutorShutdown") else 500)
                text, stopped = self._stops.push(completion.text_diff if self.has_text else "")
                if stopped:
                    self._finish("stop")
                    self.handle.abort()  # the executor stops generating and frees the blocks
                    yield Delta(new_ids, text, "stop")
                    return
                if output.finished:
                    self._finish(completion.finish_reason)
                    yield Delta(new_ids, text + self._stops.flush(), completion.finish_reason)
                    return
                if new_ids or text:
                    yield Delta(new_ids, text)
        finally:
            if not self.finished:  # the consumer went away (client disconnect) before the end
                self._finish("cancelled")
                self.handle.abort()

    def _finish(self, reason: str) -> None:
        self._finish_reason = reason
        self._metrics.finished(reason)
