"""Replay a request trace through the executor under each token-budget policy.

    python -m benchmarks.replay [--trace FILE] [--format auto|mooncake|azure|trtllm] \
        [--policies none,trim,fit,recheck] [--engine sim|torch] [--max-num-tokens N] \
        [--num-requests N] [--seed S] [--json OUT.json] [--plot OUT.png] ...

Every policy replays the same trace from scratch on a fresh executor. Requests enter the
executor at their trace timestamps on the engine's clock (virtual for ``sim``); when the
executor is idle the clock jumps to the next arrival. A request asks for exactly its
trace output length (the synthetic sampler never stops early).

``none`` is upstream before any fix: at the first forward whose positions exceed
``max_num_tokens`` the replay stops, as upstream's assertion stops the executor thread,
and reports the crash, the overshoot mechanism that fired (DESIGN.md §1) and how many
requests were left unserved. The other policies go on past an overshoot: the executor
fails that batch with ``TokenBudgetExceeded`` and serves everyone else.

Without ``--trace`` the built-in default scenario is replayed (``benchmarks.scenario``),
under defaults tuned so that ``none`` crashes early on every seed while ``recheck``
completes every request.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.cost_model import ModelShape, default_cost_model
from benchmarks.scenario import ScenarioConfig, default_scenario
from benchmarks.sim_engine import ENGINES, Engine, build_sim_engine, build_torch_engine, torch_vocab_size
from benchmarks.traces import DEFAULT_VOCAB_SIZE, Trace, load_trace
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    ExecutorConfig,
    KvCacheConfig,
    TokenBudgetPolicyName,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import ClaimRecord
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.py_executor import Response
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

POLICIES = ("none", "trim", "fit", "recheck")  # DESIGN.md §5; the default set
KNOWN_POLICIES = tuple(p.value for p in TokenBudgetPolicyName)  # also later work, e.g. "claim"
# The default scenario's length in the replay: 100 s of arrivals at 7 req/s. The bug is a
# rare coincidence (~2-3 overshoots per 100 s of this traffic under the default settings),
# so the replay runs long enough for ``none`` to hit it on every seed tried.
DEFAULT_SCENARIO_REQUESTS = 700
MECHANISMS = ("whole_prompt_hit", "evicted_discount", "other")
# A replay whose executor runs this many iterations in a row without a forward and without
# an arrival to wait for is stuck (a scheduling bug); fail loudly instead of spinning.
_MAX_IDLE_STEPS = 10_000


# ---------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """Every executor and KV setting a replay uses; one executor per policy is built from it.

    The defaults are the default scenario's: upstream's reproduction setting
    (``max_num_tokens=4096``, chunked prefill, block reuse, partial reuse, a host tier) with
    a device pool of 1,280 blocks of 32 tokens (40,960 tokens, 6.25 GiB of KV at 160 KiB a
    token: about nine of the scenario's ~4.4k-token prompts) and a host tier of 512 blocks
    (2.5 GiB), small enough that the prefix counted at admission is regularly evicted (or
    dropped from the host) before it is claimed. See README.md, "Replay".
    """

    engine: str = "sim"
    model: str = "tiny-random"  # torch engine only
    max_num_tokens: int = 4096
    max_batch_size: int = 64
    tokens_per_block: int = 32
    kv_blocks: int = 1280
    host_cache_blocks: int = 512
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    enable_chunked_prefill: bool = True
    capacity_scheduler_policy: str = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT.value
    context_chunking_policy: str = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED.value

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}")
        for name in ("max_num_tokens", "max_batch_size", "tokens_per_block", "kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.host_cache_blocks, bool) or not isinstance(self.host_cache_blocks, int) or self.host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be an int >= 0, got {self.host_cache_blocks!r}")

    def executor_config(self, policy: str, *, max_seq_len: int, kv_bytes_per_token: int) -> ExecutorConfig:
        host_bytes = self.host_cache_blocks * self.tokens_per_block * kv_bytes_per_token
        kv = KvCacheConfig(
            tokens_per_block=self.tokens_per_block,
            num_blocks=self.kv_blocks,
            enable_block_reuse=self.enable_block_reuse,
            enable_partial_reuse=self.enable_partial_reuse,
            host_cache_size=host_bytes,
        )
        return ExecutorConfig(
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            max_seq_len=max_seq_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            context_chunking_policy=self.context_chunking_policy,
            capacity_scheduler_policy=self.capacity_scheduler_policy,
            token_budget_policy=policy,
            kv_cache_config=kv,
        )

    @property
    def vocab_size(self) -> int:
        """Token ids the engine accepts: the torch model's vocabulary, or the trace default."""
        return torch_vocab_size(self.model) if self.engine == "torch" else DEFAULT_VOCAB_SIZE

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        if self.engine == "torch":
            from benchmarks.sim_engine import torch_kv_bytes_per_token

            config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=torch_kv_bytes_per_token(self.model))
            return build_torch_engine(config, model_name=self.model)
        shape = ModelShape()
        config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=shape.kv_bytes_per_token())
        return build_sim_engine(config, cost_model=_cost_model(), model_shape=shape, vocab_size=self.vocab_size)


