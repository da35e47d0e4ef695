"""``PyExecutor``: the executor's iteration, driven by an :class:`~executor.loop.ExecutorLoop`.

``PyExecutor`` is the stepper: it holds the requests, the scheduler, the resource manager,
the engine and the sampler, and runs one iteration per :meth:`PyExecutor.step`. The thread,
the submission queue, cancellations, health and the loop's death are
:class:`~executor.loop.ExecutorLoop`'s (``self.loop``); ``PyExecutor`` answers the
:class:`~executor.client.ExecutorClient` interface by asking it. One iteration is
upstream's, as a chain of values::

    arrivals + cancelled (from the loop) ─► admitted (or failed alone); cancelled ended   (admission)
        ─► drafter.prepare_draft_tokens(active) (speculative decoding; in flight: the engine's slots)
        ─► scheduler.schedule_request(active) ─► ScheduledRequests
        ─► pause what the capacity stage preempts
        ─► resource_manager.prepare_resources(scheduled) ─► PreparedBatch
               (re-check ─► allocation ─► after-allocation fix-ups; see resource_manager)
        ─► record deferrals and reuse on the requests                                  (launch)
        ─► model_engine.forward_async(batch) ─► PendingForward; requests move past it ─► InFlight
        ─► complete the previous forward: sample / fill in its tokens, respond     (completion)
               ─► resource_manager.update_resources
           ─► make_stats(Launch, Completion) ─► IterationStats, published            (records)
        ─► free finished requests                                                 (responses)
    ─► Iteration(launch, stats)
    a batch that raises on the way ─► its requests fail, or start over             (failures)

The names on the right are the modules of ``iteration/`` that hold each phase's code.

**Overlap** (upstream's overlap scheduler; on by default when the engine completes
asynchronously, i.e. on CUDA): forward n+1 is launched before forward n is completed, so the
host's work hides behind the device; ``iteration.launch`` states what n+1 cannot know.

Only the executor and its iteration modules write request state (see ``llm_request``). An
iteration never fails as a whole: a batch that raises fails its requests or starts them over
(``iteration.failures``), and the next iteration serves everyone else. The loop's thread calls
the same ``step`` that a replay with a virtual clock calls directly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from operator import attrgetter
from typing import Callable, Collection, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.engine.interface import ModelEngine
from tensorrt_llm._torch.pyexecutor.errors import KVCacheEventsDisabled, TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.executor.client import Health, IterationListener, Load
from tensorrt_llm._torch.pyexecutor.response import Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.executor.loop import Arrival, ExecutorLoop, StepCounts
from tensorrt_llm._torch.pyexecutor.executor.validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.iteration.admission import Admission
from tensorrt_llm._torch.pyexecutor.iteration.completion import CompletionHandler, count_drafts, sample
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures
from tensorrt_llm._torch.pyexecutor.iteration.launch import InFlight, advance, budget_bound, record_prepared
from tensorrt_llm._torch.pyexecutor.iteration.records import NO_DRAFTS, BatchFailure, Completion, Drafts, Iteration, Launch, make_stats
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats, StatsLog
from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVEventCounts, KVEventRecord
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.priority import priority_class
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter
from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler

__all__ = ["PyExecutor", "Response", "ResponseCallback"]

logger = logging.getLogger(__name__)

_COMPLETE, _ERROR = LlmRequestState.GENERATION_COMPLETE, LlmRequestState.ERROR  # identities: see completion
_request_id = attrgetter("request_id")
_NONE: frozenset[int] = frozenset()


class PyExecutor:
    """The stepper: requests, scheduler, resource manager, engine and sampler, one
    :meth:`step` at a time on one thread. It is also the one-rank ``ExecutorClient``: those
    calls go to its :attr:`loop` (any thread)."""

    def __init__(
        self,
        *,
        config: ExecutorConfig,
        scheduler: SimpleScheduler,
        resource_manager: ResourceManager,
        model_engine: ModelEngine,
        sampler: Sampler,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
    ) -> None:
        """``drafter``: speculative decoding (``config.speculative_config``); None: off."""
        self.config = config
        self.drafter = drafter
        self.scheduler = scheduler
        self.resource_manager = resource_manager
        self.kv_cache_manager: KVCacheManager = resource_manager.kv_cache_manager
        self.model_engine = model_engine
        self.sampler = sampler
        self.clock = clock
        self.limits = RequestLimits.of(config, self.kv_cache_manager, model_engine)
        disabled = config.disable_overlap_scheduler
        self.overlap = not disabled if disabled is not None else model_engine.completes_asynchronously
        self.active_requests: list[LlmRequest] = []
        self.responses = Responses()  # callbacks, and the requests finished since the last free
        # The iteration's parts; the sampler and the drafter they are handed at each call.
        self.failures = Failures(config, self.responses, resource_manager, clock)
        self.admission = Admission(config, self.validate, self.responses, self.failures, clock)
        self.completion = CompletionHandler(self.kv_cache_manager, self.responses, self.failures)
        self._in_flight: InFlight | None = None
        # A ring when iter_stats_max_iterations is set (a server); the whole record otherwise (a replay).
        self._stats = StatsLog(config.iter_stats_max_iterations)
        self.num_preemptions = 0  # requests paused for one of higher priority (SchedulerConfig.enable_preemption)
        self._iteration = 0
        # The thread, the submission queue, cancellations, health and death: the loop's.
        self.loop = ExecutorLoop(self, health_check_timeout_s=config.health_check_timeout_s)

    # ---- ExecutorClient: submission, health (any thread); the loop keeps the queue --------
    def enqueue_request(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        """Queue ``request``; an invalid one fails alone at the next iteration, with the reason."""
        return self.enqueue_requests([(request, on_response)])[0]

    def enqueue_requests(self, requests: Sequence[tuple[LlmRequest, ResponseCallback | None]]) -> list[int]:
        """Queue several requests at once: the next iteration fetches them all."""
        self.loop.enqueue(requests)
        return [request.request_id for request, _ in requests]

    def cancel_request(self, request_id: int) -> None:
        self.loop.cancel(request_id)

    def start(self) -> None:
        self.loop.start()

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests get an ExecutorShutdown error."""
        self.loop.shutdown()

    def health(self) -> Health:
        return self.loop.health()

    def kill_loop_for_testing(self) -> None:
        """Test hook: the loop thread dies at its next iteration, as upstream's did on its assertion."""
        self.loop.kill_for_testing()

    def validate(self, request: LlmRequest) -> None:
        """Raise InvalidRequestError if this executor could never serve ``request``."""
        validate_request(request, self.limits, self.kv_cache_manager)

    # ---- the step (the loop's thread, or a replay stepping by hand) -------------------
    @property
    def has_work(self) -> bool:
        """Anything queued, to cancel, active, in flight or to free."""
        return self.loop.has_work

    @property
    def busy(self) -> bool:
        """Requests active, a forward in flight, or finished requests still to free (queue aside)."""
        return bool(self.active_requests or self._in_flight is not None or self.responses.finished)

    @property
    def in_flight_request_ids(self) -> frozenset[int]:
        """The requests of the forward in flight (overlap; none without): the next :meth:`step`
        completes it, and their blocks stay held until then."""
        return self._in_flight.request_ids if self._in_flight is not None else _NONE

    def step(
        self, arrivals: Sequence[Arrival] | None = None, cancelled: Collection[int] = ()
    ) -> Iteration | None:
        """Run one iteration (the module docstring's picture); None when there was nothing to
        schedule. Called with no ``arrivals``, it takes what the loop has queued (and cancelled)
        first. Returns the iteration launched here; its statistics are published when its
        forward completes: here without overlap, in the next step with it."""
        if arrivals is None:
            return self.loop.step()
        self.active_requests += self.admission.admit(arrivals, self.drafter)
        if cancelled:
            self.admission.cancel(self.active_requests, cancelled)
            self._free_finished()
        if self._in_flight is not None and not self._in_flight.overlappable:
            self._complete_in_flight()  # only the host's sampler knows a token the next batch needs
            self._free_finished()
        if not self.active_requests:
            self._complete_in_flight()
            self._free_finished()
            return None
        if self.drafter is not None:  # drafts from known tokens; a request in flight gets the engine's (drafter)
            self.drafter.prepare_draft_tokens(self.active_requests, engine_proposes=self.model_engine.proposes_drafts)
        scheduled = self._schedule()
        launch, launched = self._launch(scheduled)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._complete(previous)
        stats = None
        if launched is None:
            stats = self._record(launch)
        elif not self.overlap:
            stats = self._complete_in_flight()
        self._free_finished()
        self.kv_cache_manager.offload_ahead()  # after the launch: the host tier's copies run beside its forward
        return Iteration(launch, stats)

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Step until every submitted request has finished (tests and replays)."""
        for _ in range(max_iterations):
            if not self.has_work:
                return
            self.step()
        raise RuntimeError(f"still busy after {max_iterations} iterations: {self.active_requests[:5]}")

    def add_iteration_listener(self, listener: IterationListener) -> None:
        """Call ``listener(stats)`` on the executor thread when an iteration's statistics are
        made (its forward completed, or nothing ran); it must be quick. An exception it raises
        is logged and ignored."""
        self._stats.add_listener(listener)

    @property
    def iteration_stats(self) -> list[IterationStats]:
        """The iteration statistics kept (a ring of ``iter_stats_max_iterations``, or all), oldest first."""
        return self._stats.snapshot()

    def iteration_stats_by_rank(self) -> list[tuple[int, IterationStats]]:
        """:attr:`iteration_stats`, each as rank 0's (the interface of several ranks)."""
        return [(0, stats) for stats in self.iteration_stats]

    def faults_injected(self) -> Mapping[str, int]:
        return dict(self.model_engine.faults_injected)

    def get_kv_cache_events(self, timeout: float | None) -> list[KVEventRecord]:
        """The pool's events since the last call (``ExecutorClient.get_kv_cache_events``); any thread."""
        events = self.kv_cache_manager.events
        if events is None:
            raise KVCacheEventsDisabled("KV cache events are off: set kv_cache_config.event_buffer_max_size > 0")
        return events.take(timeout)

    def kv_cache_event_counts(self) -> KVEventCounts | None:
        events = self.kv_cache_manager.events
        return events.counts() if events is not None else None

    def reset_prefix_cache(self) -> bool:
        """Empty the reuse index between two iterations, on the loop's thread (now, when no
        thread runs the loop); False while a request, or a forward in flight, holds cached blocks."""
        if self.loop.running:
            return self.loop.call_between_steps(self.kv_cache_manager.reset_prefix_cache).result()
        return self.kv_cache_manager.reset_prefix_cache()

    def load(self) -> Load:
        """Requests holding blocks, requests waiting for them (queued included), the pool; any thread."""
        active = list(self.active_requests)  # a copy: the executor thread replaces the list
        kv = self.kv_cache_manager
        waiting = [r for r in active if not kv.is_allocated(r)]
        scheduling = self.config.scheduler_config
        by_class = Counter(priority_class(r.priority, scheduling) for r in waiting)
        return Load(len(active) - len(waiting), len(waiting) + self.loop.num_queued, kv.pool.stats(), dict(by_class))

    # ---- what the loop and Health ask of the stepper ----------------------------------
    @property
    def num_failed_batches(self) -> int:
        return self.failures.num_failed_batches

    @property
    def num_budget_violations(self) -> int:
        return self.failures.num_budget_violations

    @property
    def last_error(self) -> str | None:
        return self.failures.last_error

    def counts(self) -> StepCounts:
        failures = self.failures
        return StepCounts(self._iteration, len(self.active_requests), failures.num_failed_batches,
                          failures.num_budget_violations, failures.last_error)

    def recover(self, error: Exception) -> None:
        """A bug outside any batch: fail what is active, keep serving."""
        self.failures.recover(self.active_requests, error)
        self._free_finished()

    def fail_all(self, error: Exception, queued: Sequence[Arrival]) -> None:
        """Every request held or ``queued`` (never admitted) ends with ``error``."""
        for request, on_response in queued:
            self.responses.register(request.request_id, on_response)
        self.failures.fail_all((*self.active_requests, *(request for request, _ in queued)), error)
        self._free_finished()

    def close(self) -> None:
        """The loop stopped: complete the forward in flight (its blocks are freed with its requests)."""
        self._complete_in_flight()

    # ---- iteration parts ------------------------------------------------------------
    def _schedule(self) -> ScheduledRequests:
        """Schedule the active requests; free and restart the ones the capacity stage preempts.

        Under overlap a request whose in-flight token is its last (``max_new_tokens``) is not
        scheduled again, and a pause never frees blocks a forward in flight uses: the forward
        completes first and the requests are scheduled again."""
        active = self.active_requests
        if self._in_flight is not None:
            active = [r for r in active if r.tokens[-1] != IN_FLIGHT_TOKEN_ID or len(r.tokens) < r.max_total_len]
        scheduled = self.scheduler.schedule_request(active, self._iteration)
        in_flight = self.in_flight_request_ids
        if in_flight and any(r.request_id in in_flight for r in scheduled.paused_requests):
            self._complete_in_flight()
            self._free_finished()
            scheduled = self.scheduler.schedule_request(self.active_requests, self._iteration)
        for request in scheduled.paused_requests:
            # its computed full blocks stay cached (to the host tier under pressure): a resumption claims them
            self.resource_manager.free_resources(request)
            if request.request_id in scheduled.preempted_for:
                request.preempt()
                self.num_preemptions += 1
                self.failures.check_restartable(request, "preempted by a request of higher priority", self.drafter)
            else:
                request.pause()
                self.failures.check_restartable(request, "paused to free KV memory", self.drafter)
        return scheduled

    def _launch(self, scheduled: ScheduledRequests) -> tuple[Launch, InFlight | None]:
        """prepare_resources, then launch the forward: what that decided and measured, and the
        forward in flight, None when nothing runs (an empty batch, or a batch that failed: its
        requests have their error, or start over)."""
        iteration = self._iteration
        self._iteration += 1
        # What is known before prepare_resources; each way out adds what it learnt.
        launch = functools.partial(Launch, iteration, self.clock(), self.config.max_num_tokens, scheduled)
        prepared = None
        bound = False
        forward_tokens = 0
        try:
            # the launch holds a prepared batch once what it decided is recorded on the requests
            prepared = record_prepared(self.resource_manager.prepare_resources(scheduled), iteration)
            batch = prepared.scheduled
            bound = budget_bound(batch, self.active_requests)
            if batch.is_empty:
                return launch(prepared, bound), None
            masks = self.sampler.token_masks(batch)  # guided requests' grammar masks, applied on the device
            pending = self.model_engine.forward_async(batch, masks) if masks else self.model_engine.forward_async(batch)
            forward_tokens = pending.num_tokens
            launched = launch(prepared, bound, forward_tokens)
            return launched, advance(batch, pending, launched, self.model_engine.can_pick if self.overlap else None)
        except TokenBudgetExceeded as error:  # the forward's own check against the cost oracle
            failure = self.failures.budget_exceeded(prepared.scheduled.all_requests, error)
            return launch(prepared, bound, error.total_num_tokens, error.overshoot, failure), None
        except Exception as error:  # one bad batch must not take the server down
            if prepared is None:  # the KV manager or the budget policy raised: a bug, not the device
                failure = self.failures.batch_raised(scheduled.all_requests, error, iteration)
            else:  # the launch failed; a forward in flight before it is still good
                retry, failure = self.failures.forward_failed(prepared.scheduled.all_requests, error, iteration)
                self._start_over(retry, in_flight_output_valid=True)
            return launch(prepared, bound, forward_tokens, failure=failure), None

    def _complete_in_flight(self, dropping: Collection[int] = _NONE) -> IterationStats | None:
        """Complete the forward in flight, if any; its statistics."""
        flight, self._in_flight = self._in_flight, None
        return self._complete(flight, dropping) if flight is not None else None

    def _complete(self, flight: InFlight, dropping: Collection[int] = _NONE) -> IterationStats:
        """Wait for the forward; its tokens reach the requests (but those in ``dropping``), the KV
        manager records what it computed, its statistics are made and published. A forward that
        failed on the device starts its requests over or fails them; a failure after it fails
        that batch's requests (``failures``)."""
        launch = flight.launch
        try:
            output = flight.pending.result()
        except Exception as error:  # the forward failed on the device: retry its requests
            retry, failure = self.failures.forward_failed(flight.batch.all_requests, error, launch.iteration, dropping)
            stats = self._record(launch, failure=failure)  # before the forward _start_over completes
            self._start_over(retry, in_flight_output_valid=False)
            return stats
        drafts, failure = NO_DRAFTS, None
        try:
            now = self.clock()  # one instant for every token of this forward
            live, sampled = sample(self.sampler, flight, output, dropping)
            if output.draft_targets:
                drafts = count_drafts(live, sampled, output.draft_targets)
            self.completion.update_requests(live, sampled, now)
            self.resource_manager.update_resources(flight.batch)
        except Exception as error:  # one bad batch must not take the server down
            failure = self.failures.batch_raised(flight.batch.all_requests, error, launch.iteration)
        return self._record(launch, drafts, failure)

    def _start_over(self, requests: list[LlmRequest], *, in_flight_output_valid: bool) -> None:
        """The requests of a failed forward start over as context (``Failures.start_over``).

        Under overlap another forward in flight may hold the same requests: it completes first
        (their blocks cannot be freed under it), and ``in_flight_output_valid`` says whether its
        tokens for them count (it was launched before a launch that failed) or are dropped (it
        was built on the failed forward's tokens)."""
        if not requests:
            return
        ids = frozenset(map(_request_id, requests))
        if not ids.isdisjoint(self.in_flight_request_ids):
            self._complete_in_flight(_NONE if in_flight_output_valid else ids)
        self.failures.start_over(requests, self.drafter)

    def _free_finished(self) -> None:
        """Free what the requests finished since the last call held; drop them from the active
        list. A request in the forward in flight keeps its blocks until that completes."""
        if not self.responses.finished:
            return
        for request in self.responses.take_finished(self.in_flight_request_ids):
            self.resource_manager.free_resources(request, store_for_reuse=request.state is _COMPLETE)
            self.sampler.release(request)
        self.active_requests = [r for r in self.active_requests if r.state is not _COMPLETE and r.state is not _ERROR]

    def _record(
        self, launch: Launch, drafts: Drafts = NO_DRAFTS, failure: BatchFailure | None = None
    ) -> IterationStats:
        """The iteration is over: make its statistics, once, and publish them."""
        completion = Completion(self.clock(), len(self.active_requests), drafts, failure)
        if self.drafter is not None and failure is None:  # whether speculation pays (acceptance_rate_threshold)
            self.drafter.observe(drafts.verified, drafts.accepted)
        stats = make_stats(launch, completion)
        self._stats.publish(stats)
        return stats
