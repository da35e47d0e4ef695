"""Phase B on the GPU: the replay of every policy on the engine, the overlap scheduler's
effect on GPU idle time, and the simulator's cost model against every iteration of a GPU replay.

    PYTHONPATH=. python -m benchmarks.gpu.phase_b --out DIR [--requests 150] [--time-scale 1.0]
        [--policies none,fit,recheck,claim] [--sections decode,replay] [--budget-s 480] [--quick]

Sections (each guarded: a failure is recorded and the next section runs):

* ``decode``: 64 requests decoding together (context ``--decode-context``) through the real
  ``PyExecutor``, with and without the overlap scheduler. GPU idle time between forwards as a
  fraction of wall time, from CUDA events around every forward (first kernel to greedy pick):
  ``idle = 1 - sum(forward device time) / (last end - first start)`` over the steady decode steps.
* ``replay``: the default scenario's first ``--requests`` requests (``benchmarks.replay``'s
  settings; ``mistral-nemo-12b-random`` on the GPU, overlap on as upstream) under each policy,
  ``recheck`` again without overlap, and the same trace on ``--engine sim``. The replay JSONs
  keep docs/design.md §5's schema (``replay_gpu.json``, ``replay_sim.json``). Each GPU forward's shape
  and device time is recorded: the idle fraction of each run, and for ``recheck`` (overlap) the
  per-iteration table the cost model is checked on — the default fitted model, the roofline,
  and the model refitted (``cost_model.refit_to_iterations``) on half of the iterations and
  checked on the other half, and on the other policies' iterations; also against
  ``../shared/calibration/`` (the shared table's rows against the models).

``--quick`` runs a tiny model on whatever device there is (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.replay import cost_model as cm
from benchmarks.gpu.common import quantile, summary_footer
from benchmarks.replay.cli import TraceSpec, replay_trace
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.sim_engine import Engine, forward_shape, torch_model
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

logger = logging.getLogger("gpu_phase_b")

SHARED_TABLE_NAMES = ("shared/calibration/h200_mistral_nemo_12b.json", "../shared/calibration/h200_mistral_nemo_12b.json")


# ---- recording forwards ------------------------------------------------------------------


@dataclass(slots=True)
class Forward:
    shape: cm.ForwardShape
    events: tuple | None  # (start, end) CUDA events; not the PendingForward (it holds the logits)
    num_requests: int
    decode_only: bool
    host_t: float  # perf_counter at launch
    idle_jumps: int = 0  # times the replay found the executor without work before this launch


def record_forwards(engine, into: list[Forward], clock=None) -> None:
    """Time every forward of ``engine`` (CUDA events) and keep its shape (what the cost model
    prices). ``clock``: the replay's clock; its jumps over idle time (the executor had no work)
    are counted, so that a gap between two forwards can be told apart from a gap without work."""
    engine.time_forwards = engine.device.type == "cuda"
    launch = engine._launch
    jumps = [0]
    if clock is not None:
        advance_to = clock.advance_to

        def counted(when):
            if when > clock():
                jumps[0] += 1
            advance_to(when)

        clock.advance_to = counted

    def recorded(inputs):
        shape = forward_shape(inputs)  # before launch: the executor moves requests on after it
        pending = launch(inputs)
        decode_only = all(n == 1 for n in inputs.num_new_tokens) and not shape.contexts
        events = getattr(pending, "events", None)  # only a CUDA forward is timed (the --quick CPU check is not)
        into.append(Forward(shape, events, len(inputs.requests), decode_only, time.perf_counter(), jumps[0]))
        return pending

    engine._launch = recorded


def idle_fraction(forwards: list[Forward]) -> dict:
    """GPU idle between forwards as a share of the span from the first forward's start to the
    last one's end, from each forward's (start, end) CUDA events."""
    timed = [f for f in forwards if f.events is not None]
    if len(timed) < 2:
        return {"n": len(timed)}
    torch.cuda.synchronize()
    first, last = timed[0].events, timed[-1].events
    span = first[0].elapsed_time(last[1])
    busy = sum(f.events[0].elapsed_time(f.events[1]) for f in timed)
    gaps = [a.events[1].elapsed_time(b.events[0]) for a, b in zip(timed, timed[1:])]
    # Gaps in which the executor had no work (the replay jumped its clock to the next arrival)
    # are not the scheduler's: the GPU had nothing to run.
    no_work = [g for g, a, b in zip(gaps, timed, timed[1:]) if a.idle_jumps != b.idle_jumps]
    with_work = span - sum(no_work)
    top = sorted(zip(gaps, timed, timed[1:]), key=lambda x: -x[0])[:12]
    return {"n": len(timed), "span_ms": span, "busy_ms": busy, "idle_fraction": max(0.0, 1 - busy / span),
            "idle_fraction_with_work": max(0.0, 1 - busy / with_work) if with_work > 0 else None,
            "gaps_without_work": {"n": len(no_work), "ms": sum(no_work)},
            "largest_gaps": [{"gap_ms": g, "after": _kind(a), "before": _kind(b), "without_work": a.idle_jumps != b.idle_jumps}
                             for g, a, b in top],
            "gap_ms": {"p50": quantile(gaps, 0.5), "p90": quantile(gaps, 0.9), "max": max(gaps)},
            "forward_ms_p50": quantile([f.events[0].elapsed_time(f.events[1]) for f in timed], 0.5)}


# ---- decode batch 64 ---------------------------------------------------------------------


def _kind(f: Forward) -> str:
    what = "decode" if f.decode_only else f"mixed ({len(f.shape.contexts)} chunks)"
    return f"{what}, {f.num_requests} requests, {f.shape.num_tokens} tokens"


def decode_batch(model, *, overlap: bool, batch: int = 64, context: int = 2048, steps: int = 96, vocab: int = 32000) -> dict:
    """``batch`` requests of ``context`` prompt tokens each generating ``steps`` tokens; the
    idle fraction over the steady decode steps (all ``batch`` requests decoding)."""
    tpb = 32
    per_request = -(-(context + steps + 1) // tpb)
    config = ExecutorConfig(
        max_batch_size=batch, max_num_tokens=8192, max_seq_len=context + steps + 1, enable_chunked_prefill=True,
        kv_cache_config=KvCacheConfig(tokens_per_block=tpb, num_blocks=batch * per_request + 16, enable_block_reuse=False),
        disable_overlap_scheduler=not overlap,
    )
    executor = create_py_executor(config, model=model)
    forwards: list[Forward] = []
    record_forwards(executor.model_engine, forwards)
    vocab = min(vocab, model.config.vocab_size)
    for i in range(batch):
        prompt = [1 + (i * 7919 + j * 104729) % (vocab - 1) for j in range(context)]
        executor.enqueue_request(LlmRequest(input_token_ids=prompt, max_new_tokens=steps, sampling_config=SamplingConfig()))
    start = time.perf_counter()
    executor.run_until_idle()
    wall = time.perf_counter() - start
    steady = [f for f in forwards if f.decode_only and f.num_requests == batch][4:-2]
    out = {"overlap": executor.overlap, "batch": batch, "context": context, "steps": steps,
           "forwards": len(forwards), "steady_decode_steps": len(steady), "wall_s": wall,
           "idle": idle_fraction(steady)}
    if len(steady) >= 2:
        host = [b.host_t - a.host_t for a, b in zip(steady, steady[1:])]
        out["step_wall_ms_p50"] = 1e3 * quantile(host, 0.5)
        out["decode_tokens_per_s"] = batch / quantile(host, 0.5)
    del executor
    gc.collect()
    return out


# ---- the replay ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordedSettings(ReplaySettings):
    """Replay settings whose torch engine records every forward (per policy, in ``recorded``)."""

    recorded: dict = field(default_factory=dict, compare=False)
    tag: str = ""

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        engine = ReplaySettings.build_engine(self, policy, max_seq_len)
        key = self.tag + policy
        if self.engine == "torch" and key not in self.recorded:  # not the probe that only describes
            record_forwards(engine.executor.model_engine, self.recorded.setdefault(key, []), engine.clock)
        return engine


def per_iteration(forwards: list[Forward], models: dict) -> list[dict]:
    rows = []
    for f in forwards:
        events = f.events
        row = {"tokens": f.shape.num_tokens, "contexts": [list(c) for c in f.shape.contexts],
               "decodes": [c for _, c in f.shape.decodes],
               "device_ms": events[0].elapsed_time(events[1]) if events is not None else None}
        for name, model in models.items():
            row[f"{name}_ms"] = model.forward_time_s(f.shape) * 1e3
        rows.append(row)
    return rows


def add_host_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-cache-blocks`` and ``--offload-ahead-blocks``: the host tier the GPU replays run with."""
    parser.add_argument("--host-cache-blocks", type=int, default=ReplaySettings.host_cache_blocks,
                        help="the host (offload) tier in blocks; 0 turns it off, to tell its copies' share of a gap")
    parser.add_argument("--offload-ahead-blocks", type=int, default=0,
                        help="KvCacheConfig.offload_ahead_blocks: primary blocks kept free by offloading after each launch")