_COST_MODEL = None


def _cost_model():
    """The default cost model, built once per process (a fit to a table is not free)."""
    global _COST_MODEL
    if _COST_MODEL is None:
        _COST_MODEL = default_cost_model()
    return _COST_MODEL


def max_seq_len_for(trace: Trace) -> int:
    """Room for the longest prompt plus its whole output."""
    return max((r.input_len + r.output_len for r in trace.requests), default=1)


# ---------------------------------------------------------------------------------------
# Overshoot diagnosis
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overshoot:
    """One forward that went past ``max_num_tokens``, and which §1 mechanism caused it.

    ``request_id`` is the request whose positions exceeded its admission charge the most;
    ``estimated``/``claimed`` are that request's reuse estimate at admission and what its
    allocation actually claimed (None when it was not a first chunk).
    """

    iteration: int
    time_s: float
    forward_tokens: int
    overshoot: int
    mechanism: str
    request_id: int | None = None
    prompt_len: int | None = None
    charged: int | None = None
    ran: int | None = None
    estimated: int | None = None
    claimed: int | None = None

    def describe(self) -> str:
        where = f"iteration {self.iteration} at t={self.time_s:.2f} s: {self.forward_tokens} positions (+{self.overshoot})"
        if self.request_id is None:
            return f"{where}, mechanism {self.mechanism}"
        return (
            f"{where}, mechanism {self.mechanism}: request {self.request_id} (prompt {self.prompt_len}) was charged "
            f"{self.charged} and ran {self.ran}; reuse estimated {self.estimated}, claimed {self.claimed}"
        )


def classify_claim(prompt_len: int, claim: ClaimRecord, tokens_per_block: int) -> str:
    """Which DESIGN.md §1 mechanism a first chunk's shortfall of reuse is.

    ``whole_prompt_hit``: a block-aligned prompt estimated fully reusable, whose claim went
    as far as a claim can (``(prompt_len - 1) // tpb * tpb``: the last token is always
    computed) with nothing evicted, so its last block was recomputed.
    ``evicted_discount``: the claim stopped short of full blocks that were counted at
    admission: they were evicted (or onboarding failed) before this request allocated.
    """
    limit = (prompt_len - 1) // tokens_per_block * tokens_per_block
    estimate, reused = claim.estimated_reusable_tokens, claim.reused_tokens
    if estimate >= prompt_len and prompt_len % tokens_per_block == 0 and limit <= reused < prompt_len - 1:
        return "whole_prompt_hit"
    if reused < min(estimate, limit):
        return "evicted_discount"
    return "other"


