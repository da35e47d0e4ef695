"""``Responses``: where an executor's answers go.

Two things, kept together because a request's last answer touches both: each request's
response callback (registered at admission), and the requests that are over since the
executor last freed them::

    admission ─► register(id, callback)
    a token, not the last ─► callbacks[id](request, Response)           (completion, per token)
    the last answer ─► finish(request, Response): it joins ``finished``, its callback is called and forgotten
    the executor's free ─► take_finished(keep) ─► requests to free now  (those in ``keep`` wait)

One per executor, used on its thread only. Completion (``completion``), failure handling
(``failures``) and the executor's cancellation answer through it; only the executor frees.
A request gets one final response and nothing after it.
"""

from __future__ import annotations

from typing import Collection

from tensorrt_llm._torch.pyexecutor.response import Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


class Responses:
    """The callbacks of the requests held, and the requests over but not yet freed."""

    __slots__ = ("callbacks", "finished")

    def __init__(self) -> None:
        self.callbacks: dict[int, ResponseCallback] = {}
        self.finished: list[LlmRequest] = []  # over since the last take_finished, in the order they ended

    def register(self, request_id: int, callback: ResponseCallback | None) -> None:
        if callback is not None:
            self.callbacks[request_id] = callback

    def end(self, request: LlmRequest) -> ResponseCallback | None:
        """``request`` is over: it joins the finished; its callback, forgotten, is returned (None
        without one) for the caller to send the last response."""
        self.finished.append(request)
        return self.callbacks.pop(request.request_id, None)

    def finish(self, request: LlmRequest, response: Response) -> None:
        """:meth:`end`, then send ``response`` (its last) to its callback."""
        callback = self.end(request)
        if callback is not None:
            callback(request, response)

    def take_finished(self, keep: Collection[int]) -> list[LlmRequest]:
        """The finished requests to free now, in the order they ended; those whose id is in
        ``keep`` (a forward in flight still writes their blocks) stay for a later call."""
        finished, self.finished = self.finished, []
        if not keep:
            return finished
        self.finished = [r for r in finished if r.request_id in keep]
        return [r for r in finished if r.request_id not in keep]
