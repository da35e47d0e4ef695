"""What the host did during the GPU's largest idle gaps in a replay (the 0.8 points of
idle over the 5% goal in ``benchmarks/results/h200/README.md``).

Replays the default scenario's first ``--requests`` requests under one policy on the torch
engine (overlap on, as ``gpu_phase_b``'s replay), records every forward's CUDA events (as
``gpu_phase_b.record_forwards``) and a host timeline of the executor's phases, then prints, for
the ``--top`` largest gaps between two forwards, where the host's time went between the two
launches: per phase (nested phases are listed under their parent's time too) and the rest
(the replay loop: arrivals, the clock).

    PYTHONPATH=. python -m benchmarks.gpu.gaps [--requests 150] [--policy recheck] [--top 8]
        [--host-cache-blocks 512] [--offload-ahead-blocks 0] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu.phase_b import RecordedSettings, _kind, add_host_tier_arguments, host_tier_kv_config
from benchmarks.replay.cli import TraceSpec, replay_trace
from benchmarks.replay.sim_engine import Engine

# (object attribute holding the target, method name, label, nested in the phase listed before it);
# "" is the executor itself
_PHASES = (
    ("", "_fetch_new_requests", "fetch", False),
    ("", "_schedule", "schedule", False),
    ("", "_prepare_resources", "prepare_resources", False),
    ("kv_cache_manager", "prepare_resources", "kv allocation", True),
    ("model_engine", "forward_async", "launch", False),
    ("model_engine", "_prepare_tp_inputs", "prepare_tp_inputs", True),
    ("model_engine", "_plan", "attention plan", True),  # before the forward's start event
    ("model_engine", "_forward_eager", "eager forward", True),  # after it: overlaps the GPU's work
    ("", "_complete", "complete", False),
    ("", "_update_requests", "sample+respond", True),
    ("kv_cache_manager", "commit", "kv commit", True),
    ("", "_free_finished", "free_finished", False),
    ("kv_cache_manager", "offload_ahead", "offload ahead", False),  # after the launch (offload_ahead_blocks)
)
_NESTED = frozenset(label for _, _, label, nested in _PHASES if nested)


@dataclass(slots=True)
class Span:
    label: str
    start: float
    end: float
    moved: tuple[int, int] = (0, 0)  # host-tier (offloads, onboards) during the span


class TimelineSettings(RecordedSettings):
    """``RecordedSettings`` whose executor also records a host timeline (``recorded["_host"][policy]``)."""

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        fresh = self.engine == "torch" and self.tag + policy not in self.recorded  # as RecordedSettings decides
        engine = RecordedSettings.build_engine(self, policy, max_seq_len)
        if fresh:
            spans: list[Span] = self.recorded.setdefault("_host", {}).setdefault(policy, [])
            executor = engine.executor
            pool = executor.kv_cache_manager.pool
            for owner, name, label, _ in _PHASES:
                target = getattr(executor, owner) if owner else executor
                setattr(target, name, _timed(getattr(target, name), label, spans, pool))
        return engine


def _timed(method, label: str, spans: list[Span], pool):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        offloads, onboards = pool.num_offloads, pool.num_onboards
        try:
            return method(*args, **kwargs)
        finally:
            moved = (pool.num_offloads - offloads, pool.num_onboards - onboards)
            spans.append(Span(label, start, time.perf_counter(), moved))

    return wrapper


def gap_breakdown(forwards, spans: list[Span], top: int) -> list[dict]:
    """The ``top`` largest GPU gaps, each with the host's time per phase between the two launches."""
    timed = [f for f in forwards if f.events is not None]
    torch.cuda.synchronize()
    gaps = [(a.events[1].elapsed_time(b.events[0]), i) for i, (a, b) in enumerate(zip(timed, timed[1:]))]
    rows = []
    for gap_ms, i in sorted(gaps, reverse=True)[:top]:
        a, b = timed[i], timed[i + 1]
        per_phase: dict[str, float] = collections.defaultdict(float)
        offloads = onboards = 0
        for span in spans:
            overlap = min(span.end, b.host_t) - max(span.start, a.host_t)
            if overlap > 0:
                per_phase[span.label] += overlap * 1e3
                if span.label == "kv allocation":
                    offloads, onboards = offloads + span.moved[0], onboards + span.moved[1]
        window = (b.host_t - a.host_t) * 1e3
        top_level = sum(ms for label, ms in per_phase.items() if label not in _NESTED)
        rows.append({"gap_ms": round(gap_ms, 2), "after": _kind(a), "before": _kind(b),
                     "host_between_launches_ms": round(window, 2),
                     "phases_ms": {k: round(v, 2) for k, v in sorted(per_phase.items(), key=lambda kv: -kv[1])},
                     "outside_executor_ms": round(window - top_level, 2),
                     "host_tier_blocks": {"offloaded": offloads, "onboarded": onboards}})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mistral-nemo-12b-random")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--policy", default="recheck")
    p.add_argument("--top", type=int, default=8)
    add_host_tier_arguments(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_gaps needs a CUDA device (the gaps are between CUDA events)", file=sys.stderr)
        return 2
    spec = TraceSpec(num_requests=args.requests)
    trace = spec.load_for(vocab_size=32000, tokens_per_block=32)
    recorded: dict = {}
    settings = TimelineSettings.from_options(
        engine="torch", model=args.model, device="cuda", recorded=recorded, host_cache_blocks=args.host_cache_blocks,
        kv_cache_config=host_tier_kv_config(args))  # the rest: the replay's defaults
    replay_trace(trace, settings, [args.policy], spec=spec, progress=False)
    rows = gap_breakdown(recorded[args.policy], recorded["_host"][args.policy], args.top)
    for row in rows:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phases_ms"].items() if v >= 0.5)
        print(f"gap {row['gap_ms']:.1f} ms after [{row['after']}] before [{row['before']}]: host "
              f"{row['host_between_launches_ms']:.1f} ms between the launches: {phases}; "
              f"outside the executor {row['outside_executor_ms']:.1f}; host tier "
              f"{row['host_tier_blocks']['offloaded']} offloads, {row['host_tier_blocks']['onboarded']} onboards")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "requests": args.requests, "host_cache_blocks": args.host_cache_blocks,
                       **host_tier_kv_config(args), "gaps": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
