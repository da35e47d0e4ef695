"""The generations of one completions request that holds several prompts, seen as one.

A batch of prompts (``"prompt": ["a", "b"]``, or token-id lists) is fanned out into one
:class:`~tensorrt_llm.serve.generation.Generation` per prompt (each with its ``n`` samples);
:class:`GenerationGroup` merges them back into one stream of :class:`Delta` values, as OpenAI
and vLLM serve such a request:

* prompt ``i``'s sample ``j`` is the choice ``i * n + j`` (``n``: the choices each prompt has);
* deltas of all prompts are interleaved as they come (no prompt waits for another);
* usage is summed over every prompt and sample, cumulative while streaming;
* the request ends when every generation has ended; one that fails (or a client that leaves)
  cancels all the others, so the request fails whole and frees every KV block it held.

It answers what the request path asks of a single generation (``deltas``, ``delta_batches``, ``abort``,
``finished``, token counts), so the handlers stream and collect it the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Iterator, Sequence

from tensorrt_llm.serve.generation import Delta, Generation, flattened

_END = object()  # a generation's last item on the merge queue


class GenerationGroup:
    """Several prompts' generations as one; iterate :meth:`deltas` once."""

    def __init__(self, generations: Sequence[Generation], choices_per_prompt: int) -> None:
        if not generations:
            raise ValueError("a generation group needs at least one generation")
        self.generations = list(generations)
        self.choices_per_prompt = choices_per_prompt
        self.prompt_tokens = sum(g.prompt_tokens for g in self.generations)

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens reused from the prefix cache over the prompts known so far; None
        until one is known."""
        known = [c for g in self.generations if (c := g.cached_tokens) is not None]
        return sum(known) if known else None

    @property
    def finished(self) -> bool:
        return all(g.finished for g in self.generations)

    @property
    def request_ids(self) -> list[int]:
        """The executor requests (one per prompt, before samples) the group submitted."""
        return [g.handle.request_id for g in self.generations]

    def abort(self) -> None:
        """Cancel every generation that has not ended (idempotent)."""
        for generation in self.generations:
            generation.abort()

    def deltas(self) -> AsyncIterator[Delta]:
        """Every generation's deltas, as they come, each with its choice index in the request.
        Raises the first generation's GenerationFailed (the others are cancelled)."""
        return flattened(self.delta_batches())

    async def delta_batches(self) -> AsyncIterator[Iterator[Delta]]:
        """:meth:`deltas` grouped by wake-up, as ``Generation.delta_batches`` groups them: a batch
        holds what the merge queue had when the loop got to it. Exhaust each before the next."""
        queue: asyncio.Queue = asyncio.Queue()  # (prompt, Delta | exception | _END)

        async def pump(prompt: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    queue.put_nowait((prompt, delta))
            except Exception as error:  # noqa: BLE001 - handed over to the merge, which raises it
                queue.put_nowait((prompt, error))
            else:
                queue.put_nowait((prompt, _END))

        pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        running = len(pumps)  # pumps not ended: counted down as the batches meet their _END

        def merged(item: tuple) -> Iterator[Delta]:
            """``item``'s delta, then those of the items already on the queue (none is awaited)."""
            nonlocal running
            while True:
                prompt, value = item
                if value is _END:
                    running -= 1
                elif isinstance(value, Exception):
                    raise value
                else:
                    yield dataclasses.replace(value, index=prompt * self.choices_per_prompt + value.index)
                if not running or queue.empty():
                    return
                item = queue.get_nowait()

        try:
            while running:
                yield merged(await queue.get())
        finally:
            # Ended, failed, or the consumer left: whatever still runs is cancelled. Cancelling a
            # pump closes its generation's deltas(), which records the metrics and aborts.
            for task in pumps:
                task.cancel()
            self.abort()
