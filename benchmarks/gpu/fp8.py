"""The FP8 KV cache on a GPU: what it buys in decode time and in serving, against bf16.

Two sections, each writing ``OUT/gpu_fp8_<section>.json``:

* ``decode``: the decode step of ``mistral-nemo-12b-random`` at 64 x 8k and 256 x 2k (CUDA
  graphs, through ``TorchModelEngine.launch`` as the executor drives it), over a bf16 pool and
  over an FP8 pool, against each one's bandwidth roofline (weights once, cached K/V once, at the
  copy bandwidth measured in the same run); and the paged decode kernel alone over one layer's
  pools, bf16 against FP8, as read bandwidth. An FP8 pool reads half the K/V bytes: at 64 x 8k
  the K/V is 80 GiB in bf16 against 24.5 GB of weights, so the step's floor falls by ~40%.
* ``kernel``: the paged decode kernel alone over one layer's pools (32 query heads, 8 KV heads of
  128, blocks of 32 in a random order), bf16 against FP8, at 64 x 8k and 256 x 2k: time and the
  bytes of K/V read per second, for each pool's own kernel shape (``triton_paged_decode.config_for``)
  and a sweep of the others (tile, warps, stages, table read ahead, twice the splits), so that one
  run shows whether the default is the best shape on the machine. No model is built (~1 min).
  Times are a call's device time with 20 calls queued back to back (``common.time_queued_ms``);
  ``alone_ms`` is a call timed alone, its launch included, as runs before December 2026 reported.
* ``layout``: the kernel with 8 KV heads against 1 (8 times the sequences: the same bytes), bf16 and
  FP8: whether the FP8 kernel is held back by 128-byte runs of one head's row (``layout_section``).
* ``replay``: the default scenario's replay on the engine (``recheck``) with the same pool bytes
  in bf16 (``--kv-blocks``) and in FP8 (twice the blocks; the host tier, given in bf16 blocks'
  bytes, holds twice the blocks too): prefix-hit tokens, deferrals, TTFT p50 / p99, output tok/s.

    python -m benchmarks.gpu.fp8 --out OUT --sections kernel         # ~1 min on an H200
    python -m benchmarks.gpu.fp8 --out OUT --sections layout         # ~30 s
    python -m benchmarks.gpu.fp8 --out OUT --sections decode         # ~3 min on an H200
    python -m benchmarks.gpu.fp8 --out OUT --sections replay --requests 150 [--kv-blocks 1280]
    python -m benchmarks.gpu.fp8 --out OUT --quick                     # the CPU, tiny shapes: checks the script

Preconditions (a GPU, unless ``--quick``; enough free memory for the pools) are checked first.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.replay.cost_model import ForwardShape
from benchmarks.gpu.common import BlockAllocator, fill_random, measure_ceilings, model_shape, time_ms, time_queued_ms
from benchmarks.gpu.forward import time_forward
from benchmarks.replay.cli import TraceSpec, replay_trace
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.sim_engine import Engine
from tensorrt_llm._torch.attention_backend.kv_quant import kv_cache_dtype
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager

logger = logging.getLogger("gpu_fp8")

KV_DTYPES = ("auto", "fp8")


# ---- decode --------------------------------------------------------------------------------


def decode_cases(quick: bool) -> dict[str, ForwardShape]:
    if quick:
        return {"decode_4x256": ForwardShape(decodes=((1, 255),) * 4), "decode_8x128": ForwardShape(decodes=((1, 127),) * 8)}
    return {"decode_64x8k": ForwardShape(decodes=((1, 8191),) * 64), "decode_256x2k": ForwardShape(decodes=((1, 2047),) * 256)}


def build_engine(model: LlamaForCausalLM, kv_dtype: str, num_blocks: int, max_batch_size: int, max_seq_len: int,
                 tokens_per_block: int = 32) -> TorchModelEngine:
    config = ExecutorConfig(max_batch_size=max_batch_size, max_num_tokens=max(2048, max_batch_size),
                            max_seq_len=max_seq_len, cuda_graph_config=CudaGraphConfig(capture_num_tokens=[]),
                            kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, num_blocks=num_blocks,
                                                          dtype=kv_dtype))
    kv = create_kv_cache_manager(config, model=model)
    engine = TorchModelEngine(model, config.max_num_tokens, kv, cuda_graph_config=config.cuda_graph_config,
                              max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    engine.time_forwards = model.device.type == "cuda"
    fill_random(kv.storage.pools)
    return engine


def kernel_bandwidth(model: LlamaForCausalLM, shape: ForwardShape, kv_dtype: str, device: torch.device) -> dict:
    """The paged decode kernel over one layer's pools of ``shape``'s K/V: time and read bandwidth."""
    from tensorrt_llm._torch.attention_backend.kernels import decode_attention
    from tensorrt_llm._torch.attention_backend.paged import decode_num_splits, num_sms

    config = model.config
    tpb, batch = 32, len(shape.decodes)
    context = shape.decodes[0][1] + 1
    blocks = batch * -(-context // tpb)
    dtype = kv_cache_dtype(kv_dtype, config.torch_dtype)
    k = torch.randn(blocks * tpb, config.num_kv_heads, config.head_dim, device=device).to(dtype)
    v = torch.randn(blocks * tpb, config.num_kv_heads, config.head_dim, device=device).to(dtype)
    tables = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, config.num_heads, config.head_dim, device=device, dtype=config.torch_dtype)
    out = torch.empty_like(q)
    rows = torch.arange(batch, device=device)
    splits = decode_num_splits(batch, config.num_kv_heads, num_sms(device))
    timed = time_queued_ms(lambda: decode_attention(q, k, v, out, rows, tables, seq_lens, tokens_per_block=tpb,
                                                    scale=config.head_dim**-0.5, num_splits=splits), device,
                           warmup=3, repeats=10)
    nbytes = 2 * batch * context * config.num_kv_heads * config.head_dim * k.element_size()
    return {**timed, "kv_bytes": nbytes, "tb_s": nbytes / (timed["ms"] * 1e-3) / 1e12}


def decode_section(args, device: torch.device) -> dict:
    model_name = "tiny-random" if args.quick else args.model
    config = MODEL_PRESETS[model_name]
    if args.quick:
        config = dataclasses.replace(config, dtype="float32")
    model = LlamaForCausalLM(config, device=device)
    shape_m = model_shape(config)
    ceilings = measure_ceilings(device)
    bandwidth = ceilings.get("copy_tb_s_read_plus_write", 4.2) * 1e12  # bytes/s, read + write counted
    cases = decode_cases(args.quick)
    tokens = max(sum(n + c for n, c in s.decodes) for s in cases.values())
    batch = max(len(s.decodes) for s in cases.values())
    max_seq_len = max(c + n for s in cases.values() for n, c in s.decodes) + 64
    num_blocks = -(-tokens // 32) + 2 * batch
    result: dict = {"model": model_name, "ceilings": ceilings, "num_blocks": num_blocks, "cases": {}}
    for kv_dtype in KV_DTYPES:
        engine = build_engine(model, kv_dtype, num_blocks, batch, max_seq_len)
        per_token = engine.kv_cache_manager.storage.bytes_per_token
        allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
        for name, shape in cases.items():
            timed = time_forward(engine, shape, allocator, graphs=engine.graph_runner is not None)
            cached = sum(c for _, c in shape.decodes)
            nbytes = shape_m.forward_weight_bytes() + cached * per_token
            floor_ms = nbytes / bandwidth * 1e3
            entry = result["cases"].setdefault(name, {})
            entry[kv_dtype] = {**timed, "kv_bytes_per_token": per_token, "bytes": nbytes, "roofline_ms": floor_ms,
                               "x_roofline": timed["device_ms"] / floor_ms,
                               "tb_s": nbytes / (timed["device_ms"] * 1e-3) / 1e12,
                               "kernel": kernel_bandwidth(model, shape, kv_dtype, device)}
            logger.info("%s %s: %.2f ms (%.2fx its roofline %.2f ms); one layer's decode kernel %.3f ms, %.2f TB/s",
                        name, kv_dtype, timed["device_ms"], entry[kv_dtype]["x_roofline"], floor_ms,
                        entry[kv_dtype]["kernel"]["ms"], entry[kv_dtype]["kernel"]["tb_s"])
        del engine, allocator
        gc.collect()  # the graphs and the plans hold the pools in cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for entry in result["cases"].values():
        entry["fp8_over_bf16"] = entry["fp8"]["device_ms"] / entry["auto"]["device_ms"]
        entry["kernel_fp8_over_bf16"] = entry["fp8"]["kernel"]["ms"] / entry["auto"]["kernel"]["ms"]
    return result


# ---- kernel --------------------------------------------------------------------------------

# Shapes the sweep times beside each pool's default: (block_n, num_warps, num_stages, table_ahead);
# FP8's with the default split count and twice it, bf16's (measured at 1.08x its roofline) a few.
SWEEP = {"fp8": ((64, 4, 3, False), (64, 4, 3, True), (64, 4, 4, True), (128, 4, 3, False), (128, 4, 3, True),
                 (64, 8, 3, True), (128, 8, 3, True), (128, 4, 4, True), (256, 8, 3, True)),
         "bfloat16": ((64, 4, 3, False), (64, 4, 3, True), (128, 4, 3, True))}


def kernel_section(args, device: torch.device) -> dict:
    """The decode kernel over one layer's pools, bf16 against FP8 (module docstring)."""
    from tensorrt_llm._torch.attention_backend.paged import decode_num_splits, num_sms
    from tensorrt_llm._torch.attention_backend.triton_paged_decode import DecodeConfig, config_for, paged_decode_attention

    hq, hkv, d, tpb = (4, 2, 16, 16) if args.quick else (32, 8, 128, 32)
    shapes = {"64x8k": (64, 8192), "256x2k": (256, 2048)} if not args.quick else {"4x256": (4, 256)}
    result: dict = {"heads": [hq, hkv, d], "tokens_per_block": tpb, "cases": {}}
    if args.quick:  # the CPU: the torch reference stands in for the kernel (checks the script)
        return result
    for name, (batch, context) in shapes.items():
        blocks = batch * context // tpb
        tables = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        rows = torch.arange(batch, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        splits = decode_num_splits(batch, hkv, num_sms(device))
        entry = result["cases"].setdefault(name, {"batch": batch, "context": context, "splits": splits, "runs": []})
        for kv_dtype in ("bfloat16", "fp8"):
            dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float8_e4m3fn
            k = torch.randn(blocks * tpb, hkv, d, device=device).to(dtype)
            v = torch.randn(blocks * tpb, hkv, d, device=device).to(dtype)
            nbytes = 2 * blocks * tpb * hkv * d * k.element_size()
            default = config_for(dtype)
            split_counts = (splits, 2 * splits) if kv_dtype == "fp8" else (splits,)
            shapes_tried = [(default, splits, True)] + [
                (DecodeConfig(*shape), s, False) for shape in SWEEP[kv_dtype] for s in split_counts
                if repr(DecodeConfig(*shape)) != repr(default) or s != splits]
            for config, num_splits, is_default in shapes_tried:
                def call(config=config, num_splits=num_splits):
                    paged_decode_attention(q, k, v, out, rows, tables, seq_lens, tokens_per_block=tpb, scale=d**-0.5,
                                           num_splits=num_splits, config=config, k_scale=0.5, v_scale=0.5)
                try:
                    timed = time_queued_ms(call, device, warmup=3, repeats=7)  # the kernel's device time
                    alone = time_ms(call, device, warmup=0, repeats=7)  # launch included (earlier runs' figure)
                except Exception as error:  # a shape that does not compile on this GPU (shared memory)
                    entry["runs"].append({"kv": kv_dtype, "config": repr(config), "splits": num_splits,
                                          "error": f"{type(error).__name__}: {str(error)[:200]}"})
                    continue
                run = {"kv": kv_dtype, "config": repr(config), "splits": num_splits, "default": is_default,
                       "ms": timed["ms"], "tb_s": nbytes / (timed["ms"] * 1e-3) / 1e12, "kv_bytes": nbytes,
                       "alone_ms": alone["ms"]}
                entry["runs"].append(run)
                if is_default:
                    entry[kv_dtype] = run
                    logger.info("kernel %s %s: %.3f ms, %.2f TB/s (%s, %d splits; %.3f ms a call timed alone)", name,
                                kv_dtype, run["ms"], run["tb_s"], run["config"], num_splits, run["alone_ms"])
            best = min((r for r in entry["runs"] if r["kv"] == kv_dtype and "ms" in r), key=lambda r: r["ms"])
            entry[f"best_{kv_dtype}"] = best
            del k, v
            torch.cuda.empty_cache()
        entry["fp8_over_bf16"] = entry["fp8"]["ms"] / entry["bfloat16"]["ms"]
    return result


#: the layout question (``layout_section``): one KV head's row of a slot is a run of D x bytes
#: an element in memory, the next slot's row 1 KV-head-row x Hkv further; with one KV head the
#: rows of a block are one contiguous run. (kv dtype, KV heads, sequences): the same bytes and
#: the same number of programs in each case.
LAYOUT_CASES = (("bfloat16", 8, 64), ("fp8", 8, 64), ("bfloat16", 1, 512), ("fp8", 1, 512))


def layout_section(args, device: torch.device) -> dict:
    """Is the FP8 kernel held back by the pool's layout? The kernel over 8k positions a sequence,
    group 4, head dim 128, blocks of 32 in a random order, each pool's default shape: with 8 KV
    heads a position's row of one head is 256 bytes in bf16 and 128 in FP8 (the slot's other
    heads lie between), with 1 KV head (8 times the sequences) a block's 32 rows are one run of
    8 or 4 KiB. If FP8 reads near bf16's bandwidth with one KV head and not with eight, the
    128-byte runs are what it lacks, and a head-major block layout is the next step."""
    d, group, tpb, context = (16, 2, 16, 256) if args.quick else (128, 4, 32, 8192)
    result: dict = {"head_dim": d, "group": group, "tokens_per_block": tpb, "context": context, "runs": []}
    if args.quick:  # the CPU: the kernel needs a GPU and Triton (checks the script)
        return result
    from tensorrt_llm._torch.attention_backend.paged import decode_num_splits, num_sms
    from tensorrt_llm._torch.attention_backend.triton_paged_decode import config_for, paged_decode_attention

    for kv_dtype, hkv, batch in LAYOUT_CASES:
        dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float8_e4m3fn
        blocks = batch * context // tpb
        tables = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        rows = torch.arange(batch, device=device)
        q = torch.randn(batch, hkv * group, d, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        k = torch.randn(blocks * tpb, hkv, d, device=device).to(dtype)
        v = torch.randn(blocks * tpb, hkv, d, device=device).to(dtype)
        splits = decode_num_splits(batch, hkv, num_sms(device))

        def call() -> None:
            paged_decode_attention(q, k, v, out, rows, tables, seq_lens, tokens_per_block=tpb, scale=d**-0.5,
                                   num_splits=splits, config=config_for(dtype), k_scale=0.5, v_scale=0.5)

        timed = time_queued_ms(call, device, warmup=3, repeats=7)
        nbytes = 2 * k.numel() * k.element_size()
        run = {"kv": kv_dtype, "kv_heads": hkv, "batch": batch, "splits": splits, "ms": timed["ms"],
               "tb_s": nbytes / (timed["ms"] * 1e-3) / 1e12, "kv_bytes": nbytes,
               "run_bytes": d * k.element_size() * (tpb if hkv == 1 else 1)}
        result["runs"].append(run)
        logger.info("layout %s, %d KV heads, %d sequences: %.3f ms, %.2f TB/s (runs of %d bytes)", kv_dtype, hkv,
                    batch, run["ms"], run["tb_s"], run["run_bytes"])
        del k, v, q, out
        torch.cuda.empty_cache()
    return result


# ---- replay --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CountingSettings(ReplaySettings):
    """Replay settings that keep each policy's executor (``executors``), to read its iteration
    statistics (prefix-hit tokens) after the replay."""

    executors: dict = field(default_factory=dict, compare=False)
    tag: str = ""

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        engine = ReplaySettings.build_engine(self, policy, max_seq_len)
        self.executors[self.tag + policy] = engine.executor
        return engine


def replay_section(args, device: torch.device) -> dict:
    model_name = "tiny-random" if args.quick else args.model
    spec = TraceSpec(num_requests=args.requests, time_scale=args.time_scale)
    trace = spec.load_for(vocab_size=32000 if not args.quick else 500, tokens_per_block=32)
    executors: dict = {}
    result: dict = {"model": model_name, "requests": len(trace), "runs": {}}
    for kv_dtype in KV_DTYPES:
        blocks = args.kv_blocks * (2 if kv_dtype == "fp8" else 1)  # the same bytes
        settings = CountingSettings.from_options(
            engine="torch", model=model_name, device=device.type, executors=executors, tag=kv_dtype + " ",
            max_num_tokens=args.max_num_tokens, host_cache_blocks=args.host_cache_blocks,
            kv_cache_config={"num_blocks": blocks, "dtype": kv_dtype})
        run = replay_trace(trace, settings, ["recheck"], spec=spec, progress=False)
        metrics = run.runs["recheck"].metrics
        executor = executors[kv_dtype + " recheck"]
        stats = executor.iteration_stats
        kv = executor.kv_cache_manager
        result["runs"][kv_dtype] = {
            "kv_blocks": blocks, "pool_tokens": blocks * kv.tokens_per_block,
            "pool_gib": blocks * kv.tokens_per_block * kv.storage.bytes_per_token / 2**30,
            "host_cache_bytes": kv.config.host_cache_size,
            "prefix_hit_tokens": sum(s.reuse_claimed_tokens for s in stats),
            "prefix_query_tokens": sum(s.reuse_query_tokens for s in stats),
            "deferrals": metrics["deferrals"], "capacity_deferrals": metrics.get("capacity_deferrals"),
            "ttft_ms": metrics["ttft_ms"], "tpot_ms": metrics["tpot_ms"],
            "output_tokens_per_s": metrics["output_tokens_per_s"], "completed": metrics["completed"],
            "errored": metrics["errored"], "overshoots": metrics["overshoots"],
        }
        logger.info("replay %s: %d blocks, prefix hits %d tokens, deferrals %d, TTFT p50/p99 %.0f/%.0f ms, %.0f tok/s",
                    kv_dtype, blocks, result["runs"][kv_dtype]["prefix_hit_tokens"], metrics["deferrals"],
                    metrics["ttft_ms"]["p50"], metrics["ttft_ms"]["p99"], metrics["output_tokens_per_s"])
        executors.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# ---- main ----------------------------------------------------------------------------------


def preconditions(args) -> list[str]:
    if args.quick:
        return []
    if not torch.cuda.is_available():
        return ["no CUDA GPU (use --quick to check the script on the CPU)"]
    free, _ = torch.cuda.mem_get_info()
    need = 110 * 2**30 if "decode" in args.sections else 40 * 2**30 if "replay" in args.sections else 8 * 2**30
    if free < need:
        return [f"{free / 2**30:.0f} GiB free on the GPU, {need / 2**30:.0f} GiB needed"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="decode,replay")
    parser.add_argument("--model", default="mistral-nemo-12b-random")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--kv-blocks", type=int, default=1280,
                        help="the bf16 pool's blocks (the scenario's tight pool); FP8 gets twice as many: the same bytes")
    parser.add_argument("--host-cache-blocks", type=int, default=512, help="the host tier, in bf16 blocks' bytes")
    parser.add_argument("--max-num-tokens", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="the CPU, tiny shapes: checks the script")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.requests = min(args.requests, 6)
        args.kv_blocks = min(args.kv_blocks, 512)
    problems = preconditions(args)
    if problems:
        print("not run: " + "; ".join(problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    sections = {"kernel": kernel_section, "layout": layout_section, "decode": decode_section, "replay": replay_section}
    for name in args.sections.split(","):
        start = time.perf_counter()
        result = sections[name](args, device)
        result["seconds"] = time.perf_counter() - start
        (args.out / f"gpu_fp8_{name}.json").write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps({name: _summary(name, result)}, default=str))
    return 0


def _summary(name: str, result: dict) -> dict:
    if name == "kernel":
        return {case: {"bf16_ms": e["bfloat16"]["ms"], "bf16_tb_s": e["bfloat16"]["tb_s"], "fp8_ms": e["fp8"]["ms"],
                       "fp8_tb_s": e["fp8"]["tb_s"], "fp8/bf16": e["fp8_over_bf16"],
                       "best_fp8": [e["best_fp8"]["config"], e["best_fp8"]["splits"], e["best_fp8"]["tb_s"]],
                       "best_bf16": [e["best_bfloat16"]["config"], e["best_bfloat16"]["splits"], e["best_bfloat16"]["tb_s"]]}
                for case, e in result["cases"].items()}
    if name == "layout":
        return [f"{r['kv']} x{r['kv_heads']} heads: {r['ms']:.3f} ms, {r['tb_s']:.2f} TB/s" for r in result["runs"]]
    if name == "decode":
        return {case: {"bf16_ms": e["auto"]["device_ms"], "fp8_ms": e["fp8"]["device_ms"], "fp8/bf16": e["fp8_over_bf16"],
                       "fp8_x_roofline": e["fp8"]["x_roofline"], "kernel_fp8/bf16": e["kernel_fp8_over_bf16"]}
                for case, e in result["cases"].items()}
    return {kv: {k: run[k] for k in ("pool_tokens", "prefix_hit_tokens", "deferrals", "ttft_ms", "output_tokens_per_s")}
            for kv, run in result["runs"].items()}


if __name__ == "__main__":
    sys.exit(main())