def diagnose_overshoot(
    scheduled: ScheduledRequests, claims: Sequence[ClaimRecord], tokens_per_block: int, *, iteration: int,
    time_s: float, forward_tokens: int, overshoot: int,
) -> Overshoot:
    """Blame the request of the failing batch whose chunk ran furthest past its admission charge.

    Read right after the failing step: the batch's requests keep their chunk bookkeeping
    (the failure only sets their error), and ``claims`` are the first chunks that batch
    allocated, with the reuse each was admitted with and the reuse it got.
    """
    by_id = {claim.request_id: claim for claim in claims}
    worst: tuple[int, LlmRequest] | None = None
    for request in scheduled.context_requests:
        ran = min(request.context_chunk_size, request.prompt_len - request.context_current_position)
        excess = ran - scheduled.charges.get(request.request_id, ran)
        if worst is None or excess > worst[0]:
            worst = (excess, request)
    base = dict(iteration=iteration, time_s=time_s, forward_tokens=forward_tokens, overshoot=overshoot)
    if worst is None or worst[0] <= 0:
        return Overshoot(mechanism="other", **base)
    excess, request = worst
    claim = by_id.get(request.request_id)
    ran = min(request.context_chunk_size, request.prompt_len - request.context_current_position)
    mechanism = classify_claim(request.prompt_len, claim, tokens_per_block) if claim else "other"
    return Overshoot(
        mechanism=mechanism,
        request_id=request.request_id,
        prompt_len=request.prompt_len,
        charged=scheduled.charges.get(request.request_id),
        ran=ran,
        estimated=claim.estimated_reusable_tokens if claim else None,
        claimed=claim.reused_tokens if claim else None,
        **base,
    )


# ---------------------------------------------------------------------------------------
# One policy
# ---------------------------------------------------------------------------------------


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
        self.output_tokens = 0
        self.in_context = 0  # injected requests that have had no response yet (still in their prompt)
        self._silent = bytearray(num_requests)

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
            self.max_consecutive_deferrals = max(self.max_consecutive_deferrals, request.max_consecutive_budget_deferrals)
            self.deferrals += request.num_budget_deferrals
            self.capacity_deferrals += request.num_capacity_deferrals
            if request.state is LlmRequestState.GENERATION_COMPLETE and not request.is_cancelled:
                self.status[slot] = 1
                self.completed += 1
                self.output_tokens += request.num_generated_tokens
            else:
                self.status[slot] = 2
                self.errored += 1

        return record

    def hang(self, slot: int) -> None:
        """Undo a final error response: upstream never sends it."""
        if self.status[slot] == 2:
            self.status[slot] = 0
            self.errored -= 1