def host_tier_kv_config(args: argparse.Namespace) -> dict:
    """The ``kv_cache_config`` keys that :func:`add_host_tier_arguments`' flags set."""
    return {"offload_ahead_blocks": args.offload_ahead_blocks}


def replay_section(args, out_dir: Path, t0: float) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    model_name = "tiny-random" if args.quick else args.model
    spec = TraceSpec(num_requests=args.requests, time_scale=args.time_scale)
    trace = spec.load_for(vocab_size=32000 if not args.quick else 500, tokens_per_block=32)
    common = dict(max_num_tokens=args.max_num_tokens, host_cache_blocks=args.host_cache_blocks,
                  kv_cache_config={"num_blocks": args.kv_blocks, **host_tier_kv_config(args)})
    recorded: dict = {}
    # the quick CPU check runs the overlap loop too (its default is off on the CPU)
    gpu = RecordedSettings.from_options(engine="torch", model=model_name, device=device, recorded=recorded,
                                        disable_overlap_scheduler=False if args.quick else None, **common)
    policies = args.policies
    result: dict = {"trace": {"requests": len(trace), "time_scale": args.time_scale,
                              "prompt_tokens": sum(r.input_len for r in trace.requests),
                              "output_tokens": sum(r.output_len for r in trace.requests)}}
    start = time.perf_counter()
    gpu_run = replay_trace(trace, gpu, policies, spec=spec, progress=False)
    result["gpu_replay_s"] = time.perf_counter() - start
    (out_dir / "replay_gpu.json").write_text(json.dumps(gpu_run.to_json(), indent=2, default=str))
    result["gpu"] = {name: run.metrics for name, run in gpu_run.runs.items()}
    result["config"] = gpu_run.config
    sim_run = replay_trace(trace, ReplaySettings.from_options(engine="sim", **common), policies, spec=spec, progress=False)
    (out_dir / "replay_sim.json").write_text(json.dumps(sim_run.to_json(), indent=2, default=str))
    result["sim"] = {name: run.metrics for name, run in sim_run.runs.items()}
    result["idle"] = {name: idle_fraction(forwards) for name, forwards in recorded.items()}
    if "recheck" in policies and time.perf_counter() - t0 < args.budget_s:
        plain = RecordedSettings.from_options(engine="torch", model=model_name, device=device, recorded=recorded,
                                              disable_overlap_scheduler=True, tag="no-overlap ", **common)
        start = time.perf_counter()
        plain_run = replay_trace(trace, plain, ["recheck"], spec=spec, progress=False)
        result["gpu_no_overlap"] = {"recheck": plain_run.runs["recheck"].metrics,
                                    "replay_s": time.perf_counter() - start}
        result["idle"]["no-overlap recheck"] = idle_fraction(recorded["no-overlap recheck"])
    # The simulator against the engine: every iteration of each GPU replay.
    models = {"fitted": cm.default_cost_model(), "roofline": cm.RooflineCostModel()}
    result["per_iteration"] = {name: per_iteration(forwards, models) for name, forwards in recorded.items()}
    result["errors"] = {}
    for name, rows in result["per_iteration"].items():
        measured = [r for r in rows if r["device_ms"]]
        result["errors"][name] = {m: cm.relative_errors([r[f"{m}_ms"] for r in measured], [r["device_ms"] for r in measured])
                                  for m in models}
    main_rows = result["per_iteration"].get("recheck") or next(iter(result["per_iteration"].values()), [])
    refit = {}
    try:
        model, held_out = cm.refit_to_iterations(main_rows)
        refit = {"model": model.describe(), "held_out_half": held_out, "other_replays": {}}
        for name, rows in result["per_iteration"].items():
            if name != "recheck":
                measured = [r for r in rows if r["device_ms"]]
                refit["other_replays"][name] = cm.relative_errors(
                    [model.forward_time_s(cm.iteration_shape(r)) * 1e3 for r in measured], [r["device_ms"] for r in measured])
        model.save(out_dir / "refit_cost_model.json")
        table = _shared_table()
        if table is not None:
            rows = json.loads(table.read_text())["rows"]
            shapes = [cm.table_row_shape(r) for r in rows]
            measured = [r["ms"] for r in rows]
            refit["shared_calibration"] = {
                "table": str(table), "rows": len(rows),
                "fitted_default": cm.relative_errors([models["fitted"].forward_time_s(s) * 1e3 for s in shapes], measured),
                "refit": cm.relative_errors([model.forward_time_s(s) * 1e3 for s in shapes], measured),
                "roofline": cm.relative_errors([models["roofline"].forward_time_s(s) * 1e3 for s in shapes], measured),
            }
    except Exception as error:  # too few iterations (quick run) or a fit that failed: recorded
        refit = {"error": repr(error)}
    result["refit"] = refit
    return result


