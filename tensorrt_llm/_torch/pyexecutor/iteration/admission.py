"""Admission: what the loop hands a step becomes active requests, or ends.

::

    arrivals ─► admit: callback registered, arrival time set (when the submitter left it 0),
                validated (one the executor could never serve fails alone, with the reason),
                made speculative where its draft slots fit ─► the requests admitted, in order
    cancelled ─► cancel: each active request named ends ``cancelled`` (placeholders of forwards
                 in flight dropped, one final response); the executor frees it

Under ``waiting_queue_policy="fcfs"`` priorities are accepted and ignored, and that is said once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Sequence

from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY
from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.response import Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures
from tensorrt_llm._torch.pyexecutor.iteration.launch import drop_in_flight_tokens
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
    from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter

logger = logging.getLogger(__name__)


class Admission:
    """Admits arrivals and ends cancelled requests, on the executor's thread."""

    def __init__(
        self,
        config: ExecutorConfig,
        validate: Callable[[LlmRequest], None],
        responses: Responses,
        failures: Failures,
        clock: Callable[[], float],
    ) -> None:
        """``validate``: raises ``InvalidRequestError`` for a request the executor could never serve."""
        self.by_priority = config.scheduler_config.by_priority
        self.validate = validate
        self.responses = responses
        self.failures = failures
        self.clock = clock
        self._priority_ignored_said = False

    def admit(
        self, arrivals: Iterable[tuple[LlmRequest, ResponseCallback | None]], drafter: Drafter | None
    ) -> list[LlmRequest]:
        """The arrivals that become active, in order; the others have failed with their reason.
        ``drafter`` (speculative decoding) makes each one speculative where it can be."""
        admitted = []
        for request, on_response in arrivals:
            self.responses.register(request.request_id, on_response)
            request.arrival_time = request.arrival_time or self.clock()
            if request.priority != DEFAULT_PRIORITY and not self.by_priority and not self._priority_ignored_said:
                self._priority_ignored_said = True
                logger.info("request priorities are accepted and ignored: scheduler_config.waiting_queue_policy"
                            " is 'fcfs' (set it to 'priority' to honour them); said once")
            try:
                self.validate(request)
            except InvalidRequestError as error:
                logger.warning("%s", error)
                self.failures.fail(request, error)
                continue
            if drafter is not None and drafter.admit(request):
                try:
                    self.validate(request)  # its draft slots: speculation never refuses a request
                except InvalidRequestError as error:
                    logger.debug("request %d runs without speculation: %s", request.request_id, error)
                    drafter.withdraw(request)
            admitted.append(request)
        return admitted

    def cancel(self, active: Sequence[LlmRequest], cancelled: Collection[int]) -> None:
        """End every request of ``active`` whose id is in ``cancelled`` and that is not over yet."""
        for request in active:
            if request.request_id in cancelled and not request.is_finished:
                drop_in_flight_tokens(request)
                request.is_cancelled = True
                request.state = LlmRequestState.GENERATION_COMPLETE
                request.finish_time = self.clock()
                self.responses.finish(request, Response(request.request_id, [], finished=True, cancelled=True))
