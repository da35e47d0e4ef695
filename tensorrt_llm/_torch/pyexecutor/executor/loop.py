"""``ExecutorLoop``: the thread around the step — submission queue, cancellation, health, death.

The loop knows nothing of scheduling, KV memory or models. It owns a :class:`Stepper` (the
executor's iteration, ``PyExecutor``) and, between iterations, hands it what arrived::

    any thread                      the loop's thread (or a caller stepping by hand)
    ──────────                      ───────────────────────────────────────────────
    enqueue(requests) ─► queue ─┐
    cancel(request_id) ─► set ──┴─► step(): take both ─► stepper.step(arrivals, cancelled) ─► Iteration
                                    (waits while neither the queue nor the stepper has work)

Health is read from any thread: the loop's own facts (alive, shut down, died and why, when
it last showed progress) and the stepper's counters (:class:`StepCounts`), as one frozen
:class:`~executor_client.Health`.

The loop never dies on a batch (the stepper fails the batch and goes on); an exception
outside any batch fails what the stepper holds and the loop serves on. Should the thread die
all the same (upstream's failure mode; :meth:`kill_for_testing` reproduces it), every request
it held or had queued ends with an error, new ones are refused, and health says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence, TypeVar

from tensorrt_llm._torch.pyexecutor.errors import ExecutorLoopKilled, ExecutorShutdown
from tensorrt_llm._torch.pyexecutor.executor.client import Health
from tensorrt_llm._torch.pyexecutor.response import ResponseCallback
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

logger = logging.getLogger(__name__)

Arrival = tuple[LlmRequest, "ResponseCallback | None"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What the stepper has done, for :class:`~executor_client.Health`."""

    iterations: int
    active_requests: int
    failed_batches: int
    budget_violations: int
    last_error: str | None


class Stepper(Protocol):
    """One executor iteration at a time, always on one thread (the loop's, or a replay's)."""

    @property
    def busy(self) -> bool:
        """Requests active, a forward in flight, or finished requests still to free."""

    def step(self, arrivals: Sequence[Arrival], cancelled: Collection[int]) -> object:
        """Admit ``arrivals``, end ``cancelled``, run one iteration; returns what it did."""

    def recover(self, error: Exception) -> None:
        """An exception escaped a step outside any batch: fail what is active, serve on."""

    def fail_all(self, error: Exception, queued: Sequence[Arrival]) -> None:
        """End every request held (and ``queued``, never admitted) with ``error``."""

    def close(self) -> None:
        """Complete what is in flight (the loop has stopped)."""

    def counts(self) -> StepCounts: ...


class ExecutorLoop:
    """Drives a :class:`Stepper` on a background thread (:meth:`start`), or by hand (:meth:`step`)."""

    def __init__(self, stepper: Stepper, *, health_check_timeout_s: float, name: str = "PyExecutor") -> None:
        self.stepper = stepper
        self.health_check_timeout_s = health_check_timeout_s
        self.name = name
        self._queue: deque[Arrival] = deque()
        self._cancelled: set[int] = set()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # run between two steps
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._shutdown = False
        self._kill_requested = False
        self._error: str | None = None  # why the thread died, if it did
        # When the loop last showed progress (wall clock, whatever clock the stepper keeps).
        self._heartbeat = time.monotonic()

    # ---- any thread -----------------------------------------------------------------
    def enqueue(self, requests: Sequence[Arrival]) -> None:
        """Queue requests under one lock: the next step takes them all. Raises ExecutorShutdown
        once the loop is shut down or dead."""
        with self._wakeup:
            if self._shutdown:
                raise ExecutorShutdown("the executor is shut down")
            if self._error is not None:
                raise ExecutorShutdown(f"the executor loop died: {self._error}")
            if not self.has_work:  # a stall is timed from when work arrives, not from the last idle iteration
                self._heartbeat = time.monotonic()
            self._queue.extend(requests)
            self._wakeup.notify()

    def cancel(self, request_id: int) -> None:
        with self._wakeup:
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def call_between_steps(self, call: Callable[[], T]) -> "Future[T]":
        """Run ``call`` on the loop's thread before its next step (the state it reads is the
        stepper's, which only that thread touches); its result, or what it raised, in the
        future. Raises ExecutorShutdown once the loop is shut down or dead."""
        future: Future[T] = Future()
        with self._wakeup:
            if self._shutdown or self._error is not None:
                raise ExecutorShutdown(f"the executor loop died: {self._error}" if self._error
                                       else "the executor is shut down")
            self._calls.append((call, future))
            self._wakeup.notify()
        return future

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._cancelled or self._calls or self.stepper.busy)

    @property
    def running(self) -> bool:
        """Whether the loop's own thread is stepping (:meth:`start`), not a caller by hand."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def health(self) -> Health:
        """Unhealthy once the loop has died or shut down, or while it has work and has not
        finished an iteration for ``health_check_timeout_s``; failed batches do not count."""
        alive = self._thread is None or self._thread.is_alive()
        stalled_s = time.monotonic() - self._heartbeat if self.has_work else 0.0
        reason = None
        if self._error is not None:
            reason = f"the executor loop died: {self._error}"
        elif self._shutdown:
            reason = "the executor is shut down"
        elif not alive:
            reason = "the executor loop thread is not running"
        elif stalled_s > self.health_check_timeout_s:
            reason = (
                f"the executor loop has not finished an iteration for {stalled_s:.1f} s while it has work"
                f" (health_check_timeout_s={self.health_check_timeout_s:g})"
            )
        counts = self.stepper.counts()
        return Health(
            healthy=reason is None,
            reason=reason,
            alive=alive,
            seconds_since_progress=round(stalled_s, 3),
            iterations=counts.iterations,
            active_requests=counts.active_requests,
            queued_requests=len(self._queue),
            failed_batches=counts.failed_batches,
            budget_violations=counts.budget_violations,
            last_error=counts.last_error,
        )

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; what is unfinished (held or queued) ends with ExecutorShutdown."""
        with self._wakeup:
            self._shutdown = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        with self._wakeup:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            future.set_exception(ExecutorShutdown("the executor shut down before the call ran"))
        self.stepper.close()
        self.stepper.fail_all(ExecutorShutdown("the executor shut down before the request finished"), self._take()[0])

    def kill_for_testing(self) -> None:
        """Test hook: the thread dies at its next iteration, as upstream's did on its assertion."""
        with self._wakeup:
            self._kill_requested = True
            self._wakeup.notify()

    # ---- the loop's thread -----------------------------------------------------------
    def step(self):
        """Run the calls waiting, hand the stepper what arrived and run one iteration (the
        thread calls this too)."""
        while self._calls:
            with self._wakeup:
                call, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except Exception as error:  # the caller gets it; the loop goes on
                    future.set_exception(error)
        arrivals, cancelled = self._take()
        return self.stepper.step(arrivals, cancelled)

    def _take(self) -> tuple[list[Arrival], set[int]]:
        with self._wakeup:
            arrivals = list(self._queue)
            self._queue.clear()
            cancelled, self._cancelled = self._cancelled, set()
        return arrivals, cancelled

    def _run(self) -> None:
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
                self.stepper.recover(error)
            self._heartbeat = time.monotonic()

    def _die(self, error: BaseException) -> None:
        """Every request the dead loop held or had queued ends with an error; later ones are refused."""
        with self._wakeup:
            self._error = f"{type(error).__name__}: {error}"
            queued = list(self._queue)
            self._queue.clear()
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            future.set_exception(ExecutorShutdown(f"the executor loop died: {self._error}"))
        self.stepper.fail_all(ExecutorShutdown(f"the executor loop died: {self._error}"), queued)
