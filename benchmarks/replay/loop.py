"""One policy's replay: a fresh executor, arrivals injected on its clock, metrics out.

The loop, per iteration: move arrived requests from the trace to the executor (through the
admission window, see :func:`replay_policy`), jump the clock to the next arrival when the
executor is idle, step, and diagnose any overshoot. Finished requests leave only numbers
behind (:class:`_Outcomes`); prompts live only inside the executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import sys
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from benchmarks.replay.diagnosis import MECHANISMS, Overshoot, diagnose_overshoot
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.traces import Trace
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.priority import priority_class
from tensorrt_llm._torch.pyexecutor.py_executor import Iteration, Response

# A replay whose executor runs this many iterations in a row without a forward and without
# an arrival to wait for is stuck (a scheduling bug); fail loudly instead of spinning.
_MAX_IDLE_STEPS = 10_000


class Progress:
    """``label [#####.....] done/total`` on stderr, redrawn at most 5 times a second.

    On a terminal it redraws in place; otherwise it prints one line when the run ends.
    """

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream=None) -> None:
        self.label, self.total = label, max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and getattr(self.stream, "isatty", lambda: False)()
        self._last = 0.0
        self._t0 = time.perf_counter()

    def update(self, done: int, force: bool = False) -> None:
        if not self.live:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label:>8} [{bar}] {done}/{self.total} requests {now - self._t0:6.1f} s")
        self.stream.flush()

    def close(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.live:
            self.update(done, force=True)
            self.stream.write(f" {note}\n")
        else:
            self.stream.write(f"{self.label:>8}: {done}/{self.total} requests in {time.perf_counter() - self._t0:.1f} s {note}\n")
        self.stream.flush()


@dataclass(slots=True)
class PolicyRun:
    """What one policy's replay produced: the §5 metrics and the series the plot draws."""

    policy: str
    metrics: dict
    iteration_time_s: array = field(default_factory=lambda: array("d"))  # end time of each forward that ran
    iteration_tokens: array = field(default_factory=lambda: array("i"))  # its positions
    overshoot_time_s: array = field(default_factory=lambda: array("d"))
    overshoot_tokens: array = field(default_factory=lambda: array("i"))
    ttft_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ReplayResult:
    config: dict
    runs: dict[str, PolicyRun]
    trace_notes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"config": self.config, "results": {name: run.metrics for name, run in self.runs.items()}}


def _error_kind(request: LlmRequest, response: Response) -> str:
    """Why a request did not complete, with its numbers (request id, lengths) as N so that the
    same failure of many requests counts once."""
    if request.is_cancelled:
        return "cancelled"
    if response.error is None:
        return request.state.name
    return re.sub(r"\d+", "N", str(response.error))


class _Outcomes:
    """Per-request outcomes, filled from final responses; no request object is kept."""

    def __init__(self, num_requests: int) -> None:
        self.arrival = array("d", [0.0]) * num_requests
        self.first_token = array("d", [math.nan]) * num_requests
        self.finish = array("d", [math.nan]) * num_requests
        self.outputs = array("i", [0]) * num_requests
        self.status = bytearray(num_requests)  # 0 open, 1 completed, 2 errored
        self.max_consecutive_deferrals = 0
        self.deferrals = 0
        self.capacity_deferrals = 0
        self.completed = 0
        self.errored = 0
        self.error_of: dict[int, str] = {}  # an errored request's slot -> why it failed (_error_kind)
        self.output_tokens = 0
        self.in_context = 0  # injected requests that have had no response yet (still in their prompt)
        self._silent = bytearray(num_requests)
        # priority preemption, per request: times preempted, prompt positions recomputed after
        # a preemption, and those onboarded from the host tier instead
        self.preemptions = array("i", [0]) * num_requests
        self.recomputed = array("q", [0]) * num_requests
        self.onboarded = array("q", [0]) * num_requests

    def injected(self, slot: int) -> None:
        self.in_context += 1
        self._silent[slot] = 1

    def on_response(self, slot: int) -> Callable[[LlmRequest, Response], None]:
        def record(request: LlmRequest, response: Response) -> None:
            if self._silent[slot]:
                self._silent[slot] = 0
                self.in_context -= 1
            if not response.finished:
                return
            if request.first_token_time is not None:
                self.first_token[slot] = request.first_token_time
            self.finish[slot] = request.finish_time if request.finish_time is not None else math.nan
            self.outputs[slot] = request.num_generated_tokens
            self.max_consecutive_deferrals = max(self.max_consecutive_deferrals, request.counters.max_consecutive_budget_deferrals)
            self.deferrals += request.counters.budget_deferrals
            self.capacity_deferrals += request.counters.capacity_deferrals
            self.preemptions[slot] = request.counters.preemptions
            self.recomputed[slot] = request.counters.recomputed_tokens
            self.onboarded[slot] = request.counters.onboarded_tokens
            if request.state is LlmRequestState.GENERATION_COMPLETE and not request.is_cancelled:
                self.status[slot] = 1
                self.completed += 1
                self.output_tokens += request.num_generated_tokens
            else:
                self.status[slot] = 2
                self.errored += 1
                self.error_of[slot] = _error_kind(request, response)

        return record

    def hang(self, slot: int) -> None:
        """Undo a final error response: upstream never sends it."""
        if self.status[slot] == 2:
            self.status[slot] = 0
            self.errored -= 1
            del self.error_of[slot]


