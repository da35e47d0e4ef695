"""Which DESIGN.md §1 mechanism made a forward overshoot ``max_num_tokens``.

Read right after the failing step: the batch's requests keep their chunk bookkeeping (the
failure only sets their error), ``scheduled.charges`` holds what admission charged each,
and the KV manager's ``last_claims`` says, for every first chunk it allocated, the reuse it
was admitted with and the reuse it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache_manager import ClaimRecord
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

MECHANISMS = ("whole_prompt_hit", "evicted_discount", "other")


@dataclass(frozen=True, slots=True)
class Overshoot:
    """One forward that went past ``max_num_tokens``, and which §1 mechanism caused it.

    ``request_id`` is the request whose positions exceeded its admission charge the most;
    ``estimated``/``claimed`` are that request's reuse estimate at admission and what its
    allocation actually claimed (None when it was not a first chunk).
    """

    iteration: int
    time_s: float
    forward_tokens: int
    overshoot: int
    mechanism: str
    request_id: int | None = None
    prompt_len: int | None = None
    charged: int | None = None
    ran: int | None = None
    estimated: int | None = None
    claimed: int | None = None

    def describe(self) -> str:
        where = f"iteration {self.iteration} at t={self.time_s:.2f} s: {self.forward_tokens} positions (+{self.overshoot})"
        if self.request_id is None:
            return f"{where}, mechanism {self.mechanism}"
        return (
            f"{where}, mechanism {self.mechanism}: request {self.request_id} (prompt {self.prompt_len}) was charged "
            f"{self.charged} and ran {self.ran}; reuse estimated {self.estimated}, claimed {self.claimed}"
        )


def classify_claim(prompt_len: int, claim: ClaimRecord, tokens_per_block: int) -> str:
    """Which DESIGN.md §1 mechanism a first chunk's shortfall of reuse is.

    ``whole_prompt_hit``: a block-aligned prompt estimated fully reusable, whose claim went
    as far as a claim can (``(prompt_len - 1) // tpb * tpb``: the last token is always
    computed) with nothing evicted, so its last block was recomputed.
    ``evicted_discount``: the claim stopped short of full blocks that were counted at
    admission: they were evicted (or onboarding failed) before this request allocated.
    """
    limit = (prompt_len - 1) // tokens_per_block * tokens_per_block
    estimate, reused = claim.estimated_reusable_tokens, claim.reused_tokens
    if estimate >= prompt_len and prompt_len % tokens_per_block == 0 and limit <= reused < prompt_len - 1:
        return "whole_prompt_hit"
    if reused < min(estimate, limit):
        return "evicted_discount"
    return "other"


def diagnose_overshoot(
    scheduled: ScheduledRequests, claims: Sequence[ClaimRecord], tokens_per_block: int, *, iteration: int,
    time_s: float, forward_tokens: int, overshoot: int,
) -> Overshoot:
    """Blame the request of the failing batch whose chunk ran furthest past its admission charge.

    Read right after the failing step: the batch's requests keep their chunk bookkeeping
    (the failure only sets their error), and ``claims`` are the first chunks that batch
    allocated, with the reuse each was admitted with and the reuse it got.
    """
    by_id = {claim.request_id: claim for claim in claims}
    worst: tuple[int, LlmRequest] | None = None
    for request in scheduled.context_requests:
        ran = min(request.context_chunk_size, request.prompt_len - request.context_current_position)
        excess = ran - scheduled.charges.get(request.request_id, ran)
        if worst is None or excess > worst[0]:
            worst = (excess, request)
    base = dict(iteration=iteration, time_s=time_s, forward_tokens=forward_tokens, overshoot=overshoot)
    if worst is None or worst[0] <= 0:
        return Overshoot(mechanism="other", **base)
    excess, request = worst
    claim = by_id.get(request.request_id)
    ran = min(request.context_chunk_size, request.prompt_len - request.context_current_position)
    mechanism = classify_claim(request.prompt_len, claim, tokens_per_block) if claim else "other"
    return Overshoot(
        mechanism=mechanism,
        request_id=request.request_id,
        prompt_len=request.prompt_len,
        charged=scheduled.charges.get(request.request_id),
        ran=ran,
        estimated=claim.estimated_reusable_tokens if claim else None,
        claimed=claim.reused_tokens if claim else None,
        **base,
    )
