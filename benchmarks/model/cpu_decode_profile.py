"""Where a CPU decode step's time goes: the engine's forward (paged model, LM head, greedy pick) over
``--batch`` one-token decodes of SmolLM2-135M-Instruct, profiled with torch's profiler and grouped.

The step is timed in CPU time of the calling thread with one torch thread (``time.thread_time``):
on a machine shared with other work, wall-clock times move by several times between runs, CPU
time much less. The profiler's own times are wall-clock and inflated by its bookkeeping, so the
groups are reported as shares of the profiled operator time, applied to the step's CPU time;
"outside the operators" is the step's CPU time beyond what the operators took when the same
forwards run unprofiled with every linear layer's kernel replaced by a no-op (``--no-gemm``)::

    python -m benchmarks.model.cpu_decode_profile [--format float16-weights|gguf|float32|bfloat16]
        [--batch 1] [--context 96] [--steps 10] [--json OUT.json]

Runs from this checkout or an older one (``PYTHONPATH=that checkout``): it uses only the engine,
``load_model`` and the profiler, so the same command gives the before and the after.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time

import torch

MODEL = "smollm2-135m-instruct"
# first match wins
GROUPS = (
    ("GEMM (linear layers, LM head)", re.compile(r"linear|int4pack|int8pack|addmm|\bmm\b|matmul|_int_mm")),
    ("attention: SDPA", re.compile(r"scaled_dot_product|flash_attention")),
    ("attention: KV gather and write", re.compile(r"index_select|index_copy|index_put")),
    ("RMSNorm", re.compile(r"rms_norm|\bmean\b|\bpow\b|rsqrt")),
    ("RoPE (cat of rotated halves)", re.compile(r"\bcat\b")),
    ("SiLU", re.compile(r"silu")),
    ("elementwise (mul, add, sub)", re.compile(r"\bmul\b|\badd\b|\bsub\b")),
    ("greedy pick, embedding", re.compile(r"argmax|embedding|\bindex\b")),
    ("views (slice, view, reshape, ...)", re.compile(r"slice|view|reshape|transpose|unsqueeze|chunk|split|select|expand|as_strided|unflatten|permute")),
)


def build(fmt: str, batch: int, context: int):
    from benchmarks.gpu.common import BlockAllocator, fill_random, synthetic_inputs
    from benchmarks.replay.cost_model import ForwardShape
    from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
    from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager
    from tensorrt_llm.llmapi.llm_utils import load_model

    kwargs = {"quantization": "gguf"} if fmt == "gguf" else {"dtype": fmt}
    model = load_model(MODEL, **kwargs).model
    blocks = batch * (-(-(context + 2) // 32)) + 8
    config = ExecutorConfig(max_batch_size=batch, max_num_tokens=max(batch, 64), max_seq_len=context + 64,
                            kv_cache_config=KvCacheConfig(tokens_per_block=32, num_blocks=blocks))
    kv = create_kv_cache_manager(config, model=model)
    engine = TorchModelEngine(model, config.max_num_tokens, kv, max_batch_size=batch)
    fill_random(kv.storage.pools)
    inputs = synthetic_inputs(ForwardShape(decodes=((1, context),) * batch), BlockAllocator(kv.num_blocks), 32,
                              model.config.vocab_size)
    return engine, inputs


def step_cpu_ms(engine, inputs, steps: int) -> float:
    for _ in range(3):
        engine._run(inputs)
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine._run(inputs)
        times.append(time.thread_time() - start)
    return min(times) * 1e3


def without_gemms(engine) -> None:
    """Every linear layer's kernel replaced by a cached output of its shape (what is left is the rest)."""
    import torch.nn.functional as F

    cache: dict = {}

    def fake_linear(x, weight, bias=None):
        key = (x.shape[:-1], weight.shape[0], x.dtype)
        if key not in cache:
            cache[key] = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
        return cache[key]

    F.linear = fake_linear
    torch.nn.functional.linear = fake_linear
    for module in engine.model.modules():
        for name in ("quant_method", "qkv_method", "gate_up_method", "_packed"):
            method = getattr(module, name, None)
            if method is None or not hasattr(method, "apply") and name != "_packed":
                continue
            _fake_method(module, name, method, cache)


def _fake_method(module, name, method, cache) -> None:
    if name == "_packed":  # the older Linear: fbgemm's packed copy on the module itself
        out_features = module.weight.shape[0]
        orig_forward = module.forward

        def forward(x, out_features=out_features):
            key = (x.shape[:-1], out_features, torch.float32)
            if key not in cache:
                cache[key] = torch.zeros(*x.shape[:-1], out_features)
            return cache[key]

        module.forward = forward
        del orig_forward
        return
    real = method.apply

    def apply(x, real=real):
        key = (id(real), x.shape)
        if key not in cache:
            cache[key] = real(x)
        return cache[key]

    method.apply = apply


def profile(engine, inputs, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine._run(inputs)
    by_op: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.cpu_parent is None:
            by_op[event.name] += event.cpu_time_total
    return dict(by_op)


def grouped(by_op: dict[str, float]) -> dict[str, float]:
    groups: dict[str, float] = collections.defaultdict(float)
    for name, us in by_op.items():
        groups[next((g for g, pattern in GROUPS if pattern.search(name)), "other")] += us
    return dict(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="float16-weights")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine, inputs = build(args.format, args.batch, args.context)
    with torch.inference_mode():
        step = step_cpu_ms(engine, inputs, args.steps)
        by_op = profile(engine, inputs, args.steps)
        without_gemms(engine)
        rest = step_cpu_ms(engine, inputs, args.steps)
        rest_ops = {g: v for g, v in grouped(profile(engine, inputs, args.steps)).items()
                    if not g.startswith("GEMM")}
    gemm_ms = step - rest
    rest_total = sum(rest_ops.values())
    rows = {"GEMM (linear layers, LM head)": gemm_ms}
    for group, us in sorted(rest_ops.items(), key=lambda kv: -kv[1]):  # the rest, by the operators' shares
        rows[group] = rest * us / rest_total if rest_total else 0.0
    print(f"{MODEL}, {args.format}, batch {args.batch} x context {args.context}, 1 thread: step {step:.2f} ms CPU time,"
          f" {rest:.2f} ms without the GEMMs ({sum(1 for _ in by_op)} kinds of operator)")
    for group, ms in rows.items():
        print(f"  {group:36s} {ms:7.2f} ms  {100 * ms / step:5.1f}%")
    calls = len(by_op)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "step_cpu_ms": step, "without_gemm_cpu_ms": rest, "groups_ms": rows,
                       "ops": {k: v / args.steps for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
                       "distinct_ops": calls}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