def replay_policy(
    trace: Trace,
    settings: ReplaySettings,
    policy: str,
    *,
    max_seq_len: int | None = None,
    progress: bool = True,
    stop_at_crash: bool = True,
    admission_window: int | None = None,
    priorities: Sequence[float] | None = None,
) -> PolicyRun:
    """Replay ``trace`` on a fresh executor under ``policy``; ``none`` stops at its first overshoot.

    ``stop_at_crash=False`` lets ``none`` go on past overshoots the way the other policies
    do (for measuring how often the bug fires; not upstream's behaviour).

    ``admission_window``: arrived requests enter the executor only while fewer than this
    many injected requests are still in their prompt (no response yet); the rest wait,
    unmaterialised, in arrival order. This changes no decision: both schedulers take
    requests in arrival order, the micro-batch scheduler never looks past the first
    ``max_batch_size`` context requests and the capacity scheduler stops at the first
    waiting request that does not fit, so a request behind ``max_batch_size`` earlier
    context requests cannot be scheduled this iteration anyway. It bounds memory (and the
    executor's per-iteration scans) when a trace overloads the engine. Default:
    ``max_batch_size``, the smallest window that is exact; 0 disables it.

    ``priorities``: each request's priority, by trace position (``benchmarks.replay.priority``);
    the metrics then add ``priority_classes`` (per class: TTFT, longest wait, completions,
    preemptions, recomputed and onboarded tokens) and the window defaults to 0: it admits in
    arrival order, which is exact only under fcfs.
    """
    if admission_window is None:
        admission_window = settings.executor.max_batch_size if priorities is None else 0
    window = admission_window
    with _without_cyclic_gc():
        replay = _PolicyReplay(trace, settings, TokenBudgetPolicyName(policy).value, max_seq_len or settings.max_seq_len(trace),
                               priorities)
        bar = Progress(replay.policy, len(trace), enabled=progress)
        replay.run(window, stop_at_crash, bar)
        run = replay.result()
    crash = replay.crash
    bar.close(replay.outcomes.completed + replay.outcomes.errored,
              f"crashed at t={crash.time_s:.1f} s ({crash.mechanism})" if crash else f"{replay.outcomes.completed} completed")
    return run


