"""Whole forwards of the engine on the GPU: the four roofline cases, what CUDA graphs buy at
each decode batch size, and the shapes of the shared calibration table.

Every forward goes through ``TorchModelEngine.launch`` exactly as the executor drives it (plan
built on the host, pools on the device, LM head and greedy pick on the sampled rows), on
synthetic inputs: context chunks first, then one-token decodes, each request with its own
blocks in shuffled physical order, K/V pools filled with random values.

Two times per forward: ``device_ms``, from the forward's first kernel to its greedy pick (what
a cost model predicts; launch gaps count, host preparation does not), and ``wall_ms``, from
the call to the tokens on the host.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.replay.cost_model import ForwardShape, table_row_shape
from benchmarks.gpu.common import BlockAllocator, fill_random, model_shape, roofline, synthetic_inputs
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager

logger = logging.getLogger(__name__)


def build_engine(model: LlamaForCausalLM, *, max_batch_size: int, max_num_tokens: int, max_seq_len: int,
                 num_blocks: int | None = None, tokens_per_block: int = 32) -> TorchModelEngine:
    """An engine with graphs for every decode batch size up to ``max_batch_size``; the pool takes
    ``free_gpu_memory_fraction`` of the free memory unless ``num_blocks`` is given."""
    config = ExecutorConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, num_blocks=num_blocks),
        cuda_graph_config=CudaGraphConfig(),
    )
    kv = create_kv_cache_manager(config, model=model)
    engine = TorchModelEngine(model, max_num_tokens, kv, cuda_graph_config=config.cuda_graph_config,
                              max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    engine.time_forwards = model.device.type == "cuda"
    fill_random(kv.storage.pools)
    return engine


def time_forward(engine: TorchModelEngine, shape: ForwardShape, allocator: BlockAllocator, *, graphs: bool,
                 warmup: int = 2, repeats: int = 5) -> dict:
    """Median device and wall milliseconds of one forward of ``shape``."""
    inputs = synthetic_inputs(shape, allocator, engine.kv_cache_manager.tokens_per_block, engine.vocab_size)
    runner = engine.graph_runner
    engine.graph_runner = runner if graphs else None
    try:
        device, wall = [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            pending = engine.launch(inputs)
            pending.result()
            if i >= warmup:
                wall.append((time.perf_counter() - t0) * 1e3)
                device.append((pending.device_time_ms() if engine.time_forwards else None) or wall[-1])
    finally:
        engine.graph_runner = runner
    return {"device_ms": statistics.median(device), "wall_ms": statistics.median(wall),
            "device_ms_min": min(device), "n": repeats}


def roofline_cases(engine: TorchModelEngine, *, quick: bool) -> dict:
    """The four roofline cases against the H200 roofline (decode with and without graphs)."""
    cfg = engine.model.config
    shape_m = model_shape(cfg)
    allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
    if quick:
        cases = {"prefill_4096": ForwardShape(contexts=((256, 0),)),
                 "chunk_4096_after_16k": ForwardShape(contexts=((128, 512),)),
                 "decode_64x8k": ForwardShape(decodes=((1, 255),) * 4),
                 "decode_256x2k": ForwardShape(decodes=((1, 127),) * 8)}
    else:
        cases = {"prefill_4096": ForwardShape(contexts=((4096, 0),)),
                 "chunk_4096_after_16k": ForwardShape(contexts=((4096, 16384),)),
                 "decode_64x8k": ForwardShape(decodes=((1, 8191),) * 64),
                 "decode_256x2k": ForwardShape(decodes=((1, 2047),) * 256)}
    out = {}
    for name, shape in cases.items():
        floor = roofline(shape, shape_m)
        decode = not shape.contexts
        timed = {"eager": time_forward(engine, shape, allocator, graphs=False)}
        if decode and engine.graph_runner is not None:
            timed["graph"] = time_forward(engine, shape, allocator, graphs=True)
        best = min(timed.values(), key=lambda t: t["device_ms"])
        out[name] = {"tokens": shape.num_tokens, **floor.report(best["device_ms"]), "timings": timed}
        logger.info("%s: %.2f ms, %.1f%% of roofline (%s-bound)", name, best["device_ms"],
                    100 * out[name]["roofline_fraction"], floor.bound)
    return out


def graph_sweep(engine: TorchModelEngine, *, quick: bool, context: int = 2048) -> list[dict]:
    """Decode steps at each batch size, eager and replayed from a graph."""
    sizes = (1, 4) if quick else (1, 4, 16, 64, 256)
    context = 128 if quick else context
    allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
    rows = []
    for batch in sizes:
        shape = ForwardShape(decodes=((1, context - 1),) * batch)
        eager = time_forward(engine, shape, allocator, graphs=False)
        graph = time_forward(engine, shape, allocator, graphs=True) if engine.graph_runner is not None else None
        floor = roofline(shape, model_shape(engine.model.config))
        rows.append({"batch": batch, "context": context, "eager": eager, "graph": graph, "roofline_ms": floor.ms,
                     "speedup": eager["device_ms"] / graph["device_ms"] if graph else None})
        logger.info("decode %d x %d: eager %.2f ms, graph %s ms", batch, context, eager["device_ms"],
                    f"{graph['device_ms']:.2f}" if graph else "-")
    return rows


def calibration_shapes(engine: TorchModelEngine, table_path: Path, *, quick: bool) -> list[dict]:
    """The engine on every shape of the shared table whose KV fits the pool."""
    rows = json.loads(Path(table_path).read_text())["rows"]
    if quick:
        rows = [r for r in rows if r["ctx_tokens"] + r["prefix"] <= 512 and r["decode_batch"] <= 8][:4]
        for r in rows:
            r["decode_ctx"] = min(r["decode_ctx"], 128)
    capacity = engine.kv_cache_manager.num_blocks * engine.kv_cache_manager.tokens_per_block
    allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
    out = []
    for row in rows:
        shape = table_row_shape(row)
        need = sum(n + c for n, c in shape.contexts) + sum(n + c for n, c in shape.decodes)
        entry = {key: row[key] for key in ("ctx_tokens", "prefix", "decode_batch", "decode_ctx")}
        entry["shared_ms"] = row["ms"]
        if need + 64 * engine.kv_cache_manager.tokens_per_block > capacity:
            entry["skipped"] = f"needs {need} KV tokens, the pool holds {capacity}"
            out.append(entry)
            continue
        entry.update(time_forward(engine, shape, allocator, graphs=True, warmup=1, repeats=3))
        out.append(entry)
    return out
