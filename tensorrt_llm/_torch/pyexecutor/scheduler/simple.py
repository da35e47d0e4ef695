"""``SimpleScheduler``: the capacity stage, then the micro-batch stage; one
:class:`~scheduled_requests.ScheduledRequests` per iteration (``make_scheduler`` builds it from a
config)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tensorrt_llm._torch.pyexecutor.budget.policies import TokenBudgetPolicy
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler.capacity import CapacityScheduler
from tensorrt_llm._torch.pyexecutor.scheduler.micro_batch import MicroBatchScheduler


class SimpleScheduler:
    """Capacity then micro-batch: one ``ScheduledRequests`` per iteration."""

    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler) -> None:
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(self, active: Sequence[LlmRequest], iteration: int = 0) -> ScheduledRequests:
        """``iteration``: the executor's (the preemption cooldown counts iterations)."""
        capacity, admissions = self.capacity_scheduler.schedule_lazily(active, iteration)
        scheduled = self.micro_batch_scheduler.schedule(capacity.fitting, capacity.estimated_reusable, admissions)
        if capacity.paused:
            scheduled = dataclasses.replace(scheduled, paused_requests=capacity.paused,
                                            preempted_for=capacity.preempted_for)
        return scheduled


def make_scheduler(config: ExecutorConfig, kv_cache_manager: KVCacheManager, policy: TokenBudgetPolicy) -> SimpleScheduler:
    """The two-stage scheduler an executor with ``config`` runs over ``kv_cache_manager``."""
    scheduling = config.scheduler_config
    order = PriorityOrder.of(scheduling)
    cooldown = scheduling.preemption_cooldown_iterations if scheduling.enable_preemption else None
    capacity = CapacityScheduler(config.capacity_scheduler_policy, kv_cache_manager, order=order,
                                 preemption_cooldown=cooldown)
    return SimpleScheduler(capacity, MicroBatchScheduler(config, policy))
