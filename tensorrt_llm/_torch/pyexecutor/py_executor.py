"""``PyExecutor``: the serving loop.

One iteration (:meth:`PyExecutor.step`) is upstream's, as a chain of values::

    fetch + cancel ─► scheduler.schedule_request(active) ─► ScheduledRequests
        ─► pause what the capacity stage preempts
        ─► resource_manager.prepare_resources(scheduled) ─► PreparedBatch
               (re-check ─► allocation ─► after-allocation fix-ups; see resource_manager)
        ─► record deferrals and reuse on the requests
        ─► model_engine.forward(batch) ─► ForwardOutput
        ─► sample / update requests, respond ─► resource_manager.update_resources(batch)
        ─► IterationStats ─► free finished requests
    ─► Iteration(stats, scheduled, prepared)

Each phase takes what the previous one returned; only the executor writes request state
(see ``llm_request``). The loop never dies on a batch: whatever a batch raises —
``TokenBudgetExceeded`` from ``_prepare_tp_inputs`` included — fails that batch's requests
with the error, is counted in the iteration's statistics and in :meth:`health`, and the
next iteration serves everyone else; a request whose logits are not finite fails alone.
The background thread calls the same ``step`` that a replay with a virtual clock calls
directly.

Should the thread die all the same (upstream's failure mode; a test hook reproduces it),
every request it held ends with an error, new ones are refused, and :meth:`health` says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.errors import (
    ExecutorLoopKilled,
    ExecutorShutdown,
    InvalidRequestError,
    NonFiniteLogitsError,
    TokenBudgetExceeded,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput, ModelEngine
from tensorrt_llm._torch.pyexecutor.request_validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.resource_manager import KV_CACHE_MANAGER, PreparedBatch, ResourceManager
from tensorrt_llm._torch.pyexecutor.sampler import Sampler
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm._torch.pyexecutor.stats import IterationStats

logger = logging.getLogger(__name__)


class Response(NamedTuple):
    """What changed for one request: new tokens, and whether it is over (and how).

    A tuple: one is built per request per iteration, and a frozen dataclass costs several
    times as much to build.
    """

    request_id: int
    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None
    cancelled: bool = False


ResponseCallback = Callable[[LlmRequest, Response], None]
IterationListener = Callable[[IterationStats], None]


@dataclass(frozen=True, slots=True)
class Iteration:
    """What one :meth:`PyExecutor.step` did, as values.

    ``scheduled`` is the batch as the scheduler built it (admission charges, reuse
    estimates); ``prepared`` what ``prepare_resources`` made of it — the batch that ran,
    the deferrals, the claims — or None when ``prepare_resources`` itself failed.
    """

    stats: IterationStats
    scheduled: ScheduledRequests
    prepared: PreparedBatch | None

    @property
    def batch(self) -> ScheduledRequests:
        """The batch that ran (or would have run, for a batch that failed)."""
        return self.prepared.scheduled if self.prepared is not None else self.scheduled


class PyExecutor:
    def __init__(
        self,
        *,
        config: ExecutorConfig,
        scheduler: SimpleScheduler,
        resource_manager: ResourceManager,
        model_engine: ModelEngine,
        sampler: Sampler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.resource_manager = resource_manager
        self.kv_cache_manager: KVCacheManager = resource_manager.get_resource_manager(KV_CACHE_MANAGER)
        self.model_engine = model_engine
        self.sampler = sampler
        self.clock = clock
        self.limits = RequestLimits.of(config, self.kv_cache_manager, model_engine)
        self.active_requests: list[LlmRequest] = []
        # A ring when iter_stats_max_iterations is set (a server); the whole record otherwise (a replay).
        self.iteration_stats: deque[IterationStats] = deque(maxlen=config.iter_stats_max_iterations)
        self.num_budget_violations = 0
        self.num_failed_batches = 0
        self.last_error: str | None = None
        self._callbacks: dict[int, ResponseCallback] = {}
        self._finished: list[LlmRequest] = []  # finished since the last _free_finished
        self._new_requests: deque[LlmRequest] = deque()
        self._cancelled: set[int] = set()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._shutdown = False
        self._iteration = 0
        self._iteration_listeners: list[IterationListener] = []
        # Health: when the loop last showed progress (wall clock, whatever ``clock`` is), and
        # why it died, if it did.
        self._heartbeat = time.monotonic()
        self._loop_error: str | None = None
        self._kill_requested = False

    # ---- submission (any thread) ----------------------------------------------------
    def enqueue_request(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        """Queue ``request``; an invalid one fails alone at the next iteration, with the reason."""
        with self._wakeup:
            if self._shutdown:
                raise ExecutorShutdown("the executor is shut down")
            if self._loop_error is not None:
                raise ExecutorShutdown(f"the executor loop died: {self._loop_error}")
            if not self.has_work:  # a stall is timed from when work arrives, not from the last idle iteration
                self._heartbeat = time.monotonic()
            if on_response is not None:
                self._callbacks[request.request_id] = on_response
            self._new_requests.append(request)
            self._wakeup.notify()
        return request.request_id

    def cancel_request(self, request_id: int) -> None:
        with self._wakeup:
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def validate(self, request: LlmRequest) -> None:
        """Raise InvalidRequestError if this executor could never serve ``request``."""
        validate_request(request, self.limits, self.kv_cache_manager)

    # ---- the loop -------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.active_requests or self._new_requests or self._cancelled)

    def step(self) -> Iteration | None:
        """Run one iteration; None when there was nothing to do.

        The phases, in order (each takes what the one before returned): schedule,
        prepare_resources, forward, sample/update, respond, free.
        """
        self._fetch_new_requests()
        self._handle_cancellations()
        if not self.active_requests:
            return None
        scheduled = self._schedule()
        stats = IterationStats(self._iteration, self.clock(), max_num_tokens=self.config.max_num_tokens)
        self._iteration += 1
        prepared = None
        try:
            prepared = self._prepare_resources(scheduled, stats)
            batch = prepared.scheduled
            if not batch.is_empty:
                output = self.model_engine.forward(batch)
                stats.forward_tokens = output.num_tokens
                self._update_requests(batch, output)
                self.resource_manager.update_resources(batch)
        except TokenBudgetExceeded as error:
            self.num_budget_violations += 1
            stats.forward_tokens, stats.overshoot = error.total_num_tokens, error.overshoot
            self._fail_batch(prepared.scheduled.all_requests, error, stats)
        except Exception as error:  # one bad batch must not take the server down
            failed = (prepared.scheduled if prepared is not None else scheduled).all_requests
            logger.exception("iteration %d failed; failing its %d requests", stats.iteration, len(failed))
            self._fail_batch(failed, error, stats)
        self._record(stats, scheduled, prepared)
        self._free_finished()
        return Iteration(stats, scheduled, prepared)

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Step until every submitted request has finished (tests and replays)."""
        for _ in range(max_iterations):
            if not self.has_work:
                return
            self.step()
        raise RuntimeError(f"still busy after {max_iterations} iterations: {self.active_requests[:5]}")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._executor_loop, name="PyExecutor", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests get an ExecutorShutdown error."""
        with self._wakeup:
            self._shutdown = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        self._fetch_new_requests()
        for request in self.active_requests:
            self._fail(request, ExecutorShutdown("the executor shut down before the request finished"))
        self._free_finished()

    def add_iteration_listener(self, listener: IterationListener) -> None:
        """Call ``listener(stats)`` on the executor thread after every iteration; it must be quick.
        An exception it raises is logged and ignored."""
        self._iteration_listeners.append(listener)

    def health(self) -> dict:
        """Liveness and the batch failures a load balancer should see; callable from any thread.

        ``healthy`` is False once the loop has died or shut down, or while it has work and
        has not finished an iteration for ``health_check_timeout_s`` (``reason`` says which).
        Failed batches do not make it unhealthy: the loop goes on serving.
        """
        alive = self._thread is None or self._thread.is_alive()
        stalled_s = time.monotonic() - self._heartbeat if self.has_work else 0.0
        reason = None
        if self._loop_error is not None:
            reason = f"the executor loop died: {self._loop_error}"
        elif self._shutdown:
            reason = "the executor is shut down"
        elif not alive:
            reason = "the executor loop thread is not running"
        elif stalled_s > self.config.health_check_timeout_s:
            reason = (
                f"the executor loop has not finished an iteration for {stalled_s:.1f} s while it has work"
                f" (health_check_timeout_s={self.config.health_check_timeout_s:g})"
            )
        return {
            "healthy": reason is None,
            "reason": reason,
            "alive": alive,
            "seconds_since_progress": round(stalled_s, 3),
            "iterations": self._iteration,
            "active_requests": len(self.active_requests),
            "queued_requests": len(self._new_requests),
            "failed_batches": self.num_failed_batches,
            "budget_violations": self.num_budget_violations,
            "last_error": self.last_error,
        }

    def kill_loop_for_testing(self) -> None:
        """Test hook: the loop thread dies at its next iteration, as upstream's did on its assertion."""
        with self._wakeup:
            self._kill_requested = True
            self._wakeup.notify()

    def _executor_loop(self) -> None:
        try:
            self._serve_forever()
        except BaseException as error:  # the thread is dying: nothing may be left waiting on it
            logger.critical("the executor loop died", exc_info=True)
            self._die(error)

    def _serve_forever(self) -> None:
        while True:
            with self._wakeup:
                while not self._shutdown and not self.has_work and not self._kill_requested:
                    self._wakeup.wait()
                if self._kill_requested:
                    raise ExecutorLoopKilled("killed by kill_loop_for_testing()")
                if self._shutdown:
                    return
                self._heartbeat = time.monotonic()
            try:
                self.step()
            except Exception as error:  # a bug outside any batch: fail what is active, keep serving
                logger.exception("executor iteration crashed outside a batch")
                self.last_error = repr(error)
                for request in self.active_requests:
                    self._fail(request, error)
                self._free_finished()
            self._heartbeat = time.monotonic()

    def _die(self, error: BaseException) -> None:
        """Every request the dead loop held or had queued ends with an error; later ones are refused."""
        with self._wakeup:
            self._loop_error = f"{type(error).__name__}: {error}"
            queued = list(self._new_requests)
            self._new_requests.clear()
        failure = ExecutorShutdown(f"the executor loop died: {self._loop_error}")
        for request in (*self.active_requests, *queued):
            self._fail(request, failure)

    # ---- iteration parts ------------------------------------------------------------
    def _fetch_new_requests(self) -> None:
        with self._wakeup:
            new = list(self._new_requests)
            self._new_requests.clear()
        for request in new:
            request.arrival_time = request.arrival_time or self.clock()
            try:
                self.validate(request)
            except InvalidRequestError as error:
                logger.warning("%s", error)
                self._fail(request, error)
                continue
            self.active_requests.append(request)

    def _handle_cancellations(self) -> None:
        with self._wakeup:
            cancelled, self._cancelled = self._cancelled, set()
        if not cancelled:
            return  # nothing to do: every path that finishes a request frees it before returning
        for request in self.active_requests:
            if request.request_id in cancelled and not request.is_finished:
                request.is_cancelled = True
                request.state = LlmRequestState.GENERATION_COMPLETE
                request.finish_time = self.clock()
                self._finished.append(request)
                self._respond(request, Response(request.request_id, [], finished=True, cancelled=True))
        self._free_finished()

    def _schedule(self) -> ScheduledRequests:
        """Schedule the active requests; free and restart the ones the capacity stage preempts."""
        scheduled = self.scheduler.schedule_request(self.active_requests)
        for request in scheduled.paused_requests:
            self.resource_manager.free_resources(request)
            request.pause()
            context = request.prompt_len + request.num_draft_tokens  # now with its generated tokens
            if not self.config.enable_chunked_prefill and context > self.config.max_num_tokens:
                # unchunked, it could never be scheduled again: fail it rather than let it (and
                # every context request queued behind it) wait forever
                self._fail(request, InvalidRequestError(
                    f"request {request.request_id}: paused to free KV memory, its context of {context} tokens"
                    f" (prompt + generated) exceeds max_num_tokens {self.config.max_num_tokens} and chunked"
                    " prefill is off"
                ))
        return scheduled

    def _prepare_resources(self, scheduled: ScheduledRequests, stats: IterationStats) -> PreparedBatch:
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
        # DESIGN.md §5: the budget, not the traffic, limited this iteration when some active
        # request still has prompt tokens to compute after this batch.
        finishing = {c.request.request_id for c in prepared.scheduled.context_chunks if c.is_last}
        stats.budget_bound = any(
            r.state is LlmRequestState.CONTEXT_INIT and r.request_id not in finishing for r in self.active_requests
        )
        return prepared

    def _update_requests(self, batch: ScheduledRequests, output: ForwardOutput) -> None:
        """Move each request past what the forward computed; sample and respond."""
        now = self.clock()  # one instant for every token of this forward
        sampling = []
        for chunk in batch.context_chunks:
            request = chunk.request
            request.complete_context_chunk(chunk.end)
            request.record_forward()
            if chunk.is_last:
                request.state = LlmRequestState.GENERATION_IN_PROGRESS
                sampling.append(request)
        generation = batch.generation_requests
        for request in generation:
            if request.consecutive_budget_deferrals:
                request.record_forward()
            if request.is_first_draft:
                request.is_first_draft = False  # it ran its padded first draft step
        sampling += generation
        append = self._append
        for request, tokens in zip(sampling, self.sampler.sample_batch(sampling, output)):
            if isinstance(tokens, NonFiniteLogitsError):  # this request's numbers are broken, not the batch's
                logger.error("%s", tokens)
                self._fail(request, tokens)
                continue
            append(request, tokens, now)

    def _append(self, request: LlmRequest, tokens: list[int], now: float) -> None:
        """Append sampled tokens up to the first stop token or ``max_new_tokens``; respond."""
        sequence = request.tokens
        limit = request.orig_prompt_len + request.max_new_tokens
        finished = False
        if len(tokens) == 1 and request.end_id is None and not request.stop_token_ids:  # the usual step
            sequence += tokens
            finished = len(sequence) >= limit
        else:
            for index, token in enumerate(tokens):
                sequence.append(token)
                if token == request.end_id or token in request.stop_token_ids or len(sequence) >= limit:
                    finished = True
                    tokens = tokens[: index + 1]
                    break
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
            callback(request, Response(request.request_id, tokens, finished))

    def _fail_batch(self, requests: list[LlmRequest], error: Exception, stats: IterationStats) -> None:
        self.num_failed_batches += 1
        self.last_error = str(error)
        stats.error = str(error)
        stats.num_failed_requests = len(requests)
        for request in requests:
            self._fail(request, error)

    def _fail(self, request: LlmRequest, error: Exception) -> None:
        if request.is_finished:
            return
        request.set_error(f"{type(error).__name__}: {error}")
        request.finish_time = self.clock()
        self._finished.append(request)
        self._respond(request, Response(request.request_id, [], finished=True, error=request.error))

    def _free_finished(self) -> None:
        """Free what the requests finished since the last call held; drop them from the active list."""
        if not self._finished:
            return
        finished, self._finished = self._finished, []
        for request in finished:
            store = request.state is LlmRequestState.GENERATION_COMPLETE
            self.resource_manager.free_resources(request, store_for_reuse=store)
            self.sampler.release(request)
        self.active_requests = [r for r in self.active_requests if not r.is_finished]

    def _respond(self, request: LlmRequest, response: Response) -> None:
        callback = self._callbacks.get(request.request_id)
        if response.finished:
            self._callbacks.pop(request.request_id, None)
        if callback is not None:
            callback(request, response)

    def _record(self, stats: IterationStats, scheduled: ScheduledRequests, prepared: PreparedBatch | None) -> None:
        batch = prepared.scheduled if prepared is not None else scheduled
        stats.end_time = self.clock()
        stats.num_active_requests = len(self.active_requests)
        stats.num_context_requests = len(batch.context_chunks)
        stats.num_generation_requests = len(batch.generation_requests)
        stats.num_paused_requests = len(scheduled.paused_requests)
        stats.scheduled_tokens = scheduled.scheduled_tokens
        if prepared is None:
            self._publish(stats)
            return
        for deferral in prepared.deferred:
            if deferral.reason is DeferReason.BUDGET:
                stats.num_budget_deferrals += 1
                stats.budget_deferred_tokens += deferral.cost
            else:
                stats.num_capacity_deferrals += 1
        if prepared.budget is not None:
            stats.num_budget_cuts = len(prepared.budget.cut)
        for claim in prepared.claims:
            stats.reuse_estimated_tokens += claim.estimated_reusable_tokens
            stats.reuse_claimed_tokens += claim.reused_tokens
            stats.reuse_query_tokens += claim.request.prompt_len
        self._publish(stats)

    def _publish(self, stats: IterationStats) -> None:
        self.iteration_stats.append(stats)
        for listener in self._iteration_listeners:
            try:
                listener(stats)
            except Exception:  # statistics must never stop the loop
                logger.exception("iteration listener %r failed", listener)