def replay_policy(
    trace: Trace,
    settings: ReplaySettings,
    policy: str,
    *,
    max_seq_len: int | None = None,
    progress: bool = True,
    stop_at_crash: bool = True,
    admission_window: int | None = None,
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
    """
    policy = TokenBudgetPolicyName(policy).value
    wall_t0 = time.perf_counter()
    max_seq_len = max_seq_len or max_seq_len_for(trace)
    engine = settings.build_engine(policy, max_seq_len)
    executor, clock = engine.executor, engine.clock
    kv = executor.kv_cache_manager
    tpb = settings.tokens_per_block
    requests = trace.requests
    n = len(requests)
    outcomes = _Outcomes(n)
    for slot, r in enumerate(requests):
        outcomes.arrival[slot] = r.arrival_s
    bar = Progress(policy, n, enabled=progress)

    window = settings.max_batch_size if admission_window is None else admission_window
    overshoots: list[Overshoot] = []
    crash: Overshoot | None = None
    crash_message: str | None = None
    next_arrival = 0
    backlog: deque[int] = deque()  # arrived, not yet in the executor (trace positions)
    idle_steps = 0
    while True:
        now = clock()
        while next_arrival < n and requests[next_arrival].arrival_s <= now:
            backlog.append(next_arrival)
            next_arrival += 1
        while backlog and (not window or outcomes.in_context < window):
            slot = backlog.popleft()
            r = requests[slot]
            # The prompt is materialised only now, and only the executor holds it.
            request = LlmRequest(
                input_token_ids=r.prompt_token_ids(),
                max_new_tokens=r.output_len,
                request_id=slot,
                arrival_time=r.arrival_s,
            )
            outcomes.injected(slot)
            executor.enqueue_request(request, outcomes.on_response(slot))
        if not executor.has_work:
            if next_arrival >= n:
                break
            clock.advance_to(requests[next_arrival].arrival_s)
            continue
        stats = executor.step()
        bar.update(outcomes.completed + outcomes.errored)
        if stats is None:
            continue
        if stats.overshoot > 0:
            event = diagnose_overshoot(
                executor.last_scheduled, kv.last_claims, tpb, iteration=stats.iteration, time_s=stats.start_time,
                forward_tokens=stats.forward_tokens, overshoot=stats.overshoot,
            )
            overshoots.append(event)
            if stop_at_crash and policy == TokenBudgetPolicyName.NONE.value:
                crash = event
                crash_message = stats.error
                # Upstream's assertion kills the executor thread: the failing batch gets no
                # response at all (here the loop failed it), so it is unserved, not errored.
                for request in executor.last_scheduled.all_requests:
                    outcomes.hang(request.request_id)
                break
        if stats.forward_tokens == 0 or stats.overshoot > 0:
            idle_steps += 1
            if idle_steps > _MAX_IDLE_STEPS:
                if next_arrival < n:
                    clock.advance_to(requests[next_arrival].arrival_s)
                    idle_steps = 0
                    continue
                raise RuntimeError(f"{policy}: no forward in {_MAX_IDLE_STEPS} iterations; active {executor.active_requests[:5]}")
        else:
            idle_steps = 0

    end_time = clock()
    run = PolicyRun(policy, {})
    forward_sum = 0
    busy = 0
    max_forward = 0
    for stats in executor.iteration_stats:
        if stats.overshoot > 0:
            run.overshoot_time_s.append(stats.start_time)
            run.overshoot_tokens.append(stats.forward_tokens)
            max_forward = max(max_forward, stats.forward_tokens)
            continue
        if stats.forward_tokens > 0:
            busy += 1
            forward_sum += stats.forward_tokens
            max_forward = max(max_forward, stats.forward_tokens)
            run.iteration_time_s.append(stats.end_time)
            run.iteration_tokens.append(stats.forward_tokens)
    # In-flight requests at a crash report what they had so far (their deferrals count too).
    if crash is not None:
        for request in executor.active_requests:
            outcomes.deferrals += request.num_budget_deferrals
            outcomes.max_consecutive_deferrals = max(
                outcomes.max_consecutive_deferrals, request.max_consecutive_budget_deferrals
            )
    del engine, executor, kv  # drop the KV tree and every in-flight prompt before the next policy

    ttft = [
        (outcomes.first_token[i] - outcomes.arrival[i]) * 1e3
        for i in range(n)
        if not math.isnan(outcomes.first_token[i])
    ]
    tpot = [
        (outcomes.finish[i] - outcomes.first_token[i]) * 1e3 / (outcomes.outputs[i] - 1)
        for i in range(n)
        if outcomes.status[i] == 1 and outcomes.outputs[i] > 1
    ]
    makespan = end_time - (requests[0].arrival_s if n else 0.0)
    mechanisms = dict.fromkeys(MECHANISMS, 0)
    for event in overshoots:
        mechanisms[event.mechanism] += 1
    run.ttft_ms = ttft
    run.metrics = {
        "requests": n,
        "completed": outcomes.completed,
        "errored": outcomes.errored,
        "crashed": crash is not None,
        "crash": None if crash is None else {
            "iteration": crash.iteration,
            "message": crash_message,
            "time_s": crash.time_s,
            "overshoot": crash.overshoot,
            "mechanism": crash.mechanism,
            "detail": crash.describe(),
        },
        "overshoots": len(overshoots),
        "max_forward_tokens": max_forward,
        "deferrals": outcomes.deferrals,
        "max_consecutive_deferrals": outcomes.max_consecutive_deferrals,
        "budget_utilization": forward_sum / busy / settings.max_num_tokens if busy else 0.0,
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "output_tokens_per_s": outcomes.output_tokens / makespan if makespan > 0 else 0.0,
        "wall_s": time.perf_counter() - wall_t0,
        # Extras beyond DESIGN.md §5.
        "unserved": n - outcomes.completed - outcomes.errored,
        "overshoot_mechanisms": mechanisms,
        "overshoot_events": [dataclasses.asdict(event) for event in overshoots[:20]],
        "capacity_deferrals": outcomes.capacity_deferrals,
        "output_tokens": outcomes.output_tokens,
        "makespan_s": makespan,
        "iterations": busy,
    }
    note = f"crashed at t={crash.time_s:.1f} s ({crash.mechanism})" if crash else f"{outcomes.completed} completed"
    bar.close(outcomes.completed + outcomes.errored, note)
    return run


def _percentiles(values: Sequence[float]) -> dict:
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


# ---------------------------------------------------------------------------------------
# The whole replay
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Where the requests come from and how they are re-timed."""

    path: str | None = None  # None: the built-in default scenario
    format: str = "auto"
    num_requests: int | None = None
    seed: int = 0
    qps: float | None = None
    time_scale: float = 1.0
    system_prompt_len: int = 0  # azure only

    def load(self, settings: ReplaySettings) -> Trace:
        vocab = settings.vocab_size
        if self.path is None:
            trace = default_scenario(ScenarioConfig(
                num_requests=self.num_requests or DEFAULT_SCENARIO_REQUESTS,
                seed=self.seed,
                tokens_per_block=settings.tokens_per_block,
                vocab_size=vocab,
            ))
        else:
            trace = load_trace(
                self.path, self.format, vocab_size=vocab, system_prompt_len=self.system_prompt_len, seed=self.seed,
                num_requests=self.num_requests,
            )
        if self.qps is not None:
            trace = trace.retimed(self.qps, self.seed)
        if self.time_scale != 1.0:
            trace = trace.scaled(self.time_scale)
        return trace


@dataclass(slots=True)
class ReplayResult:
    config: dict
    runs: dict[str, PolicyRun]
    trace_notes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"config": self.config, "results": {name: run.metrics for name, run in self.runs.items()}}


