"""Who goes first under ``waiting_queue_policy="priority"``: one order, used by every decision.

A request's *effective priority* after waiting ``w`` seconds is ``priority + rate * w``
(``SchedulerConfig.priority_aging_rate``). Because every waiting request ages at the same
rate, the order of two requests never changes while both wait: at any time ``t``

    p_a + rate * (t - arrival_a)  >  p_b + rate * (t - arrival_b)
    <=>  p_a - rate * arrival_a   >  p_b - rate * arrival_b

so the order is a key fixed at arrival (:meth:`PriorityOrder.key`): higher effective
priority first, then earlier arrival, then the lower request id. The capacity scheduler
(admission), the micro-batch scheduler (slots and chunk budget), the re-check (who is cut,
who is deferred), ``claim`` and preemption (who may pause whom) all sort by this one key,
so they cannot disagree; it reads no clock, so ranks that agree on arrival times (rank 0
stamps them) agree on the order.

**The wait bound (aging).** Request ``i`` (priority ``p_i``, arrival ``a_i``) is ranked
behind request ``j`` only if ``p_j - rate * a_j >= p_i - rate * a_i``, i.e. only if ``j``
arrived before ``a_i + (p_j - p_i) / rate <= a_i + H_i`` with the horizon
``H_i = (1 - p_i) / rate`` seconds. Every request that can pass ``i`` over therefore arrived
before ``a_i + H_i``: for a load with at most ``n(T)`` arrivals in any window of ``T`` seconds,
at most ``Q_i + n(H_i)`` requests are served ahead of ``i``, where ``Q_i`` is the number
waiting when ``i`` arrived. With ``B`` batch slots, requests of at most ``L`` iterations each
and a scheduler that admits into every slot that frees while a request waits (KV memory and
token budget permitting, as when the load is below capacity), ``i`` waits at most

    ceil((Q_i + n(H_i) + 1) / B) * L  iterations.

Below capacity ``Q_i`` is bounded and ``n(H_i) <= lambda * H_i + burst``: the wait is bounded,
whatever the priorities of the requests arriving after ``i``. Without aging (``rate = 0``)
``H_i`` is infinite and a low-priority request can wait as long as higher-priority traffic
keeps arriving. ``tests/unittest/_torch/pyexecutor/test_priority_starvation.py`` checks the
bound on the executor and shows the starvation without aging.

Under ``fcfs`` nothing here is used: the schedulers keep arrival order and ignore priority.
"""

from __future__ import annotations

import math
from typing import Iterable

from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY, SchedulerConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, check_priority

PRIORITY_CLASSES = ("low", "normal", "high")


class PriorityOrder:
    """The order of requests by effective priority, then arrival (see the module docstring)."""

    __slots__ = ("aging_rate",)

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate

    @classmethod
    def of(cls, config: SchedulerConfig) -> "PriorityOrder | None":
        """The order ``config`` asks for; None under ``fcfs`` (arrival order: nothing to sort)."""
        return cls(config.priority_aging_rate) if config.by_priority else None

    def key(self, request: LlmRequest) -> tuple[float, float, int]:
        """Sort key, smallest first: (-(priority - rate * arrival), arrival, request id).

        The first part is rounded to 1e-9: effective priorities equal but for floating-point
        noise (0.5 + 0.05 * 8 against 0.9) are equal, and arrival decides between them."""
        arrival = request.arrival_time
        return (round(self.aging_rate * arrival - request.priority, 9), arrival, request.request_id)

    def __call__(self, request: LlmRequest) -> tuple[float, float, int]:
        return self.key(request)

    def effective_priority(self, request: LlmRequest, now: float) -> float:
        """``priority + rate * (now - arrival)``: what the key orders by, at time ``now``."""
        return request.priority + self.aging_rate * max(0.0, now - request.arrival_time)

    def sorted(self, requests: Iterable[LlmRequest]) -> list[LlmRequest]:
        return sorted(requests, key=self.key)

    def outranks(self, a: LlmRequest, b: LlmRequest) -> bool:
        """Whether ``a`` goes before ``b``."""
        return self.key(a) < self.key(b)

    def horizon(self, priority: float) -> float:
        """Seconds after its arrival past which no new arrival is ranked ahead of a request of
        ``priority`` (``(1 - priority) / rate``; infinite without aging)."""
        return (1.0 - priority) / self.aging_rate if self.aging_rate else math.inf


def priority_class(priority: float, config: SchedulerConfig) -> str:
    """The metrics class of ``priority``: "low" below ``priority_low_below``, "high" above
    ``priority_high_above``, "normal" otherwise."""
    if priority < config.priority_low_below:
        return "low"
    if priority > config.priority_high_above:
        return "high"
    return "normal"


__all__ = ["DEFAULT_PRIORITY", "PRIORITY_CLASSES", "PriorityOrder", "check_priority", "priority_class"]
