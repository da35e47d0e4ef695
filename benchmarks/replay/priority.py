"""Replay with a priority mix: interactive and batch traffic on one executor (``--priority-mix``).

    python -m benchmarks.replay --priority-mix 0.3 [--priority-rates 1,1.5,2] \\
        [--json OUT.json] [--plot OUT.png] [every other replay flag]

A fraction of the trace is marked interactive (priority 0.9), the rest batch (0.1): whole
conversations in a trace that has them (the default scenario), otherwise single requests,
drawn with ``--seed``. At each rate (the trace's own rate times each of ``--priority-rates``)
the same requests are replayed under four configurations, each on a fresh executor:

=====================  ====================================================================
fcfs                   ``waiting_queue_policy=fcfs``: priorities ignored (today's behaviour)
priority               ``waiting_queue_policy=priority``: admission, slots, budget, re-check
priority+preemption    the same, and a waiting request may pause running ones of lower priority
interactive alone      the interactive requests only, at their own arrival times (no batch load)
=====================  ====================================================================

Reported per class: TTFT p50/p99, the longest wait (arrival to first token), completions,
preemptions, tokens recomputed after a preemption and tokens onboarded from the host tier;
overall: output tokens/s and its ratio to fcfs at the same rate. The goals checked on the
chosen rate (``--priority-goal-rate``, 1.5 by default): the interactive TTFT p99 under priority
within 1.5x of the interactive-alone run, output tokens/s within 3% of fcfs, every batch
request completed. The JSON (``{"config", "rates": {rate: {configuration: metrics}}, "goals"}``)
is its own file: without ``--priority-mix`` the replay and its JSON are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.replay.loop import replay_policy
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.traces import Trace
from tensorrt_llm._torch.pyexecutor.config import SchedulerConfig

INTERACTIVE, BATCH = 0.9, 0.1
DEFAULT_RATES = (1.0, 1.5, 2.0)
CONFIGURATIONS = ("fcfs", "priority", "priority+preemption")
ALONE = "interactive alone"
GOAL_TTFT_RATIO = 1.5  # interactive TTFT p99 under load / without batch load
GOAL_THROUGHPUT_LOSS = 0.03  # output tokens/s may fall at most this far below fcfs


def mark_priorities(trace: Trace, interactive_fraction: float, seed: int) -> list[float]:
    """Each request's priority: whole conversations (``conversation_id``) where the trace has
    them, otherwise single requests, interactive with probability ``interactive_fraction``."""
    if not 0 <= interactive_fraction <= 1:
        raise ValueError(f"--priority-mix must be a fraction in [0, 1], got {interactive_fraction}")
    rng = random.Random(seed)
    drawn: dict[object, float] = {}
    priorities = []
    for request in trace.requests:
        key = getattr(request, "conversation_id", ("request", request.request_index))
        if key not in drawn:
            drawn[key] = INTERACTIVE if rng.random() < interactive_fraction else BATCH
        priorities.append(drawn[key])
    return priorities


def _scheduled(settings: ReplaySettings, configuration: str) -> ReplaySettings:
    base = settings.executor.scheduler_config
    if configuration == "fcfs":
        scheduling = dataclasses.replace(base, waiting_queue_policy="fcfs", enable_preemption=False)
    else:
        scheduling = dataclasses.replace(base, waiting_queue_policy="priority",
                                         enable_preemption=configuration.endswith("preemption"))
    executor = dataclasses.replace(settings.executor, scheduler_config=scheduling)
    return dataclasses.replace(settings, executor=executor)


def _summary(metrics: dict) -> dict:
    keep = ("requests", "completed", "errored", "ttft_ms", "output_tokens", "output_tokens_per_s", "makespan_s",
            "max_forward_tokens", "deferrals", "max_consecutive_deferrals", "overshoots", "wall_s", "priority_classes")
    return {key: metrics[key] for key in keep}


def run_priority_mix(
    trace_at: Callable[[float], Trace], settings: ReplaySettings, interactive_fraction: float, *, seed: int = 0,
    rates: Sequence[float] = DEFAULT_RATES, policy: str = "recheck", progress: bool = True,
) -> dict:
    """Replay every configuration at every rate; ``trace_at(rate)`` is the trace sped up ``rate`` times."""
    results: dict[str, dict] = {}
    for rate in rates:
        trace = trace_at(rate)
        priorities = mark_priorities(trace, interactive_fraction, seed)
        at_rate: dict[str, dict] = {}
        max_seq_len = settings.max_seq_len(trace)
        for configuration in CONFIGURATIONS:
            run = replay_policy(trace, _scheduled(settings, configuration), policy, max_seq_len=max_seq_len,
                                progress=progress, priorities=priorities)
            at_rate[configuration] = _summary(run.metrics)
        interactive = [r for r, p in zip(trace.requests, priorities) if p == INTERACTIVE]
        if interactive:
            alone = Trace(trace.name + " (interactive only)", trace.format, tuple(interactive), trace.notes)
            run = replay_policy(alone, _scheduled(settings, "fcfs"), policy, max_seq_len=max_seq_len,
                                progress=progress, priorities=[INTERACTIVE] * len(interactive))
            at_rate[ALONE] = _summary(run.metrics)
        fcfs_rate = at_rate["fcfs"]["output_tokens_per_s"]
        for configuration in CONFIGURATIONS:
            at_rate[configuration]["throughput_vs_fcfs"] = (
                at_rate[configuration]["output_tokens_per_s"] / fcfs_rate if fcfs_rate else math.nan)
        results[_rate_key(rate)] = at_rate
    return results


def _rate_key(rate: float) -> str:
    return f"{rate:g}x"


def check_goals(results: dict, rate: float) -> dict:
    """The goals on ``rate`` (see the module docstring), each with its value and whether it is met."""
    at = results[_rate_key(rate)]
    alone_p99 = at[ALONE]["priority_classes"]["high"]["ttft_ms"]["p99"]
    goals = {}
    for configuration in CONFIGURATIONS[1:]:
        run = at[configuration]
        high, low = run["priority_classes"]["high"], run["priority_classes"]["low"]
        ratio = high["ttft_ms"]["p99"] / alone_p99 if alone_p99 else math.inf
        goals[configuration] = {
            "interactive_ttft_p99_ms": high["ttft_ms"]["p99"],
            "interactive_alone_ttft_p99_ms": alone_p99,
            "interactive_ttft_p99_ratio": ratio,
            "ttft_goal_met": ratio <= GOAL_TTFT_RATIO,
            "throughput_vs_fcfs": run["throughput_vs_fcfs"],
            "throughput_goal_met": run["throughput_vs_fcfs"] >= 1 - GOAL_THROUGHPUT_LOSS,
            "batch_completed": low["completed"],
            "batch_requests": low["requests"],
            "batch_goal_met": low["completed"] == low["requests"],
        }
    return goals


def format_table(results: dict) -> str:
    """One line per rate, configuration and class."""
    header = (f"{'rate':>5}  {'configuration':<20} {'class':<6} {'done/req':>9}  {'TTFT p50/p99 ms':>17}  "
              f"{'longest s':>9}  {'preempt':>7}  {'recomputed':>10}  {'onboarded':>9}  {'out tok/s':>9}  {'vs fcfs':>7}")
    lines = [header, "-" * len(header)]
    for rate, at in results.items():
        for configuration, run in at.items():
            for name, c in sorted(run["priority_classes"].items(), key=lambda kv: kv[0] != "high"):
                who = "inter." if name == "high" else "batch" if name == "low" else name
                vs = run.get("throughput_vs_fcfs")
                lines.append(
                    f"{rate:>5}  {configuration:<20} {who:<6} {c['completed']:>4}/{c['requests']:<4}  "
                    f"{c['ttft_ms']['p50']:>7.0f}/{c['ttft_ms']['p99']:<7.0f}  {c['longest_wait_ms'] / 1e3:>9.1f}  "
                    f"{c['preemptions']:>7}  {c['recomputed_tokens']:>10}  {c['onboarded_tokens']:>9}  "
                    f"{run['output_tokens_per_s']:>9.0f}  {'' if vs is None else f'{vs:.3f}':>7}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Interactive and batch TTFT p99 per configuration and rate, and throughput against fcfs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.2
    shown = (*CONFIGURATIONS, ALONE)
    for panel, (cls, title) in enumerate((("high", "interactive (0.9) TTFT p99"), ("low", "batch (0.1) TTFT p99"))):
        ax = axes[panel]
        for k, configuration in enumerate(shown if cls == "high" else CONFIGURATIONS):
            values = [results[r].get(configuration, {}).get("priority_classes", {}).get(cls, {}).get("ttft_ms", {}).get("p99", 0) / 1e3
                      for r in rates]
            ax.bar([i + (k - 1.5) * width for i in range(len(rates))], values, width, label=configuration)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("arrival rate (x the trace's)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax = axes[2]
    top = 1.05
    for k, configuration in enumerate(CONFIGURATIONS):
        values = [results[r][configuration]["throughput_vs_fcfs"] for r in rates]
        top = max(top, *values)
        ax.bar([i + (k - 1) * width for i in range(len(rates))], values, width, label=configuration)
    ax.axhline(1 - GOAL_THROUGHPUT_LOSS, color="grey", linestyle="--", linewidth=1, label="goal: -3%")
    ax.set_xticks(range(len(rates)), rates)
    ax.set_ylim(0.9, top + 0.02)
    ax.set_xlabel("arrival rate (x the trace's)")
    ax.set_title("output tokens/s against fcfs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, config: dict, results: dict, goals: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "rates": results, "goals": goals}, indent=2, allow_nan=False) + "\n")


def main(spec, settings: ReplaySettings, policies: Sequence[str], *, interactive_fraction: float,
         rates: Sequence[float], goal_rate: float, json_path: str | None, plot_path: str | None) -> int:
    """``python -m benchmarks.replay --priority-mix ...``: run, print the table and the goals, write the files."""
    policy = policies[0]
    if goal_rate not in rates:
        raise SystemExit(f"--priority-goal-rate {goal_rate} is not one of --priority-rates {list(rates)}")

    def trace_at(rate: float) -> Trace:
        return dataclasses.replace(spec, time_scale=spec.time_scale / rate).load(settings)

    results = run_priority_mix(trace_at, settings, interactive_fraction, seed=spec.seed, rates=rates, policy=policy)
    goals = check_goals(results, goal_rate)
    base = trace_at(1.0)
    print(f"trace: {base.name}, {len(base)} requests over {base.requests[-1].arrival_s:.1f} s at 1x;"
          f" {interactive_fraction:.0%} of conversations interactive ({INTERACTIVE}), the rest batch ({BATCH});"
          f" policy {policy}\n")
    print(format_table(results))
    print(f"\ngoals at {goal_rate:g}x:")
    for configuration, goal in goals.items():
        print(f"  {configuration}: interactive TTFT p99 {goal['interactive_ttft_p99_ms']:.0f} ms ="
              f" {goal['interactive_ttft_p99_ratio']:.2f}x alone ({goal['interactive_alone_ttft_p99_ms']:.0f} ms)"
              f" [{'met' if goal['ttft_goal_met'] else 'missed'}]; output tokens/s {goal['throughput_vs_fcfs']:.3f}x fcfs"
              f" [{'met' if goal['throughput_goal_met'] else 'missed'}]; batch {goal['batch_completed']}/{goal['batch_requests']}"
              f" [{'met' if goal['batch_goal_met'] else 'missed'}]")
    config = {
        "trace": {"name": base.name, "requests": len(base), "arrival_span_s": base.requests[-1].arrival_s,
                  "seed": spec.seed, "path": spec.path, "time_scale": spec.time_scale},
        "interactive_fraction": interactive_fraction, "interactive_priority": INTERACTIVE, "batch_priority": BATCH,
        "rates": list(rates), "goal_rate": goal_rate, "policy": policy, "configurations": [*CONFIGURATIONS, ALONE],
        "settings": settings.options(),
    }
    if json_path:
        write_json(Path(json_path), config, results, goals)
    if plot_path:
        plot(results, Path(plot_path))
    return 0
