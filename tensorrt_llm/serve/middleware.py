"""ASGI guards that run before any handler parses anything: the API key and the body-size limit.

:class:`RequestGuard` answers 401 to a ``/v1/*`` request without ``Authorization: Bearer KEY``
(when a key is set) and 413 to a body over ``max_body_bytes`` — from ``Content-Length``
alone when the client sends it, otherwise after reading at most ``max_body_bytes + 1``
bytes. An accepted body is read here once and handed on unchanged; after it, ``receive``
is the server's own, so handlers still see ``http.disconnect`` when the client leaves.
"""

from __future__ import annotations

import hmac
import json

from tensorrt_llm.serve.errors import error_body

MAX_BODY_BYTES = 16 * 1024 * 1024


def _is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # header names arrive lower-cased
        if self.expected is not None and _is_protected(scope["path"]):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                reason = "missing" if not given else "wrong"
                await _reply(send, 401, f"{reason} API key: send the header 'Authorization: Bearer <key>'")
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, self._too_large(int(declared)), close=True)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, size = await self._read_body(receive)
        if size > self.max_body_bytes:
            await _reply(send, 413, self._too_large(size), close=True)
            return
        if body is None:
            return  # the client left while sending: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive) -> tuple[bytes | None, int]:
        """(the body, its size); the body is None past the limit (size then shows how far it
        got) or when the client leaves before sending all of it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, size
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), size

    def _too_large(self, size: int) -> str:
        return f"request body of {size} bytes or more exceeds the limit of {self.max_body_bytes} bytes"


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(send, status: int, message: str, *, close: bool = False) -> None:
    payload = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # the unread rest of the body is not worth reading
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
