"""The HTTP/1.1 edge: uvicorn with the limits of :class:`ServerConfig`, each answered with the
OpenAI error body (never uvicorn's plain text, never a silent hang).

:func:`uvicorn_config` builds the ``uvicorn.Config`` that ``trtllm-serve`` and the test harness
serve an app with. It runs uvicorn's h11 protocol through :class:`EdgeProtocol`, which adds
what uvicorn does not have:

=======================================  ===================================================
limit (``ServerConfig`` field)            answer
=======================================  ===================================================
``header_timeout_s``: a request head      408, closed. uvicorn has no such timer: a client
not complete this long after its first    that sends part of a head and stops would hold the
byte                                      connection forever.
``timeout_keep_alive_s``: a new           closed silently, as an idle keep-alive connection
connection that sends nothing this long   is: nothing was asked, nobody waits for an answer
``max_header_bytes``                      431 (h11's ``max_incomplete_event_size`` for a head
                                          still arriving; ``RequestGuard`` for a whole one)
malformed framing (request line,          400 (501 for a transfer coding h11 does not
``Content-Length``, chunk sizes)          implement), closed; the message says what h11 found
``limit_concurrency``: open connections   503 with ``Retry-After``, closed. uvicorn's own check
or requests in progress beyond it         answers plain text and refuses at the limit itself
                                          (``limit_concurrency=1`` would refuse everything)
``timeout_keep_alive_s``, ``backlog``     uvicorn's own settings
=======================================  ===================================================

The body limits (``body_timeout_s`` -> 408, ``max_body_bytes`` -> 413 after draining) are the
app's :class:`~tensorrt_llm.serve.middleware.RequestGuard`'s, which reads every body.

:class:`EdgeProtocol` overrides uvicorn's ``H11Protocol`` at its event hooks
(``connection_made``, ``data_received``, ``on_response_complete``, ``connection_lost``) and its
``send_400_response``; the request cycle itself is uvicorn's.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tensorrt_llm.serve.errors import error_json
from tensorrt_llm.serve.server_config import ServerConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_BUSY_S = 1  # a connection refused for the concurrency limit may come back this soon


def uvicorn_config(app, config: ServerConfig, *, log_level: str = "info", **extra: Any) -> uvicorn.Config:
    """uvicorn's settings for serving ``app`` (an ASGI app, e.g. ``OpenAIServer.app``) with the
    edge limits of ``config``; ``extra`` goes to ``uvicorn.Config`` as is (e.g.
    ``timeout_graceful_shutdown``)."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=edge_protocol(config),
        ws="none",  # no websocket endpoints: an upgrade request is served as plain HTTP
        timeout_keep_alive=config.timeout_keep_alive_s,
        backlog=config.backlog,
        limit_concurrency=None,  # EdgeProtocol applies config.limit_concurrency itself
        h11_max_incomplete_event_size=config.max_header_bytes,
        log_level=log_level,
        **extra,
    )


def edge_protocol(config: ServerConfig) -> type["EdgeProtocol"]:
    """:class:`EdgeProtocol` bound to ``config`` (uvicorn builds one protocol per connection,
    from the class alone)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": config})


class _Connection(h11.Connection):
    """h11's connection, keeping the protocol error it raised: uvicorn's handler passes on only
    a fixed message, and the error's ``error_status_hint`` tells 431 from 400."""

    protocol_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.protocol_error = error
            raise


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with the head timeout, JSON error answers and the concurrency
    limit; see the module docstring. ``limits`` is set by :func:`edge_protocol`."""

    limits: ServerConfig

    def __init__(self, config: uvicorn.Config, server_state, app_state, _loop: asyncio.AbstractEventLoop | None = None):
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.limit_concurrency = None  # uvicorn's check off: _admit applies ours
        self._app = self.app
        self.app = self._admit
        self._head_timer: asyncio.TimerHandle | None = None
        self._timing_head = False  # the timer runs for a head that has begun (else: a new connection's idleness)

    # ---- the head timeout -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that has sent nothing is idle, and idle ones get the keep-alive time, not
        # the head timeout: a loaded client may connect well before it writes its request (its
        # own event loop busy), and closing under it loses that request without a trace (seen:
        # 59 of 280 streams at 4x load on 2 cores with a 30 s limit here).
        self._arm_head_timer(self.limits.timeout_keep_alive_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # may start a request cycle, or answer a framing error
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()  # a pipelined head may already be waiting

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Time a request head from its first byte until it is complete; an idle connection
        between requests is uvicorn's keep-alive timer's."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        elif self.conn.trailing_data[0] and not self._timing_head:
            self._cancel_head_timer()  # the idle timer of a new connection: its head has begun
            self._arm_head_timer(self.limits.header_timeout_s)
            self._timing_head = True

    def _arm_head_timer(self, delay_s: float) -> None:
        self._head_timer = self.loop.call_later(delay_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        self._timing_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        self._timing_head = False
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:  # nothing sent: nobody is waiting for an answer
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()
            return
        message = f"the request head did not arrive within {self.limits.header_timeout_s:g} s"
        logger.info("refused %s: 408 %s", self._peer(), message)
        self._answer_and_close(408, message)

    # ---- framing errors ---------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to anything h11 cannot parse (it has logged ``msg``), in the error body."""
        error = self.conn.protocol_error
        status = error.error_status_hint if error is not None else 400
        detail = str(error) if error is not None and str(error) else "malformed request"
        if status == 431:
            detail = f"the request head exceeds the limit of {self.limits.max_header_bytes} bytes"
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # mid-response (a pipelined request went bad): no second answer fits
            return
        self._answer_and_close(status, f"invalid HTTP request: {detail}")

    # ---- the concurrency limit --------------------------------------------------------
    async def _admit(self, scope, receive, send) -> None:
        """The app, unless open connections or requests in progress (this one included) are
        over ``limit_concurrency``."""
        limit = self.limits.limit_concurrency
        if limit is not None and (len(self.connections) > limit or len(self.tasks) > limit):
            message = (f"the server is at its limit of {limit} concurrent connections"
                       f" ({len(self.connections)} open, {len(self.tasks)} requests in progress)")
            logger.warning("refused %s %s: 503 %s", scope["method"], scope["path"], message)
            payload = error_json(503, message)
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                (b"retry-after", str(RETRY_AFTER_BUSY_S).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": payload})
            return
        await self._app(scope, receive, send)

    # ---- helpers ----------------------------------------------------------------------
    def _answer_and_close(self, status: int, message: str) -> None:
        """Write a whole error response and close, outside h11's state machine (which allows
        no response before a request head has been parsed)."""
        payload = error_json(status, message)
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(payload)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode("ascii") + payload)
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"
