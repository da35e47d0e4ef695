"""Which docs/design.md §1 mechanism made a forward overshoot ``max_num_tokens``.

Everything it reads is a value the failing step returned (``PyExecutor.step`` ->
``Iteration``): the batch as it ran (its chunks, moved onto reused prefixes), what admission
charged each request (``ScheduledRequests.charges``), and, for every first chunk allocated,
the reuse it was admitted with and the reuse it got (``PreparedBatch.claims``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache.values import ClaimRecord
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests

MECHANISMS = ("whole_prompt_hit", "evicted_discount", "other")


@dataclass(frozen=True, slots=True)
class Overshoot:
    """One forward that went past ``max_num_tokens``, and which §1 mechanism caused it.

    ``request_id`` is the request whose positions exceeded its admission charge the most;
    ``estimated``/``claimed`` are that request's reuse estimate at admission and what its
    allocation actually claimed (None when it was not a first chunk). ``step``: when no context
    chunk ran past its charge, the generation step that did ("beams 4", "first draft 4",
    "drafts 2"), blamed under ``other``: a charge that misses beams or first-draft padding.
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
    step: str | None = None

    def describe(self) -> str:
        where = f"iteration {self.iteration} at t={self.time_s:.2f} s: {self.forward_tokens} positions (+{self.overshoot})"
        if self.request_id is None:
            return f"{where}, mechanism {self.mechanism}"
        if self.step is not None:
            return (f"{where}, mechanism {self.mechanism}: the generation step of request {self.request_id}"
                    f" ({self.step}) was charged {self.charged} and ran {self.ran}")
        return (
            f"{where}, mechanism {self.mechanism}: request {self.request_id} (prompt {self.prompt_len}) was charged "
            f"{self.charged} and ran {self.ran}; reuse estimated {self.estimated}, claimed {self.claimed}"
        )


def classify_claim(prompt_len: int, claim: ClaimRecord, tokens_per_block: int) -> str:
    """Which docs/design.md §1 mechanism a first chunk's shortfall of reuse is.

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
    batch: ScheduledRequests, charges: dict[int, int], claims: Sequence[ClaimRecord], tokens_per_block: int, *,
    iteration: int, time_s: float, forward_tokens: int, overshoot: int,
) -> Overshoot:
    """Blame the context chunk of the failing batch that ran furthest past its admission charge.

    ``batch`` is the batch as it ran, ``charges`` what admission charged each request,
    ``claims`` the first chunks that batch allocated, with the reuse each was admitted with
    and the reuse it got.
    """
    by_id = {claim.request_id: claim for claim in claims}
    worst: tuple[int, ContextChunk] | None = None
    for chunk in batch.context_chunks:
        ran = chunk.cost()
        excess = ran - charges.get(chunk.request.request_id, ran)
        if worst is None or excess > worst[0]:
            worst = (excess, chunk)
    base = dict(iteration=iteration, time_s=time_s, forward_tokens=forward_tokens, overshoot=overshoot)
    if worst is None or worst[0] <= 0:
        return _blame_generation(batch, charges, base)
    excess, chunk = worst
    request = chunk.request
    claim = by_id.get(request.request_id)
    mechanism = classify_claim(request.prompt_len, claim, tokens_per_block) if claim else "other"
    return Overshoot(
        mechanism=mechanism,
        request_id=request.request_id,
        prompt_len=request.prompt_len,
        charged=charges.get(request.request_id),
        ran=chunk.cost(),
        estimated=claim.estimated_reusable_tokens if claim else None,
        claimed=claim.reused_tokens if claim else None,
        **base,
    )


def _blame_generation(batch: ScheduledRequests, charges: dict[int, int], base: dict) -> Overshoot:
    """No context chunk ran past its charge: the generation step that ran furthest past its own
    (``other``), or nobody."""
    worst = None
    for request in batch.generation_requests:
        ran = forward_cost(request)
        excess = ran - charges.get(request.request_id, ran)
        if excess > 0 and (worst is None or excess > worst[0]):
            worst = (excess, request, ran)
    if worst is None:
        return Overshoot(mechanism="other", **base)
    _, request, ran = worst
    if request.is_first_draft:
        step = f"first draft {request.max_draft_len}"
    elif request.py_draft_tokens:
        step = f"drafts {len(request.py_draft_tokens)}"
    else:
        step = f"beams {request.beam_width}"
    return Overshoot(mechanism="other", request_id=request.request_id, prompt_len=request.prompt_len,
                     charged=charges.get(request.request_id), ran=ran, step=step, **base)
