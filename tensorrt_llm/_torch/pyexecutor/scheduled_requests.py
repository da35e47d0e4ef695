"""``ScheduledRequests``: what one iteration runs, built by the scheduler and trimmed by deferral."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest


@dataclass(slots=True)
class ScheduledRequests:
    """One iteration's batch.

    ``charges`` maps request id to the tokens the scheduler charged at admission (reuse
    discounted under upstream's rule); ``deferred_requests`` are requests that left the
    batch before the forward, with why. Deferral never touches the request's state.
    """

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    paused_requests: list[LlmRequest] = field(default_factory=list)
    deferred_requests: list[tuple[LlmRequest, DeferReason]] = field(default_factory=list)
    charges: dict[int, int] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def all_requests(self) -> list[LlmRequest]:
        return [*self.context_requests, *self.generation_requests]

    @property
    def is_empty(self) -> bool:
        return not self.context_requests and not self.generation_requests

    @property
    def scheduled_tokens(self) -> int:
        return sum(self.charges.values())

    def defer(self, request: LlmRequest, reason: DeferReason) -> None:
        """Take ``request`` out of this iteration; it stays active and untouched."""
        batch = self.context_requests if request.is_context_init_state else self.generation_requests
        batch.remove(request)
        self.deferred_requests.append((request, reason))
        if reason is DeferReason.BUDGET:
            request.py_budget_deferred = True
            request.num_budget_deferrals += 1
            request.consecutive_budget_deferrals += 1
            request.max_consecutive_budget_deferrals = max(
                request.max_consecutive_budget_deferrals, request.consecutive_budget_deferrals
            )
        else:
            request.num_capacity_deferrals += 1

    def __repr__(self) -> str:
        parts = [f"context={self.context_requests}", f"generation={self.generation_requests}"]
        if self.deferred_requests:
            parts.append(f"deferred={[(r.request_id, why.value) for r, why in self.deferred_requests]}")
        return f"ScheduledRequests({', '.join(parts)})"
