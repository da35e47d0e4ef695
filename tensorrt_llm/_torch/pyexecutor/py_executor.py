"""``PyExecutor``: the executor's iteration, driven by an :class:`~executor_loop.ExecutorLoop`.

``PyExecutor`` is the stepper: it holds the requests, the scheduler, the resource manager,
the engine and the sampler, and runs one iteration per :meth:`PyExecutor.step`. The thread,
the submission queue, cancellations, health and the loop's death are
:class:`~executor_loop.ExecutorLoop`'s (``self.loop``); ``PyExecutor`` answers the
:class:`~executor_client.ExecutorClient` interface by asking it. One iteration is
upstream's, as a chain of values::

    arrivals + cancelled (from the loop) ─► drafter.prepare_draft_tokens(active) (speculative decoding)
        ─► scheduler.schedule_request(active) ─► ScheduledRequests
        ─► pause what the capacity stage preempts
        ─► resource_manager.prepare_resources(scheduled) ─► PreparedBatch
               (re-check ─► allocation ─► after-allocation fix-ups; see resource_manager)
        ─► record deferrals and reuse on the requests
        ─► model_engine.forward_async(batch) ─► PendingForward; requests move past it ─► _InFlight
        ─► complete the previous forward: sample / fill in its tokens, respond,
               resource_manager.update_resources
           ─► make_stats(Launch, Completion) ─► IterationStats, published (see ``iteration``)
        ─► free finished requests
    ─► Iteration(launch, stats)

**Overlap** (upstream's overlap scheduler; ``disable_overlap_scheduler`` False, the default
when the engine completes asynchronously, i.e. on CUDA): the forward launched by step n+1 is
built while forward n still runs, and forward n is completed only after n+1 is launched, so the
host's fetch, schedule, re-check and allocation hide behind the device. A request that samples
in forward n gets a placeholder token (``IN_FLIGHT_TOKEN_ID``) in its ``tokens`` at launch:
the scheduler, the re-check and the KV manager therefore charge it its *next* position, as
upstream charges a generation request in flight, and the engine feeds its own pick into n+1.
Completing n writes the sampled token over the placeholder and responds. Without overlap the
same phases run with the launch completed at once (no placeholder is ever written).

Under overlap, upstream's rules for what n+1 cannot know:

* a request that finishes at n by EOS or a stop token was also scheduled into n+1: the
  token n+1 computes for it is dropped (never sent), and its KV blocks are freed only when n+1
  completes (the device still writes them); a request whose placeholder is its last token by
  ``max_new_tokens`` is known to finish and is not scheduled again;
* a request whose next token the engine cannot pick (sampling other than greedy, beams:
  ``ModelEngine.can_pick``) gets no placeholder, and the forward it samples in is completed
  before the next iteration is scheduled (that iteration runs without overlap);
* a speculative request stays under overlap where the engine accepts drafts itself: forward n
  verifying ``k`` drafts leaves ``k + 1`` placeholders (as if it accepted them all), the drafter
  proposes n+1's drafts after them, and n+1 is built on them; the engine moves n+1 back over the
  drafts n rejected (positions on the device, the KV written there is overwritten later), and
  completing n replaces the placeholders with the run it accepted, which pulls n+1's placeholders
  back the same way; blocks that held only rejected positions go back to the pool at the commit;
* a capacity pause (``MAX_UTILIZATION``) of a request in flight waits for its forward: the
  iteration completes it first and schedules again;
* a request cancelled or failed while in flight keeps its blocks until its forward completes;
  its output from that forward is dropped.

Each phase takes what the previous one returned; only the executor writes request state
(see ``llm_request``). An iteration never fails as a whole: whatever a batch raises —
``TokenBudgetExceeded`` from ``_prepare_tp_inputs`` included — fails that batch's requests
with the error, is counted in the iteration's statistics and in :meth:`health`, and the
next iteration serves everyone else; a request whose logits are not finite fails alone.
Whether a request is over is :func:`~stop_rule.finish`'s answer on every delivery path.
The loop's thread calls the same ``step`` that a replay with a virtual clock calls directly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Collection, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.sampling.beam_search import BeamStep
from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY, ExecutorConfig
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter
from tensorrt_llm._torch.pyexecutor.errors import (
    InvalidRequestError,
    SamplingError,
    TokenBudgetExceeded,
)
from tensorrt_llm._torch.pyexecutor.executor.client import (
    Health,
    IterationListener,
    Load,
    Response,
    ResponseCallback,
)
from tensorrt_llm._torch.pyexecutor.executor.loop import Arrival, ExecutorLoop, StepCounts
from tensorrt_llm._torch.pyexecutor.iteration.records import (
    NO_DRAFTS,
    BatchFailure,
    Completion,
    Drafts,
    Iteration,
    Launch,
    make_stats,
)
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import (
    IN_FLIGHT_TOKEN_ID,
    DeferReason,
    LlmRequest,
    LlmRequestState,
    num_in_flight_tokens,
    token_array,
)
from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput, ModelEngine, PendingForward
from tensorrt_llm._torch.pyexecutor.executor.validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.priority import priority_class
from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch, ResourceManager
from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats
from tensorrt_llm._torch.pyexecutor.sampling.stop_rule import finish

logger = logging.getLogger(__name__)

# ``LlmRequest.is_finished`` is ``state`` being one of these; the per-forward loops compare
# identities instead (a property call, or an Enum's Python-level hash, per request per forward).
_COMPLETE, _ERROR = LlmRequestState.GENERATION_COMPLETE, LlmRequestState.ERROR
_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_request_id = attrgetter("request_id")
_IN_FLIGHT = token_array([IN_FLIGHT_TOKEN_ID])  # times a width: a speculative request's placeholders


# Response(request_id, tokens) for the one response per generated token: the named tuple's
# own constructor is a Python function (its defaults), tuple.__new__ is the C one; the fields
# after the first two take their declared defaults.
_new_tuple = tuple.__new__
_RESPONSE_DEFAULTS = tuple(Response._field_defaults.values())
assert Response._fields[2:] == tuple(Response._field_defaults), "every Response field after the tokens has a default"


@dataclass(slots=True)
class _InFlight:
    """A launched forward whose tokens have not reached its requests yet."""

    pending: PendingForward
    batch: ScheduledRequests  # the batch that runs
    sampling: list[LlmRequest]  # the requests that sample in it, in batch order
    # each one's placeholders in its tokens (1, or 1 + the drafts it verifies), or None: appended at completion
    slots: list[int | None]
    request_ids: frozenset[int]  # every request in the forward: their blocks stay held until it completes
    launch: Launch  # what the iteration decided and measured up to its launch

    @property
    def overlappable(self) -> bool:
        """Whether the next iteration can be scheduled before this one completes."""
        return None not in self.slots


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
        self._in_flight: _InFlight | None = None
        # Requests starting over after a failed forward: a later forward already in flight was
        # built on the failed one's tokens, so its output for them is dropped (_start_over).
        self._dropping: frozenset[int] = frozenset()
        self.active_requests: list[LlmRequest] = []
        # A ring when iter_stats_max_iterations is set (a server); the whole record otherwise (a replay).
        self._stats: deque[IterationStats] = deque(maxlen=config.iter_stats_max_iterations)
        self.num_budget_violations = 0
        self.num_failed_batches = 0
        self.num_preemptions = 0  # requests paused for one of higher priority (SchedulerConfig.enable_preemption)
        self._priority_ignored_logged = False
        self.last_error: str | None = None
        self._callbacks: dict[int, ResponseCallback] = {}
        self._finished: list[LlmRequest] = []  # finished since the last _free_finished
        self._iteration = 0
        self._iteration_listeners: list[IterationListener] = []
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
        return bool(self.active_requests or self._in_flight is not None or self._finished)

    @property
    def in_flight_request_ids(self) -> frozenset[int]:
        """The requests of the forward in flight (overlap; none without): the next :meth:`step`
        completes it, and their blocks stay held until then."""
        return self._in_flight.request_ids if self._in_flight is not None else frozenset()

    def step(
        self, arrivals: Sequence[Arrival] | None = None, cancelled: Collection[int] = ()
    ) -> Iteration | None:
        """Run one iteration; None when there was nothing to schedule. Called with no
        ``arrivals``, it takes what the loop has queued (and cancelled) first.

        The phases, in order (each takes what the one before returned): admit the arrivals,
        end the cancelled, schedule, prepare_resources, launch; then complete the previous
        launch (overlap) or this one (sample, respond, update_resources); free; offload ahead
        (``KVCacheManager.offload_ahead``, when configured). Returns the
        iteration launched here; its statistics are published when its forward completes.
        """
        if arrivals is None:
            return self.loop.step()
        self._fetch_new_requests(arrivals)
        self._handle_cancellations(cancelled)
        if self._in_flight is not None and not self._in_flight.overlappable:
            self._complete_in_flight()  # only the host's sampler knows a token the next batch needs
            self._free_finished()
        if not self.active_requests:
            self._complete_in_flight()
            self._free_finished()
            return None
        if self.drafter is not None:  # the tokens of every forward it drafts from have arrived (can_pick)
            self.drafter.prepare_draft_tokens(self.active_requests)
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
        self._iteration_listeners.append(listener)

    @property
    def iteration_stats(self) -> list[IterationStats]:
        """The iteration statistics kept (a ring of ``iter_stats_max_iterations``, or all), oldest first."""
        return list(self._stats)

    def iteration_stats_by_rank(self) -> list[tuple[int, IterationStats]]:
        """:attr:`iteration_stats`, each as rank 0's (the interface of several ranks)."""
        return [(0, stats) for stats in self.iteration_stats]

    def faults_injected(self) -> Mapping[str, int]:
        return dict(self.model_engine.faults_injected)

    def load(self) -> Load:
        """Requests holding blocks, requests waiting for them (queued included), the pool; any thread."""
        active = list(self.active_requests)  # a copy: the executor thread replaces the list
        kv = self.kv_cache_manager
        waiting = [r for r in active if not kv.is_allocated(r)]
        scheduling = self.config.scheduler_config
        by_class = Counter(priority_class(r.priority, scheduling) for r in waiting)
        return Load(len(active) - len(waiting), len(waiting) + self.loop.num_queued, kv.pool.stats(), dict(by_class))

    # ---- what the loop asks of its stepper ------------------------------------------
    def counts(self) -> StepCounts:
        return StepCounts(self._iteration, len(self.active_requests), self.num_failed_batches,
                          self.num_budget_violations, self.last_error)

    def recover(self, error: Exception) -> None:
        """A bug outside any batch: fail what is active, keep serving."""
        self.last_error = repr(error)
        for request in self.active_requests:
            self._fail(request, error)
        self._free_finished()

    def fail_all(self, error: Exception, queued: Sequence[Arrival]) -> None:
        """Every request held or ``queued`` (never admitted) ends with ``error``."""
        for request, on_response in queued:
            if on_response is not None:
                self._callbacks[request.request_id] = on_response
        for request in (*self.active_requests, *(request for request, _ in queued)):
            self._fail(request, error)
        self._free_finished()

    def close(self) -> None:
        """The loop stopped: complete the forward in flight (its blocks are freed with its requests)."""
        self._complete_in_flight()

    # ---- iteration parts ------------------------------------------------------------
    def _fetch_new_requests(self, arrivals: Sequence[Arrival]) -> None:
        for request, on_response in arrivals:
            if on_response is not None:
                self._callbacks[request.request_id] = on_response
            request.arrival_time = request.arrival_time or self.clock()
            if request.priority != DEFAULT_PRIORITY and not self._priority_ignored_logged \
                    and not self.config.scheduler_config.by_priority:
                self._priority_ignored_logged = True
                logger.info("request priorities are accepted and ignored: scheduler_config.waiting_queue_policy"
                            " is 'fcfs' (set it to 'priority' to honour them); said once")
            try:
                self.validate(request)
            except InvalidRequestError as error:
                logger.warning("%s", error)
                self._fail(request, error)
                continue
            if self.drafter is not None and self.drafter.admit(request):
                try:
                    self.validate(request)  # its draft slots: speculation never refuses a request
                except InvalidRequestError as error:
                    logger.debug("request %d runs without speculation: %s", request.request_id, error)
                    self.drafter.withdraw(request)
            self.active_requests.append(request)

    def _handle_cancellations(self, cancelled: Collection[int]) -> None:
        if not cancelled:
            return  # nothing to do: every path that finishes a request frees it before returning
        for request in self.active_requests:
            if request.request_id in cancelled and not request.is_finished:
                _drop_in_flight_tokens(request)
                request.is_cancelled = True
                request.state = LlmRequestState.GENERATION_COMPLETE
                request.finish_time = self.clock()
                self._finished.append(request)
                self._respond(request, Response(request.request_id, [], finished=True, cancelled=True))
        self._free_finished()

    def _schedule(self) -> ScheduledRequests:
        """Schedule the active requests; free and restart the ones the capacity stage preempts.

        Under overlap a request whose in-flight token is its last (``max_new_tokens``) is not
        scheduled again, and a pause never frees blocks a forward in flight uses: the forward
        completes first and the requests are scheduled again."""
        scheduled = self.scheduler.schedule_request(self._schedulable(), self._iteration)
        in_flight = self._in_flight
        if in_flight is not None and any(r.request_id in in_flight.request_ids for r in scheduled.paused_requests):
            self._complete_in_flight()
            self._free_finished()
            scheduled = self.scheduler.schedule_request(self.active_requests, self._iteration)
        for request in scheduled.paused_requests:
            # its computed full blocks stay cached (to the host tier under pressure): a resumption claims them
            self.resource_manager.free_resources(request)
            if request.request_id in scheduled.preempted_for:
                request.preempt()
                self.num_preemptions += 1
                self._check_restartable(request, "preempted by a request of higher priority")
            else:
                request.pause()
                self._check_restartable(request, "paused to free KV memory")
        return scheduled

    def _check_restartable(self, request: LlmRequest, why: str) -> None:
        """A request that starts over as context must fit one forward when chunked prefill is
        off; fail it otherwise rather than let it (and every context request queued behind it)
        wait forever."""
        if self.drafter is not None:  # back in its prompt: the drafter takes its drafts away
            self.drafter.prepare_draft_tokens((request,))
        context = request.prompt_len + request.num_draft_tokens  # now with its generated tokens
        if not self.config.enable_chunked_prefill and context > self.config.max_num_tokens:
            self._fail(request, InvalidRequestError(
                f"request {request.request_id}: {why}, its context of {context} tokens (prompt + generated)"
                f" exceeds max_num_tokens {self.config.max_num_tokens} and chunked prefill is off"
            ))

    def _schedulable(self) -> list[LlmRequest]:
        if self._in_flight is None:
            return self.active_requests
        return [
            r for r in self.active_requests
            if r.tokens[-1] != IN_FLIGHT_TOKEN_ID or len(r.tokens) < r.max_total_len
        ]

    def _launch(self, scheduled: ScheduledRequests) -> tuple[Launch, _InFlight | None]:
        """prepare_resources, then launch the forward: what that decided and measured, and the
        forward in flight, None when nothing runs (an empty batch, or a batch that failed: its
        requests have their error)."""
        iteration = self._iteration
        self._iteration += 1
        # What is known before prepare_resources; each way out adds what it learnt.
        launch = functools.partial(Launch, iteration, self.clock(), self.config.max_num_tokens, scheduled)
        prepared = None
        budget_bound = False
        forward_tokens = 0
        try:
            prepared = self._prepare_resources(scheduled)
            budget_bound = self._budget_bound(prepared.scheduled)
            batch = prepared.scheduled
            if batch.is_empty:
                return launch(prepared, budget_bound), None
            pending = self.model_engine.forward_async(batch)
            forward_tokens = pending.num_tokens
            launched = launch(prepared, budget_bound, forward_tokens)
            return launched, self._advance(batch, pending, launched)
        except TokenBudgetExceeded as error:
            self.num_budget_violations += 1
            failure = self._fail_batch(prepared.scheduled.all_requests, error)
            return launch(prepared, budget_bound, error.total_num_tokens, error.overshoot, failure), None
        except Exception as error:  # one bad batch must not take the server down
            if prepared is None:  # the KV manager or the budget policy raised: a bug, not the device
                failure = self._fail_iteration(scheduled.all_requests, error, iteration)
            else:  # the launch failed; a forward in flight before it is still good
                retry, failure = self._forward_failed(prepared.scheduled.all_requests, error, iteration)
                self._start_over(retry, in_flight_output_valid=True)
            return launch(prepared, budget_bound, forward_tokens, failure=failure), None

    def _prepare_resources(self, scheduled: ScheduledRequests) -> PreparedBatch:
        """Re-check, allocate, fix up (``ResourceManager``); then record on the requests what
        that decided: who was deferred, and the prefix each new allocation reused."""
        prepared = self.resource_manager.prepare_resources(scheduled)
        for deferral in prepared.deferred:
            if deferral.reason is DeferReason.BUDGET:
                deferral.request.record_budget_deferral()
            else:
                deferral.request.record_capacity_deferral()
        for claim in prepared.claims:
            if claim.reused_tokens:
                claim.request.reuse_prefix(claim.reused_tokens)
            if claim.request.awaiting_resumption:  # a preempted request got its blocks back
                claim.request.record_resumption(self._iteration - 1, claim.reused_tokens, claim.onboarded_tokens)
        return prepared

    def _budget_bound(self, batch: ScheduledRequests) -> bool:
        """DESIGN.md §5: the budget, not the traffic, limited this iteration when some active
        request still has prompt tokens to compute after ``batch`` (taken before it runs)."""
        finishing = {c.request.request_id for c in batch.context_chunks if c.is_last}
        # Newest first: requests still in their prompt are the latest to arrive, so the scan
        # usually stops at once instead of passing every generation request first.
        return any(
            r.state is _CONTEXT_INIT and r.request_id not in finishing for r in reversed(self.active_requests)
        )

    def _advance(self, batch: ScheduledRequests, pending: PendingForward, launch: Launch) -> _InFlight:
        """Move each request past the positions the launched forward computes. Under overlap a
        request that samples and whose token the engine picks gets that token's placeholder."""
        sampling = [chunk.request for chunk in batch.context_chunks if chunk.is_last]
        sampling += batch.generation_requests
        # whether the engine picks each one's token, asked before first-draft padding goes
        picked = list(map(self.model_engine.can_pick, sampling)) if self.overlap else None
        for chunk in batch.context_chunks:
            request = chunk.request
            request.complete_context_chunk(chunk.end)
            request.record_forward()
            if chunk.is_last:
                request.state = LlmRequestState.GENERATION_IN_PROGRESS
        for request in batch.generation_requests:
            if request.consecutive_budget_deferrals:
                request.record_forward()
            if request.is_first_draft:
                request.is_first_draft = False  # it runs its padded first draft step
        slots: list[int | None] = [None] * len(sampling)  # without overlap tokens are appended at completion
        if picked is not None:
            for index, (request, pick) in enumerate(zip(sampling, picked)):
                if pick:
                    # one placeholder per draft it verifies, then one for the token after them
                    width = 1 + len(request.py_draft_tokens)
                    slots[index] = width
                    if width == 1:
                        request.tokens.append(IN_FLIGHT_TOKEN_ID)
                    else:
                        request.tokens.extend(_IN_FLIGHT * width)
        ids = frozenset(map(_request_id, batch.all_requests))
        return _InFlight(pending, batch, sampling, slots, ids, launch)

    def _complete_in_flight(self) -> IterationStats | None:
        """Complete the forward in flight, if any; its statistics."""
        flight, self._in_flight = self._in_flight, None
        return self._complete(flight) if flight is not None else None

    def _complete(self, flight: _InFlight) -> IterationStats:
        """Wait for the forward; its tokens reach the requests, the KV manager records what it
        computed, its statistics are made and published. A forward that failed on the device
        retries its requests (:meth:`_forward_failed`); a failure after it fails that batch's
        requests."""
        launch = flight.launch
        try:
            output = flight.pending.result()
        except Exception as error:  # the forward failed on the device: retry its requests
            retry, failure = self._forward_failed(flight.batch.all_requests, error, launch.iteration)
            stats = self._record(launch, failure=failure)  # before the forward _start_over completes
            self._start_over(retry, in_flight_output_valid=False)
            return stats
        drafts, failure = NO_DRAFTS, None
        try:
            now = self.clock()  # one instant for every token of this forward
            live, sampled = self._sample(flight, output)
            if output.draft_targets:
                drafts = _count_drafts(live, sampled, output.draft_targets)
            self._update_requests(live, sampled, now)
            self.resource_manager.update_resources(flight.batch)
        except Exception as error:  # one bad batch must not take the server down
            failure = self._fail_iteration(flight.batch.all_requests, error, launch.iteration)
        return self._record(launch, drafts, failure)

    def _sample(self, flight: _InFlight, output: ForwardOutput) -> tuple[list[tuple[LlmRequest, int | None]], list]:
        """The requests of ``flight`` that still want its tokens (with their placeholder counts),
        and what the sampler returned for each. A request that finished while the forward was
        in flight gets nothing from it (upstream drops it)."""
        dropping = self._dropping
        live = [(r, slot) for r, slot in zip(flight.sampling, flight.slots)
                if r.state is not _COMPLETE and r.state is not _ERROR and (not dropping or r.request_id not in dropping)]
        if output.prompt_logits:  # before sampling: a request's first response carries its prompt's
            self.sampler.record_prompt_logprobs([c.request for c in flight.batch.context_chunks], output)
        return live, self.sampler.sample_batch([r for r, _ in live], output)

    def _update_requests(self, live: list[tuple[LlmRequest, int | None]], sampled: list, now: float) -> None:
        """Write each sampled token over its placeholder (or append it); respond. Whether a
        request is over is :func:`~stop_rule.finish`'s answer, on every path.

        The usual request (tokens appended, not its last, not its first) is answered in the
        loop itself, with a call only to its callback: this runs for every generated token."""
        callbacks = self._callbacks
        for (request, slot), tokens in zip(live, sampled):
            if tokens.__class__ is not list:  # the usual answer, a list of tokens, is told by one check
                if isinstance(tokens, SamplingError):  # this request's logits or settings are broken, not the batch's
                    logger.error("%s", tokens)
                    self._fail(request, tokens)
                    continue
                if isinstance(tokens, BeamStep):
                    self._advance_beams(request, tokens, now)
                    continue
            if slot is not None:
                self._fill(request, slot, tokens, now)
                continue
            sequence = request.tokens
            kept, finished = finish(request, tokens, len(sequence))
            if kept < len(tokens):
                tokens = tokens[:kept]
            sequence.extend(tokens)
            if finished or request.first_token_time is None:
                self._deliver(request, tokens, finished, now)
                continue
            callback = callbacks.get(request.request_id)
            if callback is not None:
                callback(request, _new_tuple(Response, (request.request_id, tokens, *_RESPONSE_DEFAULTS)))

    def _fill(self, request: LlmRequest, width: int, tokens: list[int], now: float) -> None:
        """Write the sampled tokens over this forward's ``width`` placeholders (the first of the
        trailing ones: a later forward's follow), as many as the stop rule keeps; a run shorter
        than its placeholders (rejected drafts) pulls the later ones back, as the engine moved that
        forward back. When the run ends the request drop every later placeholder (that forward's
        tokens for it will be dropped). Respond."""
        sequence = request.tokens
        start = len(sequence) - num_in_flight_tokens(sequence)
        kept, finished = finish(request, tokens, start)
        if kept < len(tokens):
            tokens = tokens[:kept]
        if width == 1:
            sequence[start] = tokens[0]
        else:
            sequence[start : start + width] = token_array(tokens)
        if finished:
            del sequence[start + len(tokens) :]
        self._deliver(request, tokens, finished, now)

    def _advance_beams(self, request: LlmRequest, step: BeamStep, now: float) -> None:
        """Apply a beam-search step: the request's beams, its tokens (beam 0's, so that its length
        is every beam's), its KV (each new beam's tables are its parent's). Nothing is sent until
        the search is over: a beam's tokens are not final while a better beam may replace it. Then
        the one response carries the returned beams, and ``tokens`` ends with the best one's."""
        state = step.state
        request.py_beams = state
        best = state.results[0] if state.done else state.live[0]
        del request.tokens[request.orig_prompt_len :]
        request.tokens.extend(best.tokens)
        if not state.done:
            if request.first_token_time is None:
                request.first_token_time = now
            self.kv_cache_manager.sequences.fork_beams(request, step.parents)
            return
        self._deliver(request, list(best.tokens), True, now, beams=state.results)

    def _deliver(
        self, request: LlmRequest, tokens: list[int], finished: bool, now: float, *, beams: tuple | None = None
    ) -> None:
        cached = request.prepopulated_prompt_len if request.first_token_time is None or beams is not None else None
        if request.first_token_time is None:
            request.first_token_time = now
        if finished:
            request.state = LlmRequestState.GENERATION_COMPLETE
            request.finish_time = now
            self._finished.append(request)
            callback = self._callbacks.pop(request.request_id, None)
        else:
            callback = self._callbacks.get(request.request_id)
        if callback is not None:
            callback(request, Response(request.request_id, tokens, finished, beams=beams, cached_tokens=cached))

    def _fail_iteration(self, requests: list[LlmRequest], error: Exception, iteration: int) -> BatchFailure:
        """An unexpected error at launch or completion: log it with its traceback (call from the
        ``except`` block) and fail the batch's requests."""
        logger.exception("iteration %d failed; failing its %d requests", iteration, len(requests))
        return self._fail_batch(requests, error)

    def _forward_failed(
        self, requests: list[LlmRequest], error: Exception, iteration: int
    ) -> tuple[list[LlmRequest], BatchFailure]:
        """A forward failed at launch or on the device (call from the ``except`` block). The batch
        counts as failed; its requests with a retry left (``max_forward_retries`` in a row, see
        ``LlmRequest.can_retry_forward``) are returned to :meth:`_start_over`, the others fail
        with the error."""
        logger.exception("iteration %d: the forward failed; retrying or failing its %d requests",
                         iteration, len(requests))
        self.num_failed_batches += 1
        self.last_error = str(error)
        live = [r for r in requests if not r.is_finished and r.request_id not in self._dropping]
        retry, failed = [], []
        for request in live:
            (retry if request.can_retry_forward(self.config.max_forward_retries) else failed).append(request)
        for request in failed:
            logger.warning("request %s fails: its forward failed again before it made progress (max_forward_retries=%d)",
                           request.request_id, self.config.max_forward_retries)
            self._fail(request, error)
        return retry, BatchFailure(str(error), len(failed), len(retry))

    def _start_over(self, requests: list[LlmRequest], *, in_flight_output_valid: bool) -> None:
        """The requests of a failed forward start over as context: KV freed (what the forward
        should have written cannot be trusted), generated tokens kept and recomputed, so a
        streamed output goes on where it stopped.

        Under overlap another forward in flight may hold the same requests: it completes first
        (their blocks cannot be freed under it), and ``in_flight_output_valid`` says whether its
        tokens for them count (it was launched before a launch that failed) or are dropped (it
        was built on the failed forward's tokens)."""
        if not requests:
            return
        ids = frozenset(map(_request_id, requests))
        if self._in_flight is not None and not ids.isdisjoint(self._in_flight.request_ids):
            self._dropping = frozenset() if in_flight_output_valid else ids
            try:
                self._complete_in_flight()
            finally:
                self._dropping = frozenset()
        for request in requests:
            if request.is_finished:  # finished by the forward that just completed
                continue
            _drop_in_flight_tokens(request)
            self.resource_manager.free_resources(request, store_for_reuse=False)
            request.retry_after_failed_forward()
            self._check_restartable(request, "its forward failed and it starts over")

    def _fail_batch(self, requests: list[LlmRequest], error: Exception) -> BatchFailure:
        self.num_failed_batches += 1
        self.last_error = str(error)
        for request in requests:
            self._fail(request, error)
        return BatchFailure(str(error), len(requests))

    def _fail(self, request: LlmRequest, error: Exception) -> None:
        if request.is_finished:
            return
        _drop_in_flight_tokens(request)
        request.set_error(f"{type(error).__name__}: {error}")
        request.finish_time = self.clock()
        self._finished.append(request)
        self._respond(request, Response(request.request_id, [], finished=True, error=request.error))

    def _free_finished(self) -> None:
        """Free what the requests finished since the last call held; drop them from the active
        list. A request in the forward in flight keeps its blocks until that completes."""
        if not self._finished:
            return
        busy = self._in_flight.request_ids if self._in_flight is not None else frozenset()
        finished, self._finished = self._finished, []
        for request in finished:
            if request.request_id in busy:
                self._finished.append(request)
                continue
            store = request.state is LlmRequestState.GENERATION_COMPLETE
            self.resource_manager.free_resources(request, store_for_reuse=store)
            self.sampler.release(request)
        self.active_requests = [r for r in self.active_requests if r.state is not _COMPLETE and r.state is not _ERROR]

    def _respond(self, request: LlmRequest, response: Response) -> None:
        callback = self._callbacks.get(request.request_id)
        if response.finished:
            self._callbacks.pop(request.request_id, None)
        if callback is not None:
            callback(request, response)

    def _record(
        self, launch: Launch, drafts: Drafts = NO_DRAFTS, failure: BatchFailure | None = None
    ) -> IterationStats:
        """The iteration is over: make its statistics, once, and publish them."""
        completion = Completion(self.clock(), len(self.active_requests), drafts, failure)
        if self.drafter is not None and failure is None:  # whether speculation pays (acceptance_rate_threshold)
            self.drafter.observe(drafts.verified, drafts.accepted)
        stats = make_stats(launch, completion)
        self._stats.append(stats)
        for listener in self._iteration_listeners:
            try:
                listener(stats)
            except Exception:  # statistics must never stop the loop
                logger.exception("iteration listener %r failed", listener)
        return stats


def _count_drafts(
    live: list[tuple[LlmRequest, int | None]], sampled: list, targets: Mapping[int, list[int]]
) -> Drafts:
    """Drafts the forward verified, and how many the sampler accepted (before the stop rule)."""
    verified = accepted = 0
    for (request, _), tokens in zip(live, sampled):
        picks = targets.get(request.request_id)
        if picks is not None and not isinstance(tokens, SamplingError):
            verified += len(picks) - 1
            accepted += len(tokens) - 1
    return Drafts(verified, accepted)


def _drop_in_flight_tokens(request: LlmRequest) -> None:
    """A request that ends while forwards are in flight keeps none of their placeholders."""
    count = num_in_flight_tokens(request.tokens)
    if count:
        del request.tokens[-count:]