def _shared_table() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    for name in SHARED_TABLE_NAMES:
        for base in (here, Path.cwd()):
            if (base / name).exists():
                return base / name
    return None


# ---- report --------------------------------------------------------------------------------


def summary(result: dict) -> str:
    lines = []
    for row in result["sections"].get("decode", {}).get("runs", []):
        idle = row["idle"]
        if idle.get("n", 0) >= 2:
            lines.append(f"decode {row['batch']}x{row['context']} overlap={row['overlap']}: GPU idle "
                         f"{idle['idle_fraction']:.1%} of wall, gap p50 {idle['gap_ms']['p50']:.2f} ms, forward p50 "
                         f"{idle['forward_ms_p50']:.2f} ms, step wall p50 {row.get('step_wall_ms_p50', float('nan')):.2f} ms")
    rep = result["sections"].get("replay", {})
    for engine in ("gpu", "sim"):
        for name, m in rep.get(engine, {}).items():
            lines.append(f"{engine} {name}: {m['completed']}/{m['requests']} crashed={m['crashed']} overshoots="
                         f"{m['overshoots']} TTFT p50/p99 {m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f} ms TPOT p50 "
                         f"{m['tpot_ms']['p50']:.1f} ms {m['output_tokens_per_s']:.0f} tok/s max fwd {m['max_forward_tokens']}")
    if rep.get("gpu_no_overlap"):
        m = rep["gpu_no_overlap"]["recheck"]
        lines.append(f"gpu recheck without overlap: TTFT p50/p99 {m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f} ms "
                     f"TPOT p50 {m['tpot_ms']['p50']:.1f} ms {m['output_tokens_per_s']:.0f} tok/s")
    for name, idle in rep.get("idle", {}).items():
        if idle.get("n", 0) >= 2:
            with_work = idle.get("idle_fraction_with_work")
            lines.append(f"replay {name}: GPU idle {idle['idle_fraction']:.1%} ("
                         f"{'n/a' if with_work is None else format(with_work, '.1%')} while the executor had work, "
                         f"{idle['gaps_without_work']['n']} gaps without work: {idle['gaps_without_work']['ms']:.0f} ms), "
                         f"gap p50 {idle['gap_ms']['p50']:.2f} ms "
                         f"p90 {idle['gap_ms']['p90']:.2f} ms over {idle['n']} forwards")
    for gap in rep.get("idle", {}).get("recheck", {}).get("largest_gaps", [])[:6]:
        lines.append(f"  recheck gap {gap['gap_ms']:.1f} ms after [{gap['after']}] before [{gap['before']}]"
                     f"{' (no work)' if gap['without_work'] else ''}")
    for name, errs in rep.get("errors", {}).items():
        for model, e in errs.items():
            if e.get("n"):
                lines.append(f"sim vs engine ({name}), {model}: median {e['median_rel_err']:.1%} p90 {e['p90_rel_err']:.1%} (n={e['n']})")
    refit = rep.get("refit", {})
    if refit.get("held_out_half", {}).get("n"):
        e = refit["held_out_half"]
        lines.append(f"refit on half of recheck's iterations, other half: median {e['median_rel_err']:.1%} p90 {e['p90_rel_err']:.1%}")
        for name, e in refit.get("other_replays", {}).items():
            if e.get("n"):
                lines.append(f"  refit on {name}: median {e['median_rel_err']:.1%} p90 {e['p90_rel_err']:.1%}")
        for name, e in refit.get("shared_calibration", {}).items():
            if isinstance(e, dict) and e.get("n"):
                lines.append(f"  shared calibration vs {name}: median {e['median_rel_err']:.1%} p90 {e['p90_rel_err']:.1%}")
    lines.extend(summary_footer(result))
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = result["sections"].get("replay", {})
    rows = rep.get("per_iteration", {}).get("recheck", [])
    rows = [r for r in rows if r["device_ms"]]
    if rows:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        measured = [r["device_ms"] for r in rows]
        for name, marker in (("fitted", "o"), ("roofline", "x")):
            ax[0].scatter(measured, [r[f"{name}_ms"] for r in rows], s=6, marker=marker, label=name, alpha=0.6)
        hi = max(measured) * 1.1
        ax[0].plot([0, hi], [0, hi], "k--", lw=0.8)
        ax[0].set_xscale("log"); ax[0].set_yscale("log")
        ax[0].set_xlabel("measured device ms (H200)"); ax[0].set_ylabel("predicted ms"); ax[0].legend()
        ax[0].set_title("cost model vs engine, every iteration (recheck)")
        gaps = {}
        for name, idle in rep.get("idle", {}).items():
            if idle.get("n", 0) >= 2:
                gaps[name] = 100 * idle["idle_fraction"]
        for row in result["sections"].get("decode", {}).get("runs", []):
            if row["idle"].get("n", 0) >= 2:
                gaps[f"decode 64 overlap={row['overlap']}"] = 100 * row["idle"]["idle_fraction"]
        ax[1].barh(list(gaps), list(gaps.values()))
        ax[1].axvline(5, color="r", ls="--", lw=0.8)
        ax[1].set_xlabel("GPU idle between forwards, % of wall")
        ax[1].set_title("overlap scheduler")
        fig.tight_layout()
        fig.savefig(out_dir / "phase_b.png", dpi=120)
        plt.close(fig)


