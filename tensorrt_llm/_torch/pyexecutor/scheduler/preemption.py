"""Priority preemption under KV pressure: which running requests a waiting one may pause.

Off unless ``SchedulerConfig.enable_preemption`` (which needs ``waiting_queue_policy="priority"``).
When the capacity scheduler meets a waiting request whose blocks do not fit, it asks
:func:`choose_victims` whether pausing running requests would make room::

    waiting request w, short of `shortfall` blocks
        candidates: running requests r with
            priority(r) < priority(w)                     strictly lower priority, and
            w ranks ahead of r in PriorityOrder            (so aging protects a request too), and
            r did not resume within the cooldown          (iteration - counters.resumed_iteration >= cooldown)
        taken lowest-ranked first, each crediting the blocks it frees,
        until the shortfall is covered ─► the victims;  never enough ─► None (nobody is paused)

A victim is paused by the executor as a MAX_UTILIZATION pause is (``LlmRequest.preempt``): its
computed full blocks are committed to the prefix tree and released, so they stay cached; when an
allocation needs their slots they move to the host tier if there is one (LRU eviction offloads),
and the victim's resumption claims them back (onboarding them) instead of recomputing. Without a
host tier, or once evicted from it too, they are recomputed. Its generated tokens are kept: it
resumes as context over prompt + output, so its output is the one it would have had unpaused.

A victim credits what pausing it frees: the blocks it alone holds
(``SequenceBlocks.releasable_blocks``), plus what the policy had set aside for it (its blocks
to completion under GUARANTEED_NO_EVICT, its next step under MAX_UTILIZATION). The waiting
request is then charged its blocks without any sharing credit (a block it would share with a
victim is released by the pause and claimed again: it needs a slot), so preemption never
over-admits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder


@dataclass(frozen=True, slots=True)
class Preemption:
    """``victim`` is paused so that ``waiter`` fits."""

    victim: LlmRequest
    waiter: LlmRequest


def in_cooldown(request: LlmRequest, iteration: int, cooldown: int) -> bool:
    """Whether ``request`` resumed from a preemption fewer than ``cooldown`` iterations ago."""
    resumed = request.counters.resumed_iteration
    return resumed >= 0 and iteration - resumed < cooldown


def choose_victims(
    waiter: LlmRequest,
    shortfall: int,
    running: Sequence[LlmRequest],
    credit: Callable[[LlmRequest], int],
    order: PriorityOrder,
    *,
    iteration: int,
    cooldown: int,
) -> list[LlmRequest] | None:
    """The running requests to pause so that ``waiter`` gets ``shortfall`` more blocks, or None.

    ``credit(r)`` is the blocks pausing ``r`` makes available. Victims are taken lowest-ranked
    first and only as many as needed; None when every eligible one together does not cover
    the shortfall (pausing some would only churn)."""
    eligible = sorted(
        (r for r in running
         if r.priority < waiter.priority and order.outranks(waiter, r) and not in_cooldown(r, iteration, cooldown)),
        key=order.key, reverse=True,
    )
    victims, freed = [], 0
    for request in eligible:
        if freed >= shortfall:
            break
        gain = credit(request)
        if gain <= 0:
            continue
        victims.append(request)
        freed += gain
    return victims if freed >= shortfall else None
