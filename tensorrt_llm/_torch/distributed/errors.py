"""Typed errors of the multi-rank executor. Each ends the whole group: no rank goes on alone."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """The ranks can no longer step together; every rank raises one of these."""


class RankDivergenceError(DistributedError):
    """The ranks' decisions differ: under tensor parallelism they would issue different
    collectives next. Names the iteration and the first request whose decision differs."""

    def __init__(self, iteration: int, request_id: int | None, detail: str) -> None:
        self.iteration = iteration
        self.request_id = request_id
        self.detail = detail
        which = f"first differing request {request_id}" if request_id is not None else "no request differs"
        super().__init__(f"ranks diverged at iteration {iteration} ({which}): {detail}")


class GroupAborted(DistributedError):
    """Another rank failed and aborted the group; carries that rank's own error."""

    def __init__(self, origin_rank: int, iteration: int | None, message: str) -> None:
        self.origin_rank = origin_rank
        self.iteration = iteration
        self.message = message
        at = f" at iteration {iteration}" if iteration is not None else ""
        super().__init__(f"rank {origin_rank} failed{at}: {message}")


class CollectiveError(DistributedError):
    """A collective failed or timed out and no rank recorded why (a rank died without a word)."""
