"""Attention data parallelism: which rank takes each new request.

Every rank calls :func:`assign_requests` with the same inputs (rank 0's new requests and
every rank's load, from one exchange) and so computes the same assignment without another
message. It is a pure function of those values: no rank-local state, no clock, no
iteration order over a set.

The rule, per request in arrival order: the rank with the fewest active requests, then the
most free KV blocks, then the lowest rank. The chosen rank's load is updated before the
next request (one more active request, the prompt's blocks fewer), so a burst spreads out
instead of landing on the rank that was least loaded before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tensorrt_llm._torch.distributed.request_spec import RequestSpec


@dataclass(frozen=True, slots=True)
class RankLoad:
    active_requests: int
    free_kv_blocks: int  # free plus evictable (cached, unreferenced) blocks


def assign_requests(requests: Sequence[RequestSpec], loads: Sequence[RankLoad], tokens_per_block: int) -> list[int]:
    """The rank of each request, in order."""
    if not loads:
        raise ValueError("no rank to assign requests to")
    active = [load.active_requests for load in loads]
    free = [load.free_kv_blocks for load in loads]
    ranks = range(len(loads))
    assignment = []
    for request in requests:
        rank = min(ranks, key=lambda r: (active[r], -free[r], r))
        assignment.append(rank)
        active[rank] += 1
        free[rank] -= -(-request.prompt_len // tokens_per_block)
    return assignment
