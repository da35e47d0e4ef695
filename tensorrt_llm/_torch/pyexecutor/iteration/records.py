"""What one executor iteration decided and measured, and the statistics made once from it.

An iteration is launched by one ``PyExecutor.step`` and completes in the same step or, under
overlap, in the next. Its :class:`~stats.IterationStats` are made once, when it completes,
from two values, as vLLM's scheduler makes its ``SchedulerStats``; nothing writes them on
the way::

    step n       schedule ─► prepare_resources ─► forward_async
                 └─► Launch       what it decided (the batch scheduled, the batch prepared,
                                  whether the budget bound it) and measured before the
                                  forward ran (its positions, its overshoot, a failed launch)
    step n or n+1  the forward completes (at once when the launch failed or nothing ran)
                 └─► Completion   when, how many requests were active, the drafts it
                                  verified and accepted, a failure at completion
    make_stats(launch, completion) ─► IterationStats (frozen), published once

A failure belongs to one of the two: a batch that fails at launch has no forward to
complete. ``step`` returns an :class:`Iteration`: the launch, and its statistics when its
forward completed within the step (always without overlap).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason
from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats


@dataclass(frozen=True, slots=True)
class BatchFailure:
    """A batch that failed: the error, the requests that failed with it, and those that start
    over instead (a failed forward's requests with a retry left)."""

    error: str
    num_failed_requests: int
    num_retried_requests: int = 0


@dataclass(frozen=True, slots=True)
class Drafts:
    """Draft tokens a forward verified, and how many the sampler accepted (before the stop rule)."""

    verified: int = 0
    accepted: int = 0


NO_DRAFTS = Drafts()


@dataclass(frozen=True, slots=True)
class Launch:
    """One iteration up to its launch.

    ``scheduled`` is the batch as the scheduler built it; ``prepared`` what
    ``prepare_resources`` made of it, or None when ``prepare_resources`` itself failed.
    ``budget_bound``: some active request still had prompt tokens to compute after the batch
    was built (DESIGN.md §5). ``forward_tokens``: the positions ``_prepare_tp_inputs`` built,
    also for a batch that then failed its budget check (0 when nothing was built);
    ``overshoot``: how far such a batch went past ``max_num_tokens``. ``failure``: the batch
    failed before its forward could complete (budget, ``prepare_resources``, the launch).
    """

    iteration: int
    start_time: float
    max_num_tokens: int
    scheduled: ScheduledRequests
    prepared: PreparedBatch | None = None
    budget_bound: bool = False
    forward_tokens: int = 0
    overshoot: int = 0
    failure: BatchFailure | None = None

    @property
    def batch(self) -> ScheduledRequests:
        """The batch that ran (or would have run, for a batch that failed)."""
        return self.prepared.scheduled if self.prepared is not None else self.scheduled


@dataclass(frozen=True, slots=True)
class Completion:
    """One iteration from its launch on: taken when its forward completed (or, for a batch
    that did not run, right after the launch). ``num_active_requests`` counts the executor's
    active requests at that moment."""

    end_time: float
    num_active_requests: int
    drafts: Drafts = NO_DRAFTS
    failure: BatchFailure | None = None


def make_stats(launch: Launch, completion: Completion) -> IterationStats:
    """The iteration's statistics, from what it decided and measured."""
    scheduled, prepared, batch = launch.scheduled, launch.prepared, launch.batch
    failure = launch.failure or completion.failure
    budget_deferrals = capacity_deferrals = deferred_tokens = cuts = 0
    estimated = claimed = queried = 0
    if prepared is not None:
        for deferral in prepared.deferred:
            if deferral.reason is DeferReason.BUDGET:
                budget_deferrals += 1
                deferred_tokens += deferral.cost
            else:
                capacity_deferrals += 1
        if prepared.budget is not None:
            cuts = len(prepared.budget.cut)
        for claim in prepared.claims:
            estimated += claim.estimated_reusable_tokens
            claimed += claim.reused_tokens
            queried += claim.prompt_len
    return IterationStats(
        iteration=launch.iteration,
        start_time=launch.start_time,
        end_time=completion.end_time,
        max_num_tokens=launch.max_num_tokens,
        num_active_requests=completion.num_active_requests,
        num_context_requests=len(batch.context_chunks),
        num_generation_requests=len(batch.generation_requests),
        num_paused_requests=len(scheduled.paused_requests),
        num_preempted_requests=len(scheduled.preempted_for),
        scheduled_tokens=scheduled.scheduled_tokens,
        forward_tokens=launch.forward_tokens,
        num_budget_deferrals=budget_deferrals,
        budget_deferred_tokens=deferred_tokens,
        num_capacity_deferrals=capacity_deferrals,
        num_budget_cuts=cuts,
        budget_bound=launch.budget_bound,
        overshoot=launch.overshoot,
        reuse_estimated_tokens=estimated,
        reuse_claimed_tokens=claimed,
        reuse_query_tokens=queried,
        num_draft_tokens=completion.drafts.verified,
        num_accepted_draft_tokens=completion.drafts.accepted,
        num_failed_requests=failure.num_failed_requests if failure is not None else 0,
        num_retried_requests=failure.num_retried_requests if failure is not None else 0,
        error=failure.error if failure is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Iteration:
    """What one :meth:`PyExecutor.step` launched, and its statistics once they exist.

    ``stats``: its statistics when the step completed the forward it launched, which it
    always does without overlap. Under overlap it is None: the statistics are published when
    the forward completes (``iteration_stats``, the iteration listeners), and what was known
    at launch is in ``launch``.
    """

    launch: Launch
    stats: IterationStats | None

    @property
    def scheduled(self) -> ScheduledRequests:
        """The batch as the scheduler built it (admission charges, reuse estimates)."""
        return self.launch.scheduled

    @property
    def prepared(self) -> PreparedBatch | None:
        """What ``prepare_resources`` made of it (the batch that ran, the deferrals, the
        claims), or None when ``prepare_resources`` itself failed."""
        return self.launch.prepared

    @property
    def batch(self) -> ScheduledRequests:
        """The batch that ran (or would have run, for a batch that failed)."""
        return self.launch.batch

    @property
    def error(self) -> str | None:
        """Why the batch failed, as far as this step knows: at launch, or at completion when
        the step completed it."""
        if self.stats is not None:
            return self.stats.error
        return self.launch.failure.error if self.launch.failure is not None else None
