"""One short table from what the ``fp8-roofline`` phase of ``h200_runs.sh`` wrote in OUT: the decode
kernel bf16 against FP8 (TB/s), the 8B decode step against its rooflines (bf16 and FP8, fused and
not), the kernels a layer launches, and the in-process engine's FP8 over bf16 per concurrency,
each beside its goal. Missing files are named, not guessed::

    python -m benchmarks.gpu.roofline_summary OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(out: Path, name: str) -> dict | None:
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None


def summary(out: Path) -> str:
    lines = [f"{'what':46s} {'measured':>26s}  goal"]

    def row(what: str, measured: str, goal: str = "") -> None:
        lines.append(f"{what:46s} {measured:>26s}  {goal}")

    kernel = _load(out, "gpu_fp8_kernel.json")
    if kernel is None:
        row("decode kernel", "(no gpu_fp8_kernel.json)")
    else:
        for case, e in kernel["cases"].items():
            row(f"decode kernel {case}: bf16 / FP8 ms", f"{e['bfloat16']['ms']:.3f} / {e['fp8']['ms']:.3f}",
                f"FP8 <= 0.65x: {e['fp8_over_bf16']:.2f}x")
            row(f"decode kernel {case}: bf16 / FP8 TB/s", f"{e['bfloat16']['tb_s']:.2f} / {e['fp8']['tb_s']:.2f}",
                "FP8 >= 3.5 TB/s")
            best = e["best_fp8"]
            row(f"  best FP8 shape ({best['splits']} splits)", f"{best['tb_s']:.2f} TB/s", best["config"])
    for name, label in (("decode_profile.json", "bf16"), ("decode_profile_fp8.json", "FP8"),
                        ("decode_profile_unfused.json", "bf16 unfused")):
        profile = _load(out, name)
        if profile is None:
            row(f"8B decode step, {label}", f"(no {name})")
            continue
        for r in profile["rows"]:
            goal = ""
            if r["batch"] == 1:
                goal = f">= 80% of weights' ({r['weight_floor_ms']:.2f} ms): {100 * r['weight_roofline_fraction']:.0f}%"
            elif r["batch"] == 64:
                goal = f">= 75% of weights + KV: {100 * r['roofline_fraction']:.0f}%"
            else:
                goal = f"{100 * r['roofline_fraction']:.0f}% of weights + KV"
            row(f"8B decode step, {label}, batch {r['batch']} x {r['context']}", f"{r['step_ms']:.3f} ms", goal)
            prof = r.get("profile")
            if prof:
                row(f"  kernels a step / a layer, idle inside", f"{prof['kernels_per_step']:.0f} / "
                    f"{prof['kernels_per_layer']:.1f}, {prof['idle_us_per_step'] / 1e3:.3f} ms")
    engine = _load(out, "engine_fp8.json")
    if engine is None:
        row("in-process engine FP8 / bf16", "(no engine_fp8.json)")
    else:
        for level, e in engine["levels"].items():
            row(f"engine {engine['shape']} c={level}: bf16 / FP8 tok/s", f"{e['auto']:.0f} / {e['fp8']:.0f}",
                f"FP8 >= bf16: {e['fp8_over_bf16']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(summary(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
