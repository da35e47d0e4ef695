"""Failure handling: what fails with an error, what starts over, and the counts ``Health`` reports.

An iteration never fails as a whole. Whatever raises fails the smallest thing it concerns, and
the next iteration serves everyone else::

    what raised                                   where                  what fails
    ───────────                                   ─────                  ──────────
    a request's logits or settings (SamplingError) completion             that request alone
    TokenBudgetExceeded (the forward's own check)  launch                 the batch (a budget violation)
    prepare_resources (a bug, not the device)      launch                 the batch
    the launch, or the forward on the device       launch / completion    the batch: each request with a
                                                                          retry left starts over, the others fail
    anything else at completion                    completion             the batch
    anything outside a batch                       the loop (recover)     every active request
    the loop stops or dies                         the loop (fail_all)    every request held or queued

A request fails once: it loses the placeholders of forwards in flight, takes ``ERROR`` and its
error text, and gets one final response; the executor frees it (``Responses.take_finished``).
A request that starts over (a failed forward, a pause, a preemption) recomputes its context, so
it must fit one forward when chunked prefill is off (:func:`restart_refusal`).

Decisions are values: :func:`retry_or_fail` splits a failed forward's requests, and
:func:`restart_refusal` says why a request cannot start over; :class:`Failures` carries them out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Iterable

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.iteration.launch import drop_in_flight_tokens
from tensorrt_llm._torch.pyexecutor.iteration.records import BatchFailure
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
    from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """A failed forward's requests: those that start over as context, and those that fail."""

    retry: list[LlmRequest]
    fail: list[LlmRequest]


def retry_or_fail(requests: Iterable[LlmRequest], max_retries: int, dropping: Collection[int] = ()) -> RetryDecision:
    """Split a failed forward's ``requests``: one with a retry left (``max_retries`` in a row, see
    ``LlmRequest.can_retry_forward``) starts over, another fails. A request already over, or one
    in ``dropping`` (starting over already: a forward built on its failed one's tokens), is in
    neither."""
    retry, fail = [], []
    for request in requests:
        if request.is_finished or request.request_id in dropping:
            continue
        (retry if request.can_retry_forward(max_retries) else fail).append(request)
    return RetryDecision(retry, fail)


def restart_refusal(request: LlmRequest, why: str, *, max_num_tokens: int, chunked: bool) -> InvalidRequestError | None:
    """Why ``request``, starting over as context (``why``), could never run again, or None: with
    chunked prefill off its whole context (prompt + generated + drafts) must fit one forward, and
    a request that never fits would hold up every context request queued behind it."""
    context = request.prompt_len + request.num_draft_tokens  # now with its generated tokens
    if chunked or context <= max_num_tokens:
        return None
    return InvalidRequestError(
        f"request {request.request_id}: {why}, its context of {context} tokens (prompt + generated)"
        f" exceeds max_num_tokens {max_num_tokens} and chunked prefill is off"
    )


class Failures:
    """Fails requests and batches, starts requests over, and counts what ``Health`` reports
    (failed batches, budget violations, the last error). On the executor's thread only."""

    def __init__(
        self, config: ExecutorConfig, responses: Responses, resource_manager: ResourceManager, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.responses = responses
        self.resource_manager = resource_manager
        self.clock = clock
        self.num_failed_batches = 0
        self.num_budget_violations = 0  # batches that failed TokenBudgetExceeded
        self.last_error: str | None = None

    # ---- one request ------------------------------------------------------------------
    def fail(self, request: LlmRequest, error: Exception) -> None:
        """End ``request`` with ``error`` (nothing happens to a request already over)."""
        if request.is_finished:
            return
        drop_in_flight_tokens(request)
        request.set_error(f"{type(error).__name__}: {error}")
        request.finish_time = self.clock()
        self.responses.finish(request, Response(request.request_id, [], finished=True, error=request.error))

    def check_restartable(self, request: LlmRequest, why: str, drafter: Drafter | None) -> None:
        """``request`` starts over as context (``why``): the ``drafter`` (speculative decoding)
        takes its drafts away, and it fails if it could never run again (:func:`restart_refusal`)."""
        if drafter is not None:
            drafter.prepare_draft_tokens((request,))
        config = self.config
        error = restart_refusal(request, why, max_num_tokens=config.max_num_tokens, chunked=config.enable_chunked_prefill)
        if error is not None:
            self.fail(request, error)

    def start_over(self, requests: Iterable[LlmRequest], drafter: Drafter | None) -> None:
        """The requests of a failed forward start over as context: KV freed (what the forward
        should have written cannot be trusted), generated tokens kept and recomputed, so a
        streamed output goes on where it stopped. The caller has completed any forward in flight
        that holds them (their blocks cannot be freed under it)."""
        for request in requests:
            if request.is_finished:  # finished by the forward that just completed
                continue
            drop_in_flight_tokens(request)
            self.resource_manager.free_resources(request, store_for_reuse=False)
            request.retry_after_failed_forward()
            self.check_restartable(request, "its forward failed and it starts over", drafter)

    # ---- a batch ----------------------------------------------------------------------
    def fail_batch(self, requests: list[LlmRequest], error: Exception) -> BatchFailure:
        """Every request of a failed batch fails with ``error``."""
        self._count(error)
        for request in requests:
            self.fail(request, error)
        return BatchFailure(str(error), len(requests))

    def budget_exceeded(self, requests: list[LlmRequest], error: Exception) -> BatchFailure:
        """A batch past ``max_num_tokens`` (``TokenBudgetExceeded``): it fails, counted as a violation."""
        self.num_budget_violations += 1
        return self.fail_batch(requests, error)

    def batch_raised(self, requests: list[LlmRequest], error: Exception, iteration: int) -> BatchFailure:
        """An unexpected error at launch or completion: logged with its traceback (call from the
        ``except`` block); the batch fails."""
        logger.exception("iteration %d failed; failing its %d requests", iteration, len(requests))
        return self.fail_batch(requests, error)

    def forward_failed(
        self, requests: list[LlmRequest], error: Exception, iteration: int, dropping: Collection[int] = ()
    ) -> tuple[list[LlmRequest], BatchFailure]:
        """A forward failed at launch or on the device (call from the ``except`` block). The batch
        counts as failed; the requests :func:`retry_or_fail` retries are returned, for the caller
        to start over once no forward in flight holds them; the others fail with the error."""
        logger.exception("iteration %d: the forward failed; retrying or failing its %d requests",
                         iteration, len(requests))
        self._count(error)
        max_retries = self.config.max_forward_retries
        decision = retry_or_fail(requests, max_retries, dropping)
        for request in decision.fail:
            logger.warning("request %s fails: its forward failed again before it made progress (max_forward_retries=%d)",
                           request.request_id, max_retries)
            self.fail(request, error)
        return decision.retry, BatchFailure(str(error), len(decision.fail), len(decision.retry))

    # ---- everything -------------------------------------------------------------------
    def recover(self, requests: Iterable[LlmRequest], error: Exception) -> None:
        """A bug outside any batch: every one of ``requests`` fails; the error is the last one."""
        self.last_error = repr(error)
        self.fail_all(requests, error)

    def fail_all(self, requests: Iterable[LlmRequest], error: Exception) -> None:
        for request in requests:
            self.fail(request, error)

    def _count(self, error: Exception) -> None:
        self.num_failed_batches += 1
        self.last_error = str(error)
