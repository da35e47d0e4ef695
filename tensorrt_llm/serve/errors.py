"""The OpenAI error format: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status.

Every refusal the server makes, from the HTTP framing up to the handlers, carries this body, so
a client can always parse it. A message may quote what the client sent; text that is not valid
Unicode (a lone surrogate from a JSON ``\\ud800`` escape) is written as its escape, so the body
always encodes to UTF-8.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": None if param is None else _printable(param), "code": status}}


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    """The error body as UTF-8 JSON, for the layers that write bytes themselves."""
    return json.dumps(error_body(status, message, param)).encode()


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """Raised by a handler to answer ``status`` with the error body (and ``headers``, e.g.
    ``Retry-After``); nothing else was started."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)
