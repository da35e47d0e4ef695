"""The replay's outputs: the stdout table, the JSON file (docs/design.md §5) and the plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.replay.loop import ReplayResult

# docs/design.md §5: every key a result must carry, with its type. Extra keys are allowed.
RESULT_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "requests": int,
    "completed": int,
    "errored": int,
    "crashed": bool,
    "crash": (type(None), dict),
    "overshoots": int,
    "max_forward_tokens": int,
    "deferrals": int,
    "max_consecutive_deferrals": int,
    "budget_utilization": float,
    "ttft_ms": dict,
    "tpot_ms": dict,
    "output_tokens_per_s": float,
    "wall_s": float,
    # added later (docs/design.md §5, "further keys")
    "budget_utilization_when_bound": float,
    "iterations": int,
}


def schema_errors(document: dict) -> list[str]:
    """What in ``document`` breaks the §5 contract (empty when it is valid)."""
    errors = []
    if not isinstance(document, dict) or set(document) < {"config", "results"}:
        return ["top level must be an object with 'config' and 'results'"]
    if not isinstance(document["config"], dict):
        errors.append("config must be an object")
    if not isinstance(document["results"], dict) or not document["results"]:
        return errors + ["results must be a non-empty object"]
    for policy, result in document["results"].items():
        for key, kind in RESULT_SCHEMA.items():
            if key not in result:
                errors.append(f"{policy}: missing {key!r}")
                continue
            value = result[key]
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if not ok:
                errors.append(f"{policy}: {key} must be {kind}, got {type(value).__name__}")
        for key in ("ttft_ms", "tpot_ms"):
            for q in ("p50", "p99"):
                if not isinstance(result.get(key), dict) or not isinstance(result[key].get(q), float):
                    errors.append(f"{policy}: {key}.{q} must be a float")
        crash = result.get("crash")
        if result.get("crashed") is True and not (
            isinstance(crash, dict) and isinstance(crash.get("iteration"), int) and isinstance(crash.get("message"), str)
        ):
            errors.append(f"{policy}: crashed needs crash = {{iteration: int, message: str}}")
        if result.get("crashed") is False and crash is not None:
            errors.append(f"{policy}: crash must be null when crashed is false")
    return errors


def write_json(result: ReplayResult, path: Path) -> None:
    document = result.to_json()
    errors = schema_errors(document)
    if errors:  # a bug in the replay, not in the user's input
        raise AssertionError("replay JSON breaks docs/design.md §5: " + "; ".join(errors))
    partial = path.with_name(path.name + ".partial")  # replaced whole: a run killed mid-write keeps the last file
    partial.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    os.replace(partial, path)


def _mechanisms(metrics: dict) -> str:
    counts = metrics.get("overshoot_mechanisms", {})
    short = {"whole_prompt_hit": "whole", "evicted_discount": "evict", "other": "other"}
    parts = [f"{short[k]} {v}" for k, v in counts.items() if v]
    return ", ".join(parts) if parts else "-"


def format_table(result: ReplayResult) -> str:
    header = (
        "policy", "done/req", "err", "unserved", "crashed", "overshoots (mechanism)", "max fwd", "defer", "cut", "max consec",
        "util/bound", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "out tok/s", "wall s",
    )
    rows = [header]
    for policy, run in result.runs.items():
        m = run.metrics
        rows.append((
            policy,
            f"{m['completed']}/{m['requests']}",
            str(m["errored"]),
            str(m["unserved"]),
            f"yes (it {m['crash']['iteration']})" if m["crashed"] else "no",
            f"{m['overshoots']} ({_mechanisms(m)})",
            str(m["max_forward_tokens"]),
            str(m["deferrals"]),
            str(m.get("budget_cuts", 0)),
            str(m["max_consecutive_deferrals"]),
            f"{m['budget_utilization']:.3f}/{m['budget_utilization_when_bound']:.3f}",
            f"{m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f}",
            f"{m['tpot_ms']['p50']:.1f}/{m['tpot_ms']['p99']:.1f}",
            f"{m['output_tokens_per_s']:.0f}",
            f"{m['wall_s']:.1f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 or gib == 0 else f"{gib * 1024:.1f} MiB"


def format_report(result: ReplayResult) -> str:
    config = result.config
    trace, kv, ex = config["trace"], config["kv_cache"], config["executor"]
    lines = [
        f"trace: {trace['name']} ({trace['format']}), {trace['requests']} requests over {trace['arrival_span_s']:.1f} s,"
        f" {trace['prompt_tokens']} prompt / {trace['output_tokens']} output tokens",
    ]
    lines += [f"  note: {note}" for note in result.trace_notes]
    lines.append(
        f"engine: {config['engine']['engine']}; max_num_tokens={ex['max_num_tokens']} max_batch_size={ex['max_batch_size']}"
        f" chunked_prefill={ex['enable_chunked_prefill']}; KV {kv['num_blocks']} x {kv['tokens_per_block']}-token blocks"
        f" ({kv['num_tokens']} tokens, {_size(kv['device_pool_gib'])}) + host {kv['host_cache_blocks']} blocks"
        f" ({_size(kv['host_pool_gib'])}); block_reuse={kv['enable_block_reuse']} partial_reuse={kv['enable_partial_reuse']}"
    )
    lines.append("")
    lines.append(format_table(result))
    for policy, run in result.runs.items():
        crash = run.metrics["crash"]
        if crash:
            lines.append("")
            lines.append(f"{policy}: CRASHED at iteration {crash['iteration']} (t={crash['time_s']:.2f} s): {crash['message']}")
            lines.append(f"  mechanism: {crash['mechanism']} -- {crash['detail']}")
            lines.append(f"  {run.metrics['unserved']} of {run.metrics['requests']} requests left unserved")
            before = ", ".join(
                f"{name} {other.metrics['budget_utilization_before_crash']:.3f}" for name, other in result.runs.items()
            )
            lines.append(f"  budget utilisation over the forwards before t={crash['time_s']:.1f} s: {before}")
    return "\n".join(lines)


_COLORS = {"none": "tab:red", "trim": "tab:orange", "fit": "tab:blue", "recheck": "tab:green", "claim": "tab:purple"}


def plot(result: ReplayResult, path: Path) -> None:
    """Two panels: forward positions per iteration against ``max_num_tokens`` (x = simulated
    time; overshooting batches marked with x), and the TTFT CDF of each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_num_tokens = result.config["executor"]["max_num_tokens"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5))
    # Policies that never crash cover the same ground; draw them first, none last, as dots.
    order = sorted(result.runs.items(), key=lambda item: item[0] == "none")
    for policy, run in order:
        color = _COLORS.get(policy)
        top.scatter(run.iteration_time_s, run.iteration_tokens, s=2, alpha=0.5, color=color, lw=0,
                    label=f"{policy} (max {run.metrics['max_forward_tokens']})")
        if len(run.overshoot_time_s):
            top.scatter(run.overshoot_time_s, run.overshoot_tokens, marker="x", s=40, color=color, zorder=5,
                        label=f"{policy} overshoot")
        crash = run.metrics["crash"]
        if crash:
            top.axvline(crash["time_s"], color=color, ls=":", lw=1)
    for policy, run in result.runs.items():
        color = _COLORS.get(policy)
        if run.ttft_ms:
            xs = sorted(run.ttft_ms)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            done = f"{len(xs)}/{run.metrics['requests']} got a first token"
            bottom.step(xs, ys, where="post", color=color, label=f"{policy} ({done})")
    top.axhline(max_num_tokens, color="black", ls="--", lw=1, label=f"max_num_tokens = {max_num_tokens}")
    top.set_xlabel("simulated time (s)")
    top.set_ylabel("positions in the forward")
    fig.suptitle(f"Forward tokens per iteration and TTFT — {result.config['trace']['name']}")
    legend = top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncol=6, frameon=False)
    for handle in legend.legend_handles:
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([25])  # the dots are tiny on the axes
    bottom.set_xscale("log")
    bottom.set_xlabel("time to first token (ms, log)")
    bottom.set_ylabel("fraction of requests")
    bottom.set_title("TTFT distribution (requests that got a first token)")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