def describe_config(trace: Trace, spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str], engine: dict) -> dict:
    """Every setting the replay used, for the JSON's ``config``."""
    kv_bytes = engine["kv_bytes_per_token"]
    tpb = settings.tokens_per_block
    executor_config = settings.executor_config(policies[0], max_seq_len=max_seq_len_for(trace), kv_bytes_per_token=kv_bytes)
    gib = 1 << 30
    return {
        "trace": {
            "name": trace.name,
            "format": trace.format,
            "path": spec.path,
            "requests": len(trace),
            "notes": list(trace.notes),
            "requested_format": spec.format,
            "num_requests": spec.num_requests,
            "seed": spec.seed,
            "qps": spec.qps,
            "time_scale": spec.time_scale,
            "system_prompt_len": spec.system_prompt_len,
            "prompt_tokens": sum(r.input_len for r in trace.requests),
            "output_tokens": sum(r.output_len for r in trace.requests),
            "arrival_span_s": trace.requests[-1].arrival_s if len(trace) else 0.0,
        },
        "policies": list(policies),
        "engine": {k: v for k, v in engine.items() if k != "kv_bytes_per_token"},
        "executor": {
            "max_num_tokens": executor_config.max_num_tokens,
            "max_batch_size": executor_config.max_batch_size,
            "max_seq_len": executor_config.max_seq_len,
            "enable_chunked_prefill": executor_config.enable_chunked_prefill,
            "chunk_unit_size": executor_config.chunk_unit_size,
            "context_chunking_policy": executor_config.context_chunking_policy.value,
            "capacity_scheduler_policy": executor_config.capacity_scheduler_policy.value,
        },
        "kv_cache": {
            "tokens_per_block": tpb,
            "num_blocks": settings.kv_blocks,
            "num_tokens": settings.kv_blocks * tpb,
            "enable_block_reuse": settings.enable_block_reuse,
            "enable_partial_reuse": settings.enable_partial_reuse,
            "host_cache_blocks": settings.host_cache_blocks,
            "host_cache_size": executor_config.kv_cache_config.host_cache_size,
            "kv_bytes_per_token": kv_bytes,
            "device_pool_gib": settings.kv_blocks * tpb * kv_bytes / gib,
            "host_pool_gib": executor_config.kv_cache_config.host_cache_size / gib,
        },
    }


def run_replay(
    spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str] = POLICIES, *, progress: bool = True,
) -> ReplayResult:
    """Load the trace ``spec`` describes and replay it under each of ``policies``."""
    return replay_trace(spec.load(settings), settings, policies, spec=spec, progress=progress)


