"""Per-iteration statistics: what was scheduled, what ran, what was deferred, what overshot.

A value, made once per iteration by :func:`~records.make_stats` when the iteration
completes; ``/metrics``, the Prometheus counters and the replay JSON read it. An executor
keeps the recent ones, and tells its listeners of each, through a :class:`StatsLog`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IterationStats:
    """One executor iteration. Token counts are positions in the forward pass.

    ``scheduled_tokens`` is what the scheduler charged (reuse discounted where the policy
    discounts); ``forward_tokens`` is what ``_prepare_tp_inputs`` built, also for a batch
    that then failed its budget check (0 when nothing was built); ``overshoot`` is how far
    such a batch went past ``max_num_tokens`` (it failed with TokenBudgetExceeded).
    ``num_budget_cuts`` counts first chunks the re-check cut to fit instead of deferring
    them; ``budget_bound`` is True when some active request still had prompt tokens to
    compute after the batch was built (the budget, not the traffic, was the limit).
    """

    iteration: int
    start_time: float
    end_time: float = 0.0
    max_num_tokens: int = 0
    num_active_requests: int = 0
    num_context_requests: int = 0
    num_generation_requests: int = 0
    num_paused_requests: int = 0
    num_preempted_requests: int = 0  # of the paused, those paused for a request of higher priority
    scheduled_tokens: int = 0
    forward_tokens: int = 0
    num_budget_deferrals: int = 0
    budget_deferred_tokens: int = 0
    num_capacity_deferrals: int = 0
    num_budget_cuts: int = 0
    budget_bound: bool = False
    overshoot: int = 0
    reuse_estimated_tokens: int = 0
    reuse_claimed_tokens: int = 0
    reuse_query_tokens: int = 0  # prompt tokens of the first chunks whose prefix was looked up
    num_draft_tokens: int = 0  # draft tokens the forward verified (speculative decoding)
    num_accepted_draft_tokens: int = 0  # of them, accepted by the target's greedy picks
    num_failed_requests: int = 0
    num_retried_requests: int = 0  # requests of a failed forward that start over instead of failing
    error: str | None = None

    @property
    def budget_utilization(self) -> float:
        return self.forward_tokens / self.max_num_tokens if self.max_num_tokens else 0.0

    @property
    def busy(self) -> bool:
        return self.forward_tokens > 0

    def to_dict(self) -> dict:
        return {**asdict(self), "budget_utilization": self.budget_utilization}


class StatsLog:
    """The iteration statistics an executor keeps, oldest first (a ring of ``maxlen``; every
    one when None, as a replay wants), and the listeners told of each as it is published.

    Published on the executor's thread; :meth:`snapshot` may be read from any thread.
    """

    __slots__ = ("_kept", "_listeners")

    def __init__(self, maxlen: int | None = None) -> None:
        self._kept: deque[IterationStats] = deque(maxlen=maxlen)
        self._listeners: list[Callable[[IterationStats], None]] = []

    def add_listener(self, listener: Callable[[IterationStats], None]) -> None:
        self._listeners.append(listener)

    def publish(self, stats: IterationStats) -> None:
        """Keep ``stats`` and tell every listener; one that raises is logged and skipped
        (statistics must never stop the loop)."""
        self._kept.append(stats)
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("iteration listener %r failed", listener)

    def snapshot(self) -> list[IterationStats]:
        return list(self._kept)
