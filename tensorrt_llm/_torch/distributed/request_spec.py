"""Requests as plain data: what rank 0 broadcasts so that every rank builds the same ``LlmRequest``.

A rank never builds a request from anything but a :class:`RequestSpec` it received in an
exchange, on its executor's own thread, just before the step that admits it. Every field
that a decision or a sampler reads comes from rank 0: the request id (sampler seeds default
to it, and ids from each rank's own counter would differ) and the arrival time (rank 0
stamps it, so no rank reads its own clock for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: int
    input_token_ids: tuple[int, ...]
    max_new_tokens: int
    beam_width: int = 1
    end_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    sampling_config: SamplingConfig = SamplingConfig()
    py_draft_tokens: tuple[int, ...] = ()
    max_draft_len: int = 0
    is_first_draft: bool = False
    arrival_time: float = 0.0
    priority: float = 0.5

    @classmethod
    def of(cls, request: LlmRequest, arrival_time: float) -> "RequestSpec":
        """The spec of a request not yet admitted anywhere; ``arrival_time`` if it has none."""
        return cls(
            request_id=request.request_id,
            input_token_ids=tuple(request.input_token_ids),
            max_new_tokens=request.max_new_tokens,
            beam_width=request.beam_width,
            end_id=request.end_id,
            stop_token_ids=tuple(request.stop_token_ids),
            sampling_config=request.sampling_config,
            py_draft_tokens=tuple(request.py_draft_tokens),
            max_draft_len=request.max_draft_len,
            is_first_draft=request.is_first_draft,
            arrival_time=request.arrival_time or arrival_time,
            priority=request.priority,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.input_token_ids)

    def build(self) -> LlmRequest:
        return LlmRequest(
            input_token_ids=list(self.input_token_ids),
            max_new_tokens=self.max_new_tokens,
            request_id=self.request_id,
            beam_width=self.beam_width,
            end_id=self.end_id,
            stop_token_ids=self.stop_token_ids,
            sampling_config=self.sampling_config,
            py_draft_tokens=list(self.py_draft_tokens),
            max_draft_len=self.max_draft_len,
            is_first_draft=self.is_first_draft,
            arrival_time=self.arrival_time,
            priority=self.priority,
        )
