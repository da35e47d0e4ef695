"""Stateful property test of priority scheduling: the executor machines with random priorities.

The machine of ``test_stateful_executor.py`` (random pools, host tier, chunking, capacity and
chunking policies, budgets down to one block; arrivals, bursts, repeats, cancellations), with
``waiting_queue_policy="priority"``, a random aging rate and, half the time, preemption with
a random cooldown; every request gets a random priority and arrives at the machine's step
count. After every step the invariant checker checks what it checks under every policy (the
budget, clean deferrals, never deferred twice in a row, KV integrity, nothing lost) and
:func:`invariants.check_priority_order`, the independent oracle over the iteration's
decision values: nobody passed over for a request of lower effective priority (except for
memory), every preemption of strictly lower priority and outside its cooldown. The teardown
drains: every request completes. The same machine runs under the overlap scheduler and
under ``claim``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from tests.helpers.invariants import ExecutorChecker, check_priority_order, priority_snapshot
from tests.helpers.strategies import RequestSpec, Setting, examples, kv_settings
from tests.helpers.executor_machines import ExecutorMachine

from tests.helpers.factories import make_sim_executor
from tensorrt_llm._torch.pyexecutor.config import SchedulerConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder

PRIORITIES = st.sampled_from((0.0, 0.1, 0.5, 0.9, 1.0))


@dataclasses.dataclass(slots=True)
class PriorityChecker(ExecutorChecker):
    """:class:`ExecutorChecker` plus the priority oracle on every step."""

    order: PriorityOrder | None = None
    cooldown: int | None = None
    num_preemptions: int = 0

    def step(self):
        kv = self.executor.kv_cache_manager
        before = {r.request_id: priority_snapshot(r, kv) for rid, r in self.submitted.items() if rid not in self.final}
        iteration = ExecutorChecker.step(self)
        if iteration is not None and iteration.prepared is not None:
            ended = frozenset(rid for rid in before if rid in self.final)
            check_priority_order(before, iteration, self.order, cooldown=self.cooldown, ended=ended)
            self.num_preemptions += len(iteration.scheduled.preempted_for)
        return iteration


class PriorityExecutorMachine(ExecutorMachine):
    """Random priorities and arrivals under ``waiting_queue_policy="priority"``."""

    @initialize(setting=kv_settings(max_blocks=24), aging=st.sampled_from((0.0, 0.05, 0.5)),
                preemption=st.booleans(), cooldown=st.integers(0, 4))
    def build(self, setting: Setting, aging: float = 0.0, preemption: bool = False, cooldown: int = 0) -> None:
        self.setting = setting
        config = setting.config(self.policy)
        scheduling = SchedulerConfig(
            capacity_scheduler_policy=config.capacity_scheduler_policy,
            context_chunking_policy=config.context_chunking_policy,
            waiting_queue_policy="priority", priority_aging_rate=aging, enable_preemption=preemption,
            preemption_cooldown_iterations=cooldown)
        config = dataclasses.replace(config, scheduler_config=scheduling)
        self.checker = PriorityChecker(make_sim_executor(config, overlap=self.overlap), order=PriorityOrder(aging),
                                       cooldown=cooldown if preemption else None)

    def _request(self, spec: RequestSpec, data) -> LlmRequest:
        request = super()._request(spec, data)
        request.priority = data.draw(PRIORITIES, label="priority")
        request.arrival_time = float(self.checker.steps + 1)  # the machine's clock: one unit per step
        return request

    def teardown(self) -> None:
        super().teardown()
        if self.checker is not None and self.checker.num_preemptions:
            event(f"{self.policy}: a request preempted")
            if any(r.counters.onboarded_tokens for r in self.checker.submitted.values()):
                event(f"{self.policy}: a preempted request onboarded its blocks")


class OverlapPriorityExecutorMachine(PriorityExecutorMachine):
    overlap = True


class ClaimPriorityExecutorMachine(PriorityExecutorMachine):
    policy = "claim"


STATEFUL = settings(max_examples=examples(1 / 2, 150), stateful_step_count=50)

TestPriorityExecutor = PriorityExecutorMachine.TestCase
TestPriorityExecutor.settings = STATEFUL
TestOverlapPriorityExecutor = OverlapPriorityExecutorMachine.TestCase
TestOverlapPriorityExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 80))
TestClaimPriorityExecutor = ClaimPriorityExecutorMachine.TestCase
TestClaimPriorityExecutor.settings = settings(STATEFUL, max_examples=examples(1 / 4, 60))
