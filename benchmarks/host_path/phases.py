"""Where an iteration's host time goes, phase by phase, per active request.

The scenario of ``benchmarks.host_path.overhead`` (N long-running generation requests, two new requests
a step that share a prefix, the simulated engine), with every phase of ``PyExecutor.step``
timed by wrapping the executor's own objects with the thread's CPU clock:

    schedule           SimpleScheduler.schedule_request (capacity + micro-batch; prefix matches)
    prepare            ResourceManager.prepare_resources (re-check + KV allocation)
    record_prepared    what prepare decided, written on the requests (iteration.launch)
    budget_bound       the scan for prompt tokens still to compute (iteration.launch)
    forward            ModelEngine.forward_async (the forward's inputs; the simulated forward)
    advance            the requests move past the forward (iteration.launch)
    sample, update     iteration.completion's sample and update_requests (tokens, the stop rule, responses)
    commit             KVCacheManager.commit (update_resources before it had that name)
    free, record       PyExecutor._free_finished and _record (statistics)
    step               the whole PyExecutor.step

Each phase names where to find it in the trees it has lived in, newest first: a method of one
of the executor's objects, or a function the executor's module calls by name (replaced in that
module). A phase no name of which a tree has is left out (older trees named and split them
differently: an older ``_update_requests`` also sampled, an older ``_prepare_resources`` also
recorded and scanned). ``benchmarks.host_path.ab --phases`` runs this file in several trees, alternated.

    python -m benchmarks.host_path.phases [--active 256] [--iterations 300] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

from benchmarks.host_path import overhead
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

# phase -> where it lives, newest tree first: (owner, name). The owner is an attribute path
# from the executor ("" the executor itself), or MODULE: the executor's own module, whose
# global the iteration calls by name.
MODULE = "<module>"
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "schedule": (("scheduler", "schedule_request"),),
    "prepare": (("resource_manager", "prepare_resources"),),
    "record_prepared": ((MODULE, "record_prepared"),),
    "budget_bound": ((MODULE, "budget_bound"), ("", "_budget_bound")),
    "forward": (("model_engine", "forward_async"),),
    "advance": ((MODULE, "advance"), ("", "_advance")),
    "sample": ((MODULE, "sample"), ("", "_sample")),
    "update": (("completion", "update_requests"), ("", "_update_requests")),
    "commit": (("kv_cache_manager", "commit"), ("kv_cache_manager", "update_resources")),
    "free": (("", "_free_finished"),),
    "record": (("", "_record"),),
}


def _owner(executor, path: str):
    if path == MODULE:
        return sys.modules[type(executor).__module__]
    target = executor
    for name in filter(None, path.split(".")):
        target = getattr(target, name, None)
    return target


def _wrap(samples: list[float], fn: Callable) -> Callable:
    clock = time.thread_time_ns

    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append((clock() - start) / 1e3)

    return wrapper


def measure(num_active: int, iterations: int) -> dict[str, float]:
    """Median CPU microseconds per active request of each phase (its median per call times its
    calls per iteration, over ``num_active``)."""
    executor = overhead._executor(num_active)
    for i in range(num_active):
        executor.enqueue_request(LlmRequest(overhead._prompt(i), max_new_tokens=100_000))
    while any(r.is_context_init_state for r in executor.active_requests) or not executor.active_requests:
        executor.step()
    samples: dict[str, list[float]] = {}
    for phase, places in PHASES.items():
        found = [(target, name) for target, name in ((_owner(executor, o), n) for o, n in places)
                 if callable(getattr(target, name, None))]
        if found:
            target, name = found[0]
            samples[phase] = []
            setattr(target, name, _wrap(samples[phase], getattr(target, name)))
    # not set on the executor: its loop calls the executor's step again, inside this one
    samples["step"] = []
    step = _wrap(samples["step"], executor.step)
    next_index = num_active
    for _ in range(iterations):
        for _ in range(overhead.NEW_PER_ITERATION):
            executor.enqueue_request(LlmRequest(overhead._prompt(next_index), max_new_tokens=4))
            next_index += 1
        step()
    return {phase: round(statistics.median(s) * len(s) / iterations / num_active, 4)
            for phase, s in samples.items() if s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--active", type=int, default=256, help="active requests")
    parser.add_argument("--iterations", type=int, default=300, help="timed iterations")
    parser.add_argument("--json", help="write the phases here")
    args = parser.parse_args(argv)
    phases = measure(args.active, args.iterations)
    print(" ".join(f"{phase}={us:.3f}" for phase, us in phases.items()), "(CPU us per active request)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"active": args.active, "iterations": args.iterations, "clock": "cpu"},
                       "us_per_request": phases}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
