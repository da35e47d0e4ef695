"""Host-side overhead of one executor iteration: scheduling, ``prepare_resources``, the re-check.

Runs the real executor (simulated engine, bookkeeping KV) with N long-running generation
requests plus a steady stream of context requests that share a prefix, so every iteration
has generation requests, later chunks and reuse-discounted first chunks for the re-check
to charge. The three phases are timed inside the real loop by wrapping the executor's own
objects (no copy of the iteration):

* ``schedule``  — ``SimpleScheduler.schedule_request`` (capacity + micro-batch),
* ``prepare``   — ``ResourceManager.prepare_resources`` (re-check + allocation),
* ``recheck``   — the re-check alone (the policy's ``before_allocation``), part of ``prepare``,
* ``step``      — the whole ``PyExecutor.step``: the above, the (simulated) forward's input
  building, sampling, the requests' update and stop rule, the KV commit, freeing finished
  requests. With the simulated engine every microsecond of it is host work.

``host_us_per_request`` is ``(schedule + prepare) / active``; ``step_us_per_request`` is
``step / active``. ``--clock cpu`` times with the thread's CPU clock instead of the wall clock:
on a machine shared with other work, time spent waiting for a core then counts for nothing.
``benchmarks.host_path.ab`` runs this file against other commits, alternated.

    python -m benchmarks.host_path.overhead [--active 16,64,256,1024] [--iterations 200] [--clock wall|cpu] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

# benchmarks.host_path.ab runs this file in earlier trees too: pyexecutor/ was flat before its
# sub-packages, and SyntheticSampler lived in simulated_engine before synthetic_sampler.
try:
    from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine
    from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
except ImportError:
    from tensorrt_llm._torch.pyexecutor.simulated_engine import SimulatedModelEngine

    try:
        from tensorrt_llm._torch.pyexecutor.synthetic_sampler import SyntheticSampler
    except ImportError:
        from tensorrt_llm._torch.pyexecutor.simulated_engine import SyntheticSampler

VOCAB = 32000
TOKENS_PER_BLOCK = 32
PROMPT_LEN = 512
SHARED_PREFIX = 384
NEW_PER_ITERATION = 2


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def _timed(samples: list[float], fn: Callable, clock: Callable[[], int] = time.perf_counter_ns) -> Callable:
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append((clock() - start) / 1e3)

    return wrapper


def _prompt(request_index: int) -> list[int]:
    shared = [1 + (i * 7919) % (VOCAB - 1) for i in range(SHARED_PREFIX)]
    own = [1 + (request_index * 104729 + i * 31) % (VOCAB - 1) for i in range(PROMPT_LEN - SHARED_PREFIX)]
    return shared + own


def _executor(num_active: int) -> PyExecutor:
    max_seq_len = PROMPT_LEN + 100_000
    config = ExecutorConfig(
        max_batch_size=num_active + 64,
        max_num_tokens=num_active + 2048,
        max_seq_len=max_seq_len,
        enable_chunked_prefill=True,
        token_budget_policy="recheck",
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK, num_blocks=(num_active + 128) * (max_seq_len // TOKENS_PER_BLOCK)
        ),
    )

    def engine(kv):
        return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB)

    return create_py_executor(config, engine_factory=engine, sampler=SyntheticSampler(VOCAB))


def measure(num_active: int, iterations: int, clock: str = "wall") -> dict:
    """Median microseconds per iteration of each phase with ``num_active`` requests in flight
    (``clock``: ``wall`` or ``cpu``, see the module docstring)."""
    now = CLOCKS[clock]
    executor = _executor(num_active)
    for i in range(num_active):  # long-running generation requests
        executor.enqueue_request(LlmRequest(_prompt(i), max_new_tokens=100_000))
    while any(r.is_context_init_state for r in executor.active_requests) or not executor.active_requests:
        executor.step()
    phases: dict[str, list[float]] = {"schedule": [], "prepare": [], "recheck": [], "step": []}
    executor.scheduler.schedule_request = _timed(phases["schedule"], executor.scheduler.schedule_request, now)
    executor.resource_manager.prepare_resources = _timed(
        phases["prepare"], executor.resource_manager.prepare_resources, now)
    policy = executor.resource_manager.token_budget
    policy.before_allocation = _timed(phases["recheck"], policy.before_allocation, now)
    step = _timed(phases["step"], executor.step, now)
    next_index = num_active
    for _ in range(iterations):  # a steady stream of short requests that reuse the shared prefix
        for _ in range(NEW_PER_ITERATION):
            executor.enqueue_request(LlmRequest(_prompt(next_index), max_new_tokens=4))
            next_index += 1
        step()
    median = {name: statistics.median(samples) for name, samples in phases.items()}
    host = median["schedule"] + median["prepare"]
    return {
        "active_requests": len(executor.active_requests),
        "schedule_us": round(median["schedule"], 1),
        "prepare_resources_us": round(median["prepare"], 1),
        "recheck_us": round(median["recheck"], 1),
        "recheck_share": round(median["recheck"] / host, 4),
        "host_us_per_request": round(host / num_active, 3),
        "step_us": round(median["step"], 1),
        "step_us_per_request": round(median["step"] / num_active, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--active", default="16,64,256,1024", help="comma-separated numbers of active requests")
    parser.add_argument("--iterations", type=int, default=200, help="timed iterations per size")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: the thread's CPU time (robust to a busy machine)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.active.split(",")]
    rows = []
    print(f"{'active':>7} {'schedule us':>12} {'prepare us':>11} {'recheck us':>11} {'recheck %':>10} {'us/request':>11}"
          f" {'step us':>9} {'step us/request':>16}")
    for n in sizes:
        row = measure(n, args.iterations, args.clock)
        rows.append(row)
        print(
            f"{n:>7} {row['schedule_us']:>12.1f} {row['prepare_resources_us']:>11.1f} {row['recheck_us']:>11.1f}"
            f" {100 * row['recheck_share']:>9.2f}% {row['host_us_per_request']:>11.3f}"
            f" {row['step_us']:>9.1f} {row['step_us_per_request']:>16.3f}",
            flush=True,
        )
    worst = max(row["recheck_share"] for row in rows)
    per_request = [row["host_us_per_request"] for row in rows]
    summary = {
        "max_recheck_share": worst,
        "recheck_within_5_percent": worst <= 0.05,
        # linear scaling: per-request host cost stays flat (within 2x) from the smallest to the largest size
        "per_request_cost_ratio_largest_to_smallest": round(per_request[-1] / per_request[0], 2),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"sizes": sizes, "iterations": args.iterations, "clock": args.clock,
                                  "prompt_len": PROMPT_LEN, "shared_prefix": SHARED_PREFIX,
                                  "tokens_per_block": TOKENS_PER_BLOCK, "new_requests_per_iteration": NEW_PER_ITERATION},
                       "results": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