# ---- main ------------------------------------------------------------------------------------


def run(args) -> dict:
    t0 = time.perf_counter()
    out_dir = Path(args.out)
    result: dict = {"command": " ".join(["python -m benchmarks.gpu.phase_b", *sys.argv[1:]]), "quick": args.quick,
                    "torch": torch.__version__, "sections": {}}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()

    def section(name, fn):
        if name not in args.sections:
            return
        if time.perf_counter() - t0 > args.budget_s:
            result["sections"][name] = {"skipped": "budget"}
            return
        start = time.perf_counter()
        try:
            result["sections"][name] = fn()
        except Exception as error:
            logger.exception("section %s failed", name)
            result["sections"][name] = {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}
        result["sections"][name]["section_seconds"] = time.perf_counter() - start
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def decode() -> dict:
        device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
        model = torch_model("tiny-random" if args.quick else args.model, device)
        context, steps = (64, 12) if args.quick else (args.decode_context, 96)
        if args.quick:  # the overlap loop on the CPU (off there by default)
            return {"runs": [decode_batch(model, overlap=o, context=context, steps=steps, vocab=500) for o in (True, False)]}
        return {"runs": [decode_batch(model, overlap=o, context=context, steps=steps) for o in (True, False)]}

    section("decode", decode)
    section("replay", lambda: replay_section(args, out_dir, t0))
    result["total_seconds"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="mistral-nemo-12b-random")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-num-tokens", type=int, default=4096)
    p.add_argument("--kv-blocks", type=int, default=ReplaySettings().executor.kv_cache_config.num_blocks)
    add_host_tier_arguments(p)
    p.add_argument("--policies", type=lambda s: s.split(","), default=["none", "fit", "recheck", "claim"])
    p.add_argument("--sections", type=lambda s: s.split(","), default=["decode", "replay"])
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    text = summary(result)
    print(text)
    (Path(args.out) / "summary_b.txt").write_text(text + "\n")
    (Path(args.out) / "gpu_phase_b.json").write_text(json.dumps(result, indent=1, default=str))
    try:
        plot(result, Path(args.out))
    except Exception:
        logger.exception("plot failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