@contextlib.contextmanager
def _without_cyclic_gc():
    """Run without the cyclic garbage collector, then collect once.

    Reference counting frees what a replay discards: the KV tree unlinks a block from its
    parent and children when it drops it, and a finished request leaves no cycle behind.
    Meanwhile every full collection walks the whole, ever-growing prefix tree: about a fifth
    of a Mooncake replay's time, for nothing (peak RSS is the same with or without it). The
    collection at the end frees the executor's own object graph.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


class _PolicyReplay:
    """The state of one policy's replay; :meth:`run` drives the executor, :meth:`result` sums up."""

    def __init__(self, trace: Trace, settings: ReplaySettings, policy: str, max_seq_len: int,
                 priorities: Sequence[float] | None = None) -> None:
        self.wall_t0 = time.perf_counter()
        self.priorities = priorities
        self.policy = policy
        self.settings = settings
        self.requests = trace.requests
        self.engine = settings.build_engine(policy, max_seq_len)
        self.executor, self.clock = self.engine.executor, self.engine.clock
        self.outcomes = _Outcomes(len(self.requests))
        for slot, r in enumerate(self.requests):
            self.outcomes.arrival[slot] = r.arrival_s
        self.overshoots: list[Overshoot] = []
        self.crash: Overshoot | None = None
        self.crash_message: str | None = None
        self.next_arrival = 0
        self.backlog: deque[int] = deque()  # arrived, not yet in the executor (trace positions)

    def run(self, window: int, stop_at_crash: bool, bar: Progress) -> None:
        executor, clock, requests = self.executor, self.clock, self.requests
        n = len(requests)
        idle_steps = 0
        while True:
            self._admit_arrivals(window)
            if not executor.has_work:
                if self.next_arrival >= n:
                    return
                clock.advance_to(requests[self.next_arrival].arrival_s)
                continue
            iteration = executor.step()
            bar.update(self.outcomes.completed + self.outcomes.errored)
            if iteration is None:
                continue
            launch = iteration.launch  # what is known at once, with or without overlap
            if launch.overshoot > 0 and self._overshot(iteration, stop_at_crash):
                return
            if launch.forward_tokens and not launch.overshoot:
                idle_steps = 0
                continue
            idle_steps += 1
            if idle_steps > _MAX_IDLE_STEPS:
                if self.next_arrival >= n:
                    raise RuntimeError(f"{self.policy}: no forward in {_MAX_IDLE_STEPS} iterations; "
                                       f"active {executor.active_requests[:5]}")
                clock.advance_to(requests[self.next_arrival].arrival_s)
                idle_steps = 0

    def _admit_arrivals(self, window: int) -> None:
        """Arrivals up to now join the backlog; the backlog enters the executor through the window."""
        requests, now, outcomes = self.requests, self.clock(), self.outcomes
        while self.next_arrival < len(requests) and requests[self.next_arrival].arrival_s <= now:
            self.backlog.append(self.next_arrival)
            self.next_arrival += 1
        while self.backlog and (not window or outcomes.in_context < window):
            slot = self.backlog.popleft()
            r = requests[slot]
            # The prompt is materialised only now, and only the executor holds it.
            request = LlmRequest(
                input_token_ids=r.prompt_token_ids(), max_new_tokens=r.output_len, request_id=slot, arrival_time=r.arrival_s,
                beam_width=self.settings.beam_width_of(slot),
                priority=self.priorities[slot] if self.priorities is not None else DEFAULT_PRIORITY,
            )
            outcomes.injected(slot)
            self.executor.enqueue_request(request, outcomes.on_response(slot))

    def _overshot(self, iteration: Iteration, stop_at_crash: bool) -> bool:
        """Record an overshooting iteration; True when the replay stops here (``none``: upstream crashes)."""
        executor, launch = self.executor, iteration.launch
        event = diagnose_overshoot(
            iteration.batch, iteration.scheduled.charges, iteration.prepared.claims, self.settings.executor.kv_cache_config.tokens_per_block,
            iteration=launch.iteration, time_s=launch.start_time, forward_tokens=launch.forward_tokens,
            overshoot=launch.overshoot,
        )
        self.overshoots.append(event)
        if not (stop_at_crash and self.policy == TokenBudgetPolicyName.NONE.value):
            return False
        self.crash, self.crash_message = event, iteration.error
        # Upstream's assertion kills the executor thread: the failing batch gets no response
        # at all (here the loop failed it), so it is unserved, not errored.
        for request in iteration.batch.all_requests:
            self.outcomes.hang(request.request_id)
        # In-flight requests report what they had so far (their deferrals count too).
        for request in executor.active_requests:
            self.outcomes.deferrals += request.counters.budget_deferrals
            self.outcomes.max_consecutive_deferrals = max(
                self.outcomes.max_consecutive_deferrals, request.counters.max_consecutive_budget_deferrals
            )
        return True

    def result(self) -> PolicyRun:
        """The §5 metrics (and extras) and the plot's series; drops the executor."""
        end_time = self.clock()
        run = PolicyRun(self.policy, {})
        forward_sum = busy = max_forward = bound_sum = bound = cuts = 0
        for stats in self.executor.iteration_stats:
            cuts += stats.num_budget_cuts
            if stats.overshoot > 0:
                run.overshoot_time_s.append(stats.start_time)
                run.overshoot_tokens.append(stats.forward_tokens)
            elif stats.forward_tokens > 0:
                busy += 1
                forward_sum += stats.forward_tokens
                run.iteration_time_s.append(stats.end_time)
                run.iteration_tokens.append(stats.forward_tokens)
                if stats.budget_bound:
                    bound += 1
                    bound_sum += stats.forward_tokens
            max_forward = max(max_forward, stats.forward_tokens)
        self.engine = self.executor = None  # the KV tree and every in-flight prompt go now

        o, n = self.outcomes, len(self.requests)
        ttft = [(o.first_token[i] - o.arrival[i]) * 1e3 for i in range(n) if not math.isnan(o.first_token[i])]
        tpot = [
            (o.finish[i] - o.first_token[i]) * 1e3 / (o.outputs[i] - 1)
            for i in range(n)
            if o.status[i] == 1 and o.outputs[i] > 1
        ]
        makespan = end_time - (self.requests[0].arrival_s if n else 0.0)
        mechanisms = dict.fromkeys(MECHANISMS, 0)
        for event in self.overshoots:
            mechanisms[event.mechanism] += 1
        crash = self.crash
        run.ttft_ms = ttft
        run.metrics = {
            "requests": n,
            "completed": o.completed,
            "errored": o.errored,
            "crashed": crash is not None,
            "crash": None if crash is None else {
                "iteration": crash.iteration,
                "message": self.crash_message,
                "time_s": crash.time_s,
                "overshoot": crash.overshoot,
                "mechanism": crash.mechanism,
                "detail": crash.describe(),
            },
            "overshoots": len(self.overshoots),
            "max_forward_tokens": max_forward,
            "deferrals": o.deferrals,
            "max_consecutive_deferrals": o.max_consecutive_deferrals,
            "budget_utilization": forward_sum / busy / self.settings.executor.max_num_tokens if busy else 0.0,
            # docs/design.md §5: over the busy iterations after which some active request still had
            # prompt tokens to compute (the budget, not the traffic, was the limit)
            "budget_utilization_when_bound": bound_sum / bound / self.settings.executor.max_num_tokens if bound else 0.0,
            "iterations": busy,
            "ttft_ms": percentiles(ttft),
            "tpot_ms": percentiles(tpot),
            "output_tokens_per_s": o.output_tokens / makespan if makespan > 0 else 0.0,
            "wall_s": time.perf_counter() - self.wall_t0,
            # Extras beyond docs/design.md §5.
            "unserved": n - o.completed - o.errored,
            "errors": dict(Counter(o.error_of.values()).most_common(10)),  # the errored requests' messages, most frequent first
            "overshoot_mechanisms": mechanisms,
            "overshoot_events": [_event_json(event) for event in self.overshoots[:20]],
            "capacity_deferrals": o.capacity_deferrals,
            "budget_cuts": cuts,  # first chunks the re-check admitted smaller than scheduled
            "output_tokens": o.output_tokens,
            "makespan_s": makespan,
            "bound_iterations": bound,
        }
        if self.priorities is not None:
            run.metrics["priority_classes"] = self._by_class(ttft_of=lambda i: (o.first_token[i] - o.arrival[i]) * 1e3)
        return run

    def _by_class(self, ttft_of: Callable[[int], float]) -> dict:
        """Per priority class (``priority.priority_class`` with the executor's class bounds)."""
        o = self.outcomes
        scheduling = self.settings.executor.scheduler_config
        slots: dict[str, list[int]] = {}
        for slot, value in enumerate(self.priorities):
            slots.setdefault(priority_class(value, scheduling), []).append(slot)
        classes = {}
        for name, members in sorted(slots.items()):
            ttft = [ttft_of(i) for i in members if not math.isnan(o.first_token[i])]
            classes[name] = {
                "requests": len(members),
                "completed": sum(o.status[i] == 1 for i in members),
                "ttft_ms": percentiles(ttft),
                "longest_wait_ms": max(ttft, default=0.0),  # arrival to first token, the worst of the class
                "output_tokens": sum(o.outputs[i] for i in members if o.status[i] == 1),
                "preemptions": sum(o.preemptions[i] for i in members),
                "preempted_requests": sum(o.preemptions[i] > 0 for i in members),
                "recomputed_tokens": sum(o.recomputed[i] for i in members),
                "onboarded_tokens": sum(o.onboarded[i] for i in members),
            }
        return classes


def percentiles(values: Sequence[float]) -> dict:
    """p50 and p99 (linear interpolation); 0.0 with ``n == 0`` when there is nothing to measure."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "n": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))

    return {"p50": q(0.50), "p99": q(0.99), "n": len(ordered)}


def _event_json(event: Overshoot) -> dict:
    """An overshoot as JSON; ``step`` only where a generation step was blamed."""
    fields = dataclasses.asdict(event)
    if fields["step"] is None:
        del fields["step"]
    return fields
