"""Where a decode step's time goes on the GPU: step times against the roofline, and a torch
profiler breakdown of the kernels of graph-replayed decode steps, grouped by what they do.

A Llama-3.1-8B-shaped model (random bf16 weights, drawn on the GPU) decodes batches of one-token
requests over a ``--context``-token cache through ``TorchModelEngine.launch``, exactly as the
executor drives it (the decode CUDA graph, the LM head and the pick inside it; the engine's fused
decoder layers, ``models/fused_layers.py``, unless ``--unfused``). For each batch size: the
median device time of a step (CUDA events), its floors at the copy bandwidth measured in the same
run (every weight read once, ``weight_floor_ms``: the batch-1 goal's roofline; and every weight
plus every cached K/V byte, ``floor_ms``) and, for ``--profile`` sizes, the kernel breakdown over
``--profile-steps`` steps: per group, the summed kernel time, its share of the step, the kernels
launched per step (and per layer), and the GPU idle time between kernels (gaps inside the graph)::

    PYTHONPATH=. python3 -m benchmarks.gpu.decode_profile --out OUT [--batches 1,16,64,256]
        [--context 1024] [--profile 1,64] [--kv-cache-dtype auto|fp8] [--vocab-size 128256] [--unfused]

Writes ``OUT/decode_profile[_fp8][_unfused].json`` and prints a table per profiled size.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import BlockAllocator, fill_random, measure_ceilings, model_shape, synthetic_inputs
from benchmarks.replay.cost_model import ForwardShape
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager

logger = logging.getLogger(__name__)

# Kernel name -> group, first match wins (cuBLAS / CUTLASS GEMMs, our Triton kernels, torch's elementwise).
GROUPS = (
    ("memcpy/memset", re.compile(r"^mem(cpy|set)", re.I)),  # the step's input copies (not kernels of the graph)
    ("attention", re.compile(r"_decode_kernel|_fp8_scores_kernel|_combine_kernel|_context_kernel|paged_decode|"
                             r"decode_attention|_attn|flash|reduce_splits", re.I)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|cublas|ampere_|sm80_|nvjet|splitk", re.I)),
    ("rope + kv write", re.compile(r"rope|rotary|index_put|scatter|index_copy|indexing_backward|put_", re.I)),
    ("norm", re.compile(r"rms|norm|rsqrt", re.I)),
    ("argmax/sample", re.compile(r"argmax|arg_max|reduce_kernel.*(max|Max)|topk|sort|multinomial|exponential|softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|silu|mul|add|copy|cat|fill", re.I)),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def build_engine(args: argparse.Namespace, max_batch_size: int) -> TorchModelEngine:
    if args.unfused:  # the engine's own choice overridden, to measure what the fused layers buy
        from tensorrt_llm._torch.pyexecutor.engine import torch_engine

        torch_engine.fuse_decoder_layers = lambda model: 0
    preset = MODEL_PRESETS["llama-3.1-8b-random"]
    config = dataclasses.replace(preset, vocab_size=args.vocab_size)
    model = LlamaForCausalLM(config, device=torch.device("cuda"))
    blocks_needed = max_batch_size * (-(-(args.context + 2) // 32)) + 64
    executor = ExecutorConfig(
        max_batch_size=max_batch_size, max_num_tokens=max(8192, max_batch_size), max_seq_len=args.context + 64,
        kv_cache_config=KvCacheConfig(tokens_per_block=32, num_blocks=blocks_needed, dtype=args.kv_cache_dtype),
        cuda_graph_config=CudaGraphConfig(),
    )
    kv = create_kv_cache_manager(executor, model=model)
    engine = TorchModelEngine(model, executor.max_num_tokens, kv, cuda_graph_config=executor.cuda_graph_config,
                              max_batch_size=max_batch_size, max_seq_len=executor.max_seq_len)
    engine.time_forwards = True
    fill_random(kv.storage.pools)
    return engine


def step_times(engine: TorchModelEngine, inputs, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 3):
        pending = engine.launch(inputs)
        pending.result()
        if i >= 3:
            times.append(pending.device_time_ms())
    return times


def profile_steps(engine: TorchModelEngine, inputs, steps: int) -> dict:
    """Kernel time per group over ``steps`` launches (graph replays), and the idle time between
    the first kernel and the last not covered by any kernel (:func:`kernel_breakdown`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.launch(inputs).result()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.launch(inputs).result()
        torch.cuda.synchronize()
    return {"steps": steps, **kernel_breakdown(prof.events(), steps)}


def kernel_breakdown(events, steps: int) -> dict:
    """The CUDA kernels among a profiler's ``events``, per step (divided by ``steps``): their summed
    time, by group (:data:`GROUPS`) and by name (the 25 longest), how many were launched, and the
    GPU's idle time between the first kernel and the last (time no kernel covers)."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = max(steps, 1)
    by_group: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    launches: dict[str, int] = collections.defaultdict(int)
    spans = []
    for e in kernels:
        us = e.time_range.elapsed_us()
        by_group[group_of(e.name)] += us
        launches[group_of(e.name)] += 1
        by_name[e.name][0] += us
        by_name[e.name][1] += 1
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, None
    first = spans[0][0] if spans else 0
    last = max((s[1] for s in spans), default=0)
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    total = sum(by_group.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "kernel_us_per_step": total / steps,
        "span_us_per_step": (last - first) / steps,
        "idle_us_per_step": ((last - first) - busy) / steps,
        "groups_us_per_step": {g: v / steps for g, v in sorted(by_group.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": len(kernels) / steps,
        "kernels_per_step_by_group": {g: n / steps for g, n in sorted(launches.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:140], "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for n, v in top],
    }


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_tb_s_read_plus_write"] * 1e12
    batches = [int(b) for b in args.batches.split(",")]
    profiled = {int(b) for b in args.profile.split(",") if b}
    engine = build_engine(args, max(batches))
    shape_m = model_shape(engine.model.config)
    weight_bytes = shape_m.forward_weight_bytes()
    kv_bytes_token = engine.kv_cache_manager.storage.bytes_per_token
    fused = type(engine.model.model.layers[0]).__name__ == "FusedDecoderLayer"
    allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
    result = {"config": vars(args), "ceilings": ceilings, "weight_bytes": weight_bytes, "fused_layers": fused,
              "kv_bytes_per_token": kv_bytes_token, "device": torch.cuda.get_device_name(), "rows": []}
    for batch in batches:
        shape = ForwardShape(decodes=((1, args.context - 1),) * batch)
        inputs = synthetic_inputs(shape, allocator, engine.kv_cache_manager.tokens_per_block, engine.vocab_size)
        times = sorted(step_times(engine, inputs, args.repeats))
        median = times[len(times) // 2]
        floor_bytes = weight_bytes + batch * args.context * kv_bytes_token
        floor_ms = floor_bytes / bandwidth * 1e3
        weight_floor_ms = weight_bytes / bandwidth * 1e3
        row = {"batch": batch, "context": args.context, "step_ms": median, "min_ms": times[0],
               "floor_ms": floor_ms, "roofline_fraction": floor_ms / median,
               "weight_floor_ms": weight_floor_ms, "weight_roofline_fraction": weight_floor_ms / median,
               "tb_s": floor_bytes / (median * 1e-3) / 1e12}
        if batch in profiled:
            row["profile"] = profile_steps(engine, inputs, args.profile_steps)
            row["profile"]["kernels_per_layer"] = row["profile"]["kernels_per_step"] / shape_m.num_layers
        result["rows"].append(row)
        print(f"batch {batch:4d} x {args.context} ({args.kv_cache_dtype}, {'fused' if fused else 'unfused'}): "
              f"{median:7.3f} ms; floor {floor_ms:6.3f} ms at {bandwidth / 1e12:.2f} TB/s: {100 * floor_ms / median:5.1f}% "
              f"of roofline (weights alone {100 * weight_floor_ms / median:5.1f}%)", flush=True)
    return result


def summary(result: dict) -> str:
    lines = []
    for row in result["rows"]:
        prof = row.get("profile")
        if not prof:
            continue
        lines.append(f"== batch {row['batch']} x {row['context']}: step {row['step_ms']:.3f} ms, kernels "
                     f"{prof['kernel_us_per_step'] / 1e3:.3f} ms, idle inside {prof['idle_us_per_step'] / 1e3:.3f} ms, "
                     f"{prof['kernels_per_step']:.0f} kernels a step ({prof['kernels_per_layer']:.1f} a layer)")
        counts = prof.get("kernels_per_step_by_group", {})
        for group, us in prof["groups_us_per_step"].items():
            lines.append(f"   {group:16s} {us / 1e3:7.3f} ms  {100 * us / prof['kernel_us_per_step']:5.1f}%  "
                         f"{counts.get(group, 0):6.0f} kernels")
        for k in prof["top_kernels"][:10]:
            lines.append(f"   {k['us_per_step']:8.1f} us x{k['calls_per_step']:5.1f}  {k['name'][:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--profile", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--unfused", action="store_true", help="the plain decoder layers (what the fused ones replace)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = run(args)
    result["wall_s"] = time.time() - t0
    suffix = ("" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}") + ("_unfused" if args.unfused else "")
    (args.out / f"decode_profile{suffix}.json").write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
