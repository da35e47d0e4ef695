"""Shared pieces of the GPU benchmarks: timing, ceilings, synthetic forwards, roofline accounting.

Timing: CUDA events around the region, warm-up first, the median of several runs (:func:`time_ms`
each call alone, launch included; :func:`time_queued_ms` calls queued back to back, a kernel's
device time); on the CPU (``--dry-run``, to check the scripts without a GPU) the host clock after
the work is done.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from benchmarks.replay.cost_model import ForwardShape, GpuSpec, ModelShape, RooflineCostModel
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs

H200 = GpuSpec()  # 800 TFLOP/s bf16, 4.2 TB/s: the ceilings the GPU goals are stated in


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5,
            calls: int = 1) -> dict:
    """Median (and min, max) milliseconds of one call of ``fn``: each run times ``calls`` calls
    queued back to back between two events (the host clock after them on the CPU) and divides.

    With ``calls=1`` each call is timed alone, so the host's cost of launching it (tens of
    microseconds of Python and Triton's dispatch, while the device waits) is in the figure: 5-10%
    of a 0.4 ms kernel, more of a faster one, which biases a fast kernel's ratio to a slow one
    upwards. :func:`time_queued_ms` queues 20, so that only the first launch is waited for: a
    kernel's device time, as a CUDA graph or a running decode loop sees it."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return {"ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples), "n": repeats,
            "calls": calls}


def time_queued_ms(fn: Callable[[], object], device: torch.device, *, calls: int = 20, warmup: int = 3,
                   repeats: int = 5) -> dict:
    """:func:`time_ms` with ``calls`` (20) calls queued a run: a kernel's device time."""
    return time_ms(fn, device, warmup=warmup, repeats=repeats, calls=calls)


def measure_ceilings(device: torch.device) -> dict:
    """Dense bf16 8192^3 matmul rate and device-to-device copy bandwidth, on random data."""
    if device.type != "cuda":
        return {}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = time_ms(lambda: a @ b, device, warmup=3, repeats=10)
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    cp = time_ms(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {
        "bf16_matmul_8192_tflops": 2 * n**3 / (mm["ms"] * 1e-3) / 1e12,
        "copy_tb_s_read_plus_write": 2 * 2 * (1 << 30) / (cp["ms"] * 1e-3) / 1e12,
    }


def model_shape(config: LlamaConfig) -> ModelShape:
    """The cost model's view of a model config."""
    return ModelShape(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        dtype_bytes=torch.empty(0, dtype=config.torch_dtype).element_size(),
    )


@dataclass(frozen=True, slots=True)
class Roofline:
    """The floor of one forward: FLOPs at the matmul peak, or the bytes it must move at copy
    bandwidth (weights once, cached KV once), whichever is larger."""

    flops: float
    bytes: float
    compute_ms: float
    memory_ms: float

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    def report(self, measured_ms: float) -> dict:
        return {
            "measured_ms": measured_ms,
            "roofline_ms": self.ms,
            "bound": self.bound,
            "roofline_fraction": self.ms / measured_ms,  # 1.0 = at the roofline
            "x_roofline": measured_ms / self.ms,
            "tflops": self.flops / (measured_ms * 1e-3) / 1e12,
            "tb_s": self.bytes / (measured_ms * 1e-3) / 1e12,
            "flops": self.flops,
            "bytes": self.bytes,
        }


def roofline(shape: ForwardShape, model: ModelShape, gpu: GpuSpec = H200) -> Roofline:
    """FLOPs as the cost model counts them (GEMMs, attention pairs, LM head on sampled rows);
    bytes: every weight once plus every cached K/V read once (the decode floor)."""
    cost = RooflineCostModel(model, gpu)
    flops = cost.flops(shape)
    cached = sum(c for _, c in shape.contexts) + sum(c for _, c in shape.decodes)
    nbytes = model.forward_weight_bytes() + cached * model.kv_bytes_per_token()
    return Roofline(flops, nbytes, flops / gpu.peak_flops * 1e3, nbytes / gpu.mem_bandwidth * 1e3)


class BlockAllocator:
    """Hands out distinct blocks of a pool in a shuffled order (physical order is random, as in
    serving); ``reset`` returns them all."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.order = np.random.default_rng(seed).permutation(num_blocks)
        self.next = 0

    def take(self, count: int) -> list[int]:
        if self.next + count > len(self.order):
            raise ValueError(f"the pool has {len(self.order)} blocks, {self.next + count} asked for")
        blocks = self.order[self.next : self.next + count].tolist()
        self.next += count
        return blocks

    def reset(self) -> None:
        self.next = 0


def synthetic_inputs(
    shape: ForwardShape, allocator: BlockAllocator, tokens_per_block: int, vocab_size: int, seed: int = 0
) -> ForwardInputs:
    """The flat forward ``_prepare_tp_inputs`` would build for ``shape``: context chunks first
    (each sampled, as a last chunk), then one-token decodes; random tokens, fresh blocks."""
    rng = np.random.default_rng(seed)
    inputs = ForwardInputs()
    allocator.reset()
    rid = 0
    for new, cached in shape.contexts:
        request = _request(rid, cached + new, new, LlmRequestState.CONTEXT_INIT)
        table = allocator.take(-(-(cached + new) // tokens_per_block))
        inputs.append(request, rng.integers(0, vocab_size, new).tolist(), cached, table, samples=True)
        rid += 1
    for new, cached in shape.decodes:
        request = _request(rid, cached + new, new, LlmRequestState.GENERATION_IN_PROGRESS)
        table = allocator.take(-(-(cached + new) // tokens_per_block))
        inputs.append(request, rng.integers(0, vocab_size, new).tolist(), cached, table, samples=True)
        rid += 1
    return inputs


def _request(rid: int, length: int, new: int, state: LlmRequestState) -> LlmRequest:
    request = LlmRequest(input_token_ids=[0] * max(1, length - new + 1), max_new_tokens=1, request_id=rid)
    request.state = state
    return request


def fill_random(pools: torch.Tensor, seed: int = 0) -> None:
    """Random K/V everywhere (METHOD.md: never time on zeros), a layer at a time (an FP8 pool
    through a bf16 draw: float8 has no random kernels)."""
    gen = torch.Generator(pools.device).manual_seed(seed)
    for chunk in pools.flatten(0, 1):
        if chunk.dtype.itemsize == 1:
            chunk.copy_(torch.randn(chunk.shape, generator=gen, device=chunk.device, dtype=torch.bfloat16))
        else:
            chunk.normal_(generator=gen)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary_footer(result: dict) -> list[str]:
    """The last lines of a GPU benchmark's summary: each section that failed or was skipped,
    then the total time."""
    lines = [f"section {name}: {sec.get('error') or sec.get('skipped')}"
             for name, sec in result["sections"].items()
             if isinstance(sec, dict) and ("error" in sec or "skipped" in sec)]
    return lines + [f"total {result.get('total_seconds', 0):.0f} s"]
