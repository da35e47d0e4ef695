"""The ASGI guard in front of the app: what is refused before any handler parses anything.

:class:`RequestGuard`, in the order it checks (each refusal carries the OpenAI error body and
logs one line):

1. a request head larger than ``max_header_bytes`` -> 431 (h11 refuses a head that arrives in
   pieces past that size itself, see ``http_server``; one that arrives whole is caught here);
2. a ``/v1/*`` request without ``Authorization: Bearer KEY``, when a key is set -> 401;
3. a body over ``max_body_bytes`` -> 413, from ``Content-Length`` alone when the client sends
   it, otherwise once that many bytes have come;
4. a body not complete within ``body_timeout_s`` of its head -> 408.

Every refusal closes the connection. One made before the body has all been read (1-3) first
reads and discards the rest of it, up to ``DRAIN_FACTOR`` times ``max_body_bytes`` and within
``body_timeout_s``, as nginx's lingering close does: closing a socket with unread data makes
the kernel reset the connection, and a client still sending then fails its write (a broken
pipe, a reset) instead of reading the answer. A client that sent ``Expect: 100-continue`` has
sent no body yet (it waits for the server's go-ahead) and is answered at once.

An accepted body is read here once and handed on unchanged; after it, ``receive`` is the
server's own, so handlers still see ``http.disconnect`` when the client leaves.

Errors the app does not handle end here too: logged once (with the traceback: they are bugs),
answered 500 with the error body when no response has started, never re-raised into the
server (which would log them again).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from tensorrt_llm.serve.errors import error_json
from tensorrt_llm.serve.server_config import ServerConfig

logger = logging.getLogger(__name__)

DRAIN_FACTOR = 4  # a body over the limit is drained up to this many times the limit, then the connection closed


def _is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def head_size(scope) -> int:
    """Bytes of the request head as sent, near enough: request line and header lines."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class RequestGuard:
    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._guard(scope, receive, tracked_send)
        except Exception:  # noqa: BLE001 - the last stop: nothing above this logs or answers
            logger.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            if not started:
                await _reply(send, 500, "internal error: see the server log", close=True)

    async def _guard(self, scope, receive, send) -> None:
        config = self.config
        deadline = asyncio.get_running_loop().time() + config.body_timeout_s
        if (refusal := self._refusal(scope)) is not None:
            await self._refuse_unread(scope, receive, send, *refusal, deadline=deadline, read=0)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout_at(deadline):
                body = await self._read_body(receive)
        except TimeoutError:
            await _refuse(send, scope, 408, f"the request body did not arrive within {config.body_timeout_s:g} s")
            return
        except _BodyTooLarge as too_large:
            await self._refuse_unread(scope, receive, send, 413, self._too_large(too_large.size), deadline=deadline,
                                      read=too_large.size)
            return
        if body is None:
            return  # the client left while sending: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope) -> tuple[int, str] | None:
        """(status, message) when the head alone decides: its size, the API key, a declared
        body length over the limit."""
        config = self.config
        if (size := head_size(scope)) > config.max_header_bytes:
            return 431, f"the request head of {size} bytes exceeds the limit of {config.max_header_bytes} bytes"
        headers = dict(scope["headers"])  # header names arrive lower-cased
        if self.expected is not None and _is_protected(scope["path"]):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return 401, f"{'missing' if not given else 'wrong'} API key: send the header 'Authorization: Bearer <key>'"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > config.max_body_bytes:
            return 413, self._too_large(int(declared))
        return None

    async def _read_body(self, receive) -> bytes | None:
        """The whole body; None when the client leaves before sending all of it. Raises
        _BodyTooLarge once more than ``max_body_bytes`` have come."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise _BodyTooLarge(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse_unread(self, scope, receive, send, status: int, message: str, *, deadline: float,
                             read: int) -> None:
        """Refuse a request whose body is not wanted, after draining what the client still sends
        when that is bounded (see the module docstring); ``read``: body bytes already read."""
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        drain_limit = DRAIN_FACTOR * self.config.max_body_bytes
        expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"  # nothing sent until told
        if not expects_continue and not (declared.isdigit() and int(declared) > drain_limit):
            try:
                async with asyncio.timeout_at(deadline):
                    await _drain(receive, drain_limit - read)
            except TimeoutError:
                pass  # what is left unread resets the connection: the client was too slow to matter
        await _refuse(send, scope, status, message)

    def _too_large(self, size: int) -> str:
        return f"request body of {size} bytes or more exceeds the limit of {self.config.max_body_bytes} bytes"


async def _drain(receive, budget: int) -> None:
    """Read and discard the rest of the body, at most ``budget`` bytes of it."""
    while budget > 0:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(send, scope, status: int, message: str) -> None:
    logger.info("refused %s %s: %d %s", scope["method"], scope["path"], status, message)
    await _reply(send, status, message, close=True)


async def _reply(send, status: int, message: str, *, close: bool) -> None:
    """The error body; ``close``: the connection closes after it (the rest of the request is
    not worth reading, or cannot be trusted)."""
    payload = error_json(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
