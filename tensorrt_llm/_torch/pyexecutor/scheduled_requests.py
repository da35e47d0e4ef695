"""One iteration's batch, as values.

The scheduler builds a :class:`ScheduledRequests`; ``prepare_resources`` returns the batch
that will run (chunks cut by the budget, shifted by reuse, requests deferred out of it);
``_prepare_tp_inputs`` and the executor's update read that one. Nobody changes a batch in
place: each stage hands a new one to the next.

A context request's share of a forward is a :class:`ContextChunk`, the prompt positions
``[start, start + size)``::

    prompt:  [0 ......... start ============ end ........................... prompt_len)
              computed or reused     this forward        later chunks

A first chunk's window may move when its allocation reuses a cached prefix: it then starts
at the reused length, keeps its size (a non-last chunk still ends on a block boundary) and
records the reuse in ``reused`` (:meth:`ContextChunk.after_reuse`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.forward_cost import context_cost
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest


@dataclass(frozen=True, slots=True)
class ContextChunk:
    """Prompt positions ``[start, start + size)`` of ``request``, computed in one forward.

    ``reused`` is the prefix the allocation of a first chunk reused (``start == reused``
    then); 0 for a later chunk or when nothing was reused.
    """

    request: LlmRequest
    start: int
    size: int
    reused: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.size < 0 or self.start + self.size > self.request.prompt_len:
            raise ValueError(f"{self.request!r}: no chunk of {self.size} tokens from position {self.start}")

    @classmethod
    def of(cls, request: LlmRequest, size: int) -> "ContextChunk":
        """The next ``size`` tokens of ``request``'s prompt (fewer if fewer are left)."""
        start = request.context_current_position
        return cls(request, start, min(size, request.prompt_len - start))

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def is_last(self) -> bool:
        """It finishes the prompt: it samples, and carries the draft tokens."""
        return self.start + self.size >= self.request.prompt_len

    def cost(self, *, reuse_can_shift: bool = False) -> int:
        """Its positions in the forward (``forward_cost.context_cost``); an upper bound over
        reuse outcomes with ``reuse_can_shift``."""
        return context_cost(self.request, self.size, self.start, reuse_can_shift=reuse_can_shift)

    def resized(self, size: int) -> "ContextChunk":
        return dataclasses.replace(self, size=size)

    def after_reuse(self, reused: int, tokens_per_block: int) -> "ContextChunk":
        """The window once the first ``reused`` prompt tokens come from the cache.

        It starts at ``reused`` and keeps its size, except that a chunk which is not the
        last still ends on a block boundary (floored, when that leaves it any token).
        """
        if not reused:
            return self
        prompt_len = self.request.prompt_len
        end = min(reused + self.size, prompt_len)
        if end < prompt_len:
            floored = end // tokens_per_block * tokens_per_block
            if floored > reused:  # chunks are whole blocks, so this holds unless a chunk is below one block
                end = floored
        return ContextChunk(self.request, reused, end - reused, reused)

    def __repr__(self) -> str:
        reused = f" reused={self.reused}" if self.reused else ""
        return f"Chunk(id={self.request.request_id} [{self.start}:{self.end}) of {self.request.prompt_len}{reused})"


@dataclass(frozen=True, slots=True)
class Deferral:
    """A scheduled request that left the batch before the forward, untouched, and why.

    ``cost`` is the forward cost the re-check charged it (0 where nothing was charged).
    """

    request: LlmRequest
    reason: DeferReason
    cost: int = 0


@dataclass(frozen=True, slots=True)
class ScheduledRequests:
    """One iteration's batch.

    ``charges`` maps request id to the tokens the scheduler charged at admission (reuse
    discounted under upstream's rule); ``estimated_reusable`` maps each first chunk's
    request id to upstream's reuse estimate the capacity stage computed for it.
    ``paused_requests`` are the requests the capacity stage preempts this iteration;
    ``preempted_for`` maps those paused for a waiting request of higher priority (priority
    preemption) to that request's id.
    ``generation_charge`` is the scheduler's charge for all of ``generation_requests``, summed
    (None for a batch built otherwise, or derived from one with :meth:`with_batch`).
    """

    context_chunks: list[ContextChunk] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    paused_requests: list[LlmRequest] = field(default_factory=list)
    charges: dict[int, int] = field(default_factory=dict)
    estimated_reusable: dict[int, int] = field(default_factory=dict)
    generation_charge: int | None = None
    preempted_for: dict[int, int] = field(default_factory=dict)

    @property
    def context_requests(self) -> list[LlmRequest]:
        return [chunk.request for chunk in self.context_chunks]

    @property
    def all_requests(self) -> list[LlmRequest]:
        return [*(chunk.request for chunk in self.context_chunks), *self.generation_requests]

    @property
    def batch_size(self) -> int:
        return len(self.context_chunks) + len(self.generation_requests)

    @property
    def is_empty(self) -> bool:
        return not self.context_chunks and not self.generation_requests

    @property
    def scheduled_tokens(self) -> int:
        return sum(self.charges.values())

    def with_batch(self, context_chunks: list[ContextChunk], generation_requests: list[LlmRequest]) -> "ScheduledRequests":
        """The same iteration with another set of chunks and generation steps."""
        return ScheduledRequests(
            context_chunks, generation_requests, self.paused_requests, self.charges, self.estimated_reusable,
            preempted_for=self.preempted_for,
        )

    def __repr__(self) -> str:
        return f"ScheduledRequests(context={self.context_chunks}, generation={self.generation_requests})"
