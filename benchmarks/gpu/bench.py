"""The engine on the GPU, measured in one run: kernels and forwards against the H200 roofline, what
CUDA graphs buy, and the simulator's cost model against the engine's own iteration times.

    PYTHONPATH=. python -m benchmarks.gpu.bench --out DIR [--sections env,attention,forward,executor]
        [--model mistral-nemo-12b-random] [--requests 80] [--budget-s 480] [--quick]

Writes ``DIR/gpu_bench.json`` (every number, with the settings and versions), plots
``roofline.png``, ``decode_graphs.png``, ``sim_vs_engine.png``, and prints a summary. Sections
(each guarded: a failure is recorded in the JSON and the next section runs):

* ``env``: versions, the GPU, measured matmul and copy ceilings.
* ``attention``: one attention layer at the roofline cases' shapes (``gpu.kernels``).
* ``forward``: the model built on the GPU; the four roofline cases, decode with and without
  CUDA graphs per batch size, and the shapes of ``../shared/calibration/`` (``gpu.forward``).
* ``executor``: the scaled-down default scenario through the real executor, every iteration
  priced by the cost models (``gpu.sim_check``).

``--quick`` shrinks every shape (with a small model it runs on the CPU: a check of the script,
not a measurement). ``--budget-s``: sections that would start after this many seconds are
skipped, so a lease-bounded run still writes its results.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu.forward import build_engine, calibration_shapes, graph_sweep, roofline_cases
from benchmarks.gpu.kernels import attention_benchmarks
from benchmarks.gpu.sim_check import calibration_errors, refit_check, sim_vs_engine
from benchmarks.gpu.common import H200, measure_ceilings, summary_footer
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM

logger = logging.getLogger("gpu_bench")

SECTIONS = ("env", "attention", "forward", "executor")
SHARED_TABLE = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "h200_mistral_nemo_12b.json"


def _shared_table() -> Path | None:
    for candidate in (SHARED_TABLE, Path(__file__).resolve().parents[3] / "shared" / "calibration"
                      / "h200_mistral_nemo_12b.json", Path("shared/calibration/h200_mistral_nemo_12b.json")):
        if candidate.exists():
            return candidate
    return None


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    result: dict = {"command": " ".join(["python -m benchmarks.gpu.bench", *sys.argv[1:]]), "model": args.model,
                    "quick": args.quick, "sections": {}}

    def section(name, fn):
        if name not in args.sections:
            return
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            result["sections"][name] = {"skipped": f"budget: {elapsed:.0f} s > {args.budget_s} s"}
            return
        logger.info("section %s (at %.0f s)", name, elapsed)
        start = time.perf_counter()
        try:
            result["sections"][name] = fn()
        except Exception as error:  # record and go on: the other sections still measure
            logger.exception("section %s failed", name)
            result["sections"][name] = {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}
        result["sections"].setdefault(name, {})
        if isinstance(result["sections"][name], dict):
            result["sections"][name]["section_seconds"] = time.perf_counter() - start

    section("env", lambda: {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "triton": _version("triton"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "nominal": {"peak_tflops": H200.peak_flops / 1e12, "bandwidth_tb_s": H200.mem_bandwidth / 1e12},
        "measured": measure_ceilings(device),
    })
    section("attention", lambda: attention_benchmarks(device, quick=args.quick))

    model = None
    if "forward" in args.sections or "executor" in args.sections:
        start = time.perf_counter()
        model = LlamaForCausalLM(MODEL_PRESETS[args.model], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["model_build_s"] = time.perf_counter() - start
        logger.info("built %s on %s in %.1f s", args.model, device, result["model_build_s"])

    def forward_section() -> dict:
        # The pool: free_gpu_memory_fraction of the GPU (on the CPU, a --quick check: 4096 blocks).
        engine = build_engine(model, max_batch_size=256, max_num_tokens=8192 + 256, max_seq_len=32768,
                              num_blocks=4096 if device.type == "cpu" else None)
        start = time.perf_counter()
        engine.warmup()
        out = {"pool_blocks": engine.kv_cache_manager.num_blocks, "warmup_s": time.perf_counter() - start}
        out["roofline"] = roofline_cases(engine, quick=args.quick)
        out["decode_graphs"] = graph_sweep(engine, quick=args.quick)
        table = _shared_table()
        if table is not None and time.perf_counter() - t0 < args.budget_s:
            out["calibration_rows"] = calibration_shapes(engine, table, quick=args.quick)
            out["calibration"] = calibration_errors(out["calibration_rows"])
        del engine
        gc.collect()  # the KV manager and its budget policy refer to each other
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return out

    section("forward", forward_section)
    section("executor", lambda: sim_vs_engine(model, args.model, num_requests=args.requests))
    forward, executor = result["sections"].get("forward", {}), result["sections"].get("executor", {})
    if executor.get("per_iteration"):
        try:
            executor["refit"] = refit_check(forward.get("calibration_rows", []), executor["per_iteration"])
        except Exception as error:
            executor["refit"] = {"error": repr(error)}
    result["total_seconds"] = time.perf_counter() - t0
    return result


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except Exception:
        return None


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def summary(result: dict) -> str:
    lines = []
    env = result["sections"].get("env", {})
    if env.get("measured"):
        m = env["measured"]
        lines.append(f"{env['device']}, torch {env['torch']}, triton {env['triton']}: matmul "
                     f"{m['bf16_matmul_8192_tflops']:.0f} TFLOP/s, copy {m['copy_tb_s_read_plus_write']:.2f} TB/s")
    att = result["sections"].get("attention", {})
    for key, c in att.items():
        if isinstance(c, dict) and "flops" in c and "engine_layer" in c:
            nan = {"tflops": float("nan")}
            cudnn = c.get("cudnn_split", {})
            best = c.get("triton_best", nan)
            line = (f"attention {key}: engine layer {c['engine_layer']['ms']:.3f} ms "
                    f"({c['engine_layer']['tflops']:.0f} TFLOP/s), flash varlen {c.get('flash_varlen', nan)['tflops']:.0f}, "
                    f"best triton {best['tflops']:.0f} {best.get('config')}")
            if "sdpa_contiguous" in c:
                line += (f", SDPA contiguous {c['sdpa_contiguous']['tflops']:.0f}, cuDNN "
                         f"{cudnn.get('tflops', float('nan')):.0f} (first call of a shape "
                         f"{cudnn.get('first_call_ms', float('nan')):.0f} ms)")
            lines.append(line)
    for key, c in att.items():
        if key.startswith("decode_") and isinstance(c, dict) and "engine_layer" in c:
            best = c.get("triton_best", {})
            lines.append(f"attention {key}: engine layer {c['engine_layer']['tb_s']:.2f} TB/s, best triton "
                         f"{best.get('tb_s', float('nan')):.2f} TB/s {best.get('config')}/{best.get('splits')}, SDPA "
                         f"contiguous {c['sdpa_contiguous']['tb_s']:.2f}, gather+SDPA {c['gather_then_sdpa']['tb_s']:.2f}")
    fwd = result["sections"].get("forward", {})
    for name, r in fwd.get("roofline", {}).items():
        lines.append(f"forward {name}: {r['measured_ms']:.2f} ms vs roofline {r['roofline_ms']:.2f} ms "
                     f"({100 * r['roofline_fraction']:.0f}%, {r['x_roofline']:.2f}x, {r['tflops']:.0f} TFLOP/s, "
                     f"{r['tb_s']:.2f} TB/s, {r['bound']})")
    for row in fwd.get("decode_graphs", []):
        graph = row["graph"]["device_ms"] if row["graph"] else float("nan")
        lines.append(f"decode {row['batch']}x{row['context']}: eager {row['eager']['device_ms']:.2f} ms "
                     f"(wall {row['eager']['wall_ms']:.2f}), graph {graph:.2f} ms, roofline {row['roofline_ms']:.2f}")
    if fwd.get("calibration"):
        c = fwd["calibration"]
        lines.append(f"calibration shapes ({c['rows_measured']} measured): fitted model vs engine median "
                     f"{c['fitted_vs_engine']['median_rel_err']:.1%} p90 {c['fitted_vs_engine']['p90_rel_err']:.1%}; "
                     f"shared table vs engine median {c['shared_table_vs_engine']['median_rel_err']:.1%}, "
                     f"engine/shared {c['engine_over_shared_median']:.2f}")
    ex = result["sections"].get("executor", {})
    for name, e in ex.get("errors", {}).items():
        for against, err in e.items():
            if isinstance(err, dict) and err.get("n"):
                lines.append(f"sim vs engine, {name} {against}: median {err['median_rel_err']:.1%}, "
                             f"p90 {err['p90_rel_err']:.1%} over {err['n']} iterations")
    if ex.get("gpu_metrics"):
        g, s = ex["gpu_metrics"], ex["sim_metrics"]
        lines.append(f"replay (recheck, {ex['trace']['requests']} requests): GPU TTFT p50 {g['ttft_ms']['p50']:.0f} ms, "
                     f"TPOT p50 {g['tpot_ms']['p50']:.1f} ms, {g['output_tokens_per_s']:.0f} tok/s | sim TTFT p50 "
                     f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                     f"{s['output_tokens_per_s']:.0f} tok/s")
    for name, refit in ex.get("refit", {}).items():
        e = refit.get("vs_device_time", {}) if isinstance(refit, dict) else {}
        if e.get("n"):
            lines.append(f"cost model refitted {name} (checked on executor iterations): median "
                         f"{e['median_rel_err']:.1%}, p90 {e['p90_rel_err']:.1%} over {e['n']}")
    lines.extend(summary_footer(result))
    return "\n".join(lines)


def plots(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fwd = result["sections"].get("forward", {})
    if fwd.get("roofline"):
        fig, ax = plt.subplots(figsize=(8, 4))
        names, fractions, colors = [], [], []
        for name, r in fwd["roofline"].items():
            for mode, t in r["timings"].items():
                names.append(f"{name}\n{mode}")
                fractions.append(100 * r["roofline_ms"] / t["device_ms"])
                colors.append("tab:blue" if r["bound"] == "compute" else "tab:orange")
        ax.bar(names, fractions, color=colors)
        ax.axhline(60, color="tab:blue", ls="--", lw=1, label="prefill goal (60% of matmul peak)")
        ax.axhline(50, color="tab:orange", ls="--", lw=1, label="decode goal (within 2x of bandwidth)")
        ax.set_ylabel("% of roofline (H200: 800 TFLOP/s, 4.2 TB/s)")
        ax.set_title(f"{result['model']}: whole forwards against the roofline")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "roofline.png", dpi=120)
        plt.close(fig)
    if fwd.get("decode_graphs"):
        rows = fwd["decode_graphs"]
        fig, ax = plt.subplots(figsize=(6, 4))
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["eager"]["device_ms"] for r in rows], "o-", label="eager")
        if rows[0]["graph"]:
            ax.plot(batches, [r["graph"]["device_ms"] for r in rows], "s-", label="CUDA graph")
        ax.plot(batches, [r["roofline_ms"] for r in rows], "k--", label="roofline (weights + KV once)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"decode batch (context {rows[0]['context']})")
        ax.set_ylabel("ms per step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "decode_graphs.png", dpi=120)
        plt.close(fig)
    ex = result["sections"].get("executor", {})
    its = [it for it in ex.get("per_iteration", []) if it["device_ms"]]
    cal = [r for r in fwd.get("calibration_rows", []) if "device_ms" in r]
    if its or cal:
        fig, ax = plt.subplots(figsize=(6, 5))
        if its:
            measured = [it["device_ms"] for it in its]
            ax.scatter(measured, [it["fitted_ms"] for it in its], s=6, label="executor iterations: fitted model")
            ax.scatter(measured, [it["roofline_ms"] for it in its], s=6, alpha=0.5, label="executor iterations: roofline")
        if cal:
            ax.scatter([r["device_ms"] for r in cal], [r["shared_ms"] for r in cal], marker="x", s=20,
                       label="calibration shapes: shared table")
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [1.1 * lo, 1.1 * hi], "k:", lw=0.8)
        ax.plot([lo, hi], [0.9 * lo, 0.9 * hi], "k:", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("engine, measured ms (device time of the forward)")
        ax.set_ylabel("predicted ms")
        ax.set_title("cost model vs engine (dotted: +-10%)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "sim_vs_engine.png", dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        type=lambda s: [x for x in s.split(",") if x], help="comma-separated subset of " + ",".join(SECTIONS))
    parser.add_argument("--model", default="mistral-nemo-12b-random", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--requests", type=int, default=80, help="default-scenario requests for the executor run")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        parser.error(f"unknown sections {sorted(bad)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    try:
        plots(result, args.out)
    except Exception:
        logger.exception("plots failed")
    text = summary(result)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