def replay_trace(
    trace: Trace,
    settings: ReplaySettings,
    policies: Sequence[str] = POLICIES,
    *,
    spec: TraceSpec | None = None,
    progress: bool = True,
) -> ReplayResult:
    """Replay an in-memory ``trace`` under each policy, each on a fresh executor."""
    if not len(trace):
        raise ValueError("the trace has no requests")
    if not policies:
        raise ValueError("no policy to replay")
    spec = spec or TraceSpec(path=None)
    max_seq_len = max_seq_len_for(trace)
    runs = {policy: replay_policy(trace, settings, policy, max_seq_len=max_seq_len, progress=progress) for policy in policies}
    probe = settings.build_engine(policies[0], max_seq_len)  # only to describe it; nothing runs on it
    engine = {**probe.description, "kv_bytes_per_token": probe.kv_bytes_per_token}
    del probe
    return ReplayResult(describe_config(trace, spec, settings, policies, engine), runs, trace.notes)


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in KNOWN_POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"policies must be a comma-separated subset of {','.join(KNOWN_POLICIES)}, got {text!r}")
    return list(dict.fromkeys(names))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = ReplaySettings()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.replay",
        description="Replay a request trace under each token-budget policy (DESIGN.md §5).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--trace", help="trace file; default: the built-in default scenario")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "azure", "trtllm"))
    p.add_argument("--policies", type=_policies, default=list(POLICIES), help="comma-separated subset of " + ",".join(KNOWN_POLICIES))
    p.add_argument("--engine", default=d.engine, choices=ENGINES)
    p.add_argument("--model", default=d.model, choices=sorted(MODEL_PRESETS), help="torch engine's model")
    p.add_argument("--max-num-tokens", type=_positive_int, default=d.max_num_tokens)
    p.add_argument("--num-requests", type=_positive_int, default=None, help="keep the first N requests")
    p.add_argument("--seed", type=int, default=0, help="scenario seed; Azure content seed; --qps arrival seed")
    p.add_argument("--json", metavar="OUT.json", help="write the results (DESIGN.md §5 schema)")
    p.add_argument("--plot", metavar="OUT.png", help="forward tokens per iteration and TTFT CDF per policy")
    p.add_argument("--kv-blocks", type=_positive_int, default=d.kv_blocks, help="device KV pool, in blocks")
    p.add_argument("--host-cache-blocks", type=_non_negative_int, default=d.host_cache_blocks,
                   help="host (offload) tier, in blocks; 0 disables it")
    p.add_argument("--tokens-per-block", type=_positive_int, default=d.tokens_per_block)
    p.add_argument("--max-batch-size", type=_positive_int, default=d.max_batch_size)
    p.add_argument("--enable-partial-reuse", action=argparse.BooleanOptionalAction, default=d.enable_partial_reuse)
    p.add_argument("--enable-block-reuse", action=argparse.BooleanOptionalAction, default=d.enable_block_reuse)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1 = more load)")
    p.add_argument("--qps", type=_positive_float, default=None, help="replace arrivals by Poisson arrivals at this rate")
    p.add_argument("--system-prompt-len", type=_non_negative_int, default=0,
                   help="azure: a shared synthetic system prompt of this many tokens")
    return p


def settings_from_args(args: argparse.Namespace) -> tuple[TraceSpec, ReplaySettings, list[str]]:
    settings = ReplaySettings(
        engine=args.engine,
        model=args.model,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=args.max_batch_size,
        tokens_per_block=args.tokens_per_block,
        kv_blocks=args.kv_blocks,
        host_cache_blocks=args.host_cache_blocks,
        enable_block_reuse=args.enable_block_reuse,
        enable_partial_reuse=args.enable_partial_reuse,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )
    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        raise SystemExit(f"--time-scale must be finite and >= 0, got {args.time_scale}")
    spec = TraceSpec(
        path=args.trace,
        format=args.format,
        num_requests=args.num_requests,
        seed=args.seed,
        qps=args.qps,
        time_scale=args.time_scale,
        system_prompt_len=args.system_prompt_len,
    )
    return spec, settings, args.policies


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks import replay_report

    args = build_parser().parse_args(argv)
    spec, settings, policies = settings_from_args(args)
    result = run_replay(spec, settings, policies)
    print(replay_report.format_report(result))
    if args.json:
        replay_report.write_json(result, Path(args.json))
    if args.plot:
        replay_report.plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
