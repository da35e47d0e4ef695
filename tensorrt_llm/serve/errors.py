"""The OpenAI error format: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}}


class OpenAIError(Exception):
    """Raised by a handler to answer ``status`` with the error body; nothing else was started."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)
