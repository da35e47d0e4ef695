"""Plots of the GPU runs' JSON: the sampled decode step against the greedy one per batch size
(``benchmarks.model.sampling_speed``), and GuideLLM's sampled and ``temperature: 0`` runs per
concurrency level (``benchmarks.gpu.peer_serving``)::

    python -m benchmarks.gpu.results_plots --sampling SAMPLING.json --peer PEER.json --out DIR

Writes ``DIR/sampling_ratio.png`` and ``DIR/peer_sampled_vs_greedy.png`` (whichever inputs are given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot_sampling(result: dict, path: Path) -> None:
    """Each variant's device step over greedy's, per batch size, beside the 1.05 goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = [row["batch"] for row in rows]
    variants = [v for v in rows[0]["variants"] if v != "greedy"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ratios = [row["variants"][variant]["device_ratio"] for row in rows]
        ax.bar([b + (i - len(variants) / 2 + 0.5) * width for b in range(len(batches))], ratios, width, label=variant)
    ax.axhline(1.05, color="black", linestyle="--", linewidth=1, label="goal for 'sampled' (1.05)")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("decode batch (1024 cached tokens each)")
    ax.set_ylabel("device step / greedy step")
    ax.set_ylim(0.95, max(1.15, max(r["variants"][v]["device_ratio"] for r in rows for v in variants) + 0.02))
    ax.set_title(f"Sampling on the device, {result['config'].get('model')} on {result['config'].get('device_name')}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_peer(record: dict, path: Path) -> None:
    """Output tokens/s and ITL p50 per concurrency, sampled against temperature 0, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(record["runs"])
    fig, axes = plt.subplots(2, len(shapes), figsize=(5 * len(shapes), 6), squeeze=False)
    for column, shape in enumerate(shapes):
        for sampling, style in (("sampled", "o-"), ("greedy", "s--")):
            levels = record["runs"][shape].get(sampling, {}).get("levels") or []
            conc = [lv["concurrency"] for lv in levels]
            axes[0][column].plot(conc, [lv["output_tokens_per_s"] or 0 for lv in levels], style, label=sampling)
            axes[1][column].plot(conc, [lv["itl_ms"]["p50"] or 0 for lv in levels], style, label=sampling)
        axes[0][column].set_title(f"{shape}, KV {record.get('kv_cache_dtype')}")
        axes[0][column].set_ylabel("output tok/s")
        axes[1][column].set_ylabel("ITL p50 (ms)")
        for row in axes:
            row[column].set_xscale("log", base=2)
            row[column].set_xlabel("concurrency")
            row[column].legend(fontsize=8)
    fig.suptitle(f"GuideLLM: sampled (temperature omitted) vs temperature 0 on {record.get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sampling", type=Path)
    parser.add_argument("--peer", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sampling:
        plot_sampling(json.loads(args.sampling.read_text()), args.out / "sampling_ratio.png")
    if args.peer:
        plot_peer(json.loads(args.peer.read_text()), args.out / "peer_sampled_vs_greedy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
