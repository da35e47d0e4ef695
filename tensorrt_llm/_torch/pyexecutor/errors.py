"""Typed errors of the executor layer."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """Base class of errors raised while serving a batch."""


class TokenBudgetExceeded(ExecutorError):
    """A forward pass would carry more positions than ``max_num_tokens``.

    The message matches upstream's assertion in ``_prepare_tp_inputs``.
    """

    def __init__(self, total_num_tokens: int, max_num_tokens: int) -> None:
        self.total_num_tokens = total_num_tokens
        self.max_num_tokens = max_num_tokens
        super().__init__(
            f"total_num_tokens ({total_num_tokens}) should be less than or equal to max_num_tokens ({max_num_tokens})"
        )

    @property
    def overshoot(self) -> int:
        return self.total_num_tokens - self.max_num_tokens


class InvalidRequestError(ValueError):
    """A request the executor cannot serve; it fails alone, the loop goes on."""


class SamplingError(ExecutorError):
    """Sampling one request's next token failed (its own settings or its own logits): that
    request fails alone, the rest of its batch goes on."""

    def __init__(self, request_id: int, message: str) -> None:
        self.request_id = request_id
        super().__init__(message)


class NonFiniteLogitsError(SamplingError):
    """A request's logits hold NaN or inf: it fails alone rather than sample garbage."""

    def __init__(self, request_id: int, position: int) -> None:
        self.position = position
        super().__init__(
            request_id,
            f"request {request_id}: the logits at position {position} contain NaN or inf; refusing to sample from them",
        )


class RequestError(RuntimeError):
    """Raised to a caller whose request failed inside the executor; carries its message."""

    def __init__(self, request_id: int, message: str) -> None:
        self.request_id = request_id
        self.message = message
        super().__init__(f"request {request_id} failed: {message}")


class ExecutorShutdown(RuntimeError):
    """The executor was shut down before the request finished."""


class ExecutorLoopKilled(BaseException):
    """Kills the executor thread the way upstream's failed assertion did (a test hook raises it).

    A ``BaseException`` so that the loop's per-batch ``except Exception`` does not absorb it.
    """


class KVCacheEventsDisabled(RuntimeError):
    """KV cache events were asked for and nothing emits or reads them here."""
