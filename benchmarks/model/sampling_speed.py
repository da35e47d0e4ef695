"""The sampled decode step against the greedy one, alternated in one run (the device sampling pass).

A decode batch of ``batch`` one-token requests over ``--context`` cached tokens goes through
``TorchModelEngine.launch`` as the executor drives it (on CUDA: the decode graph, then the sampling
pass's graph; on the CPU: the forward, then the pass), once per *variant* of the requests'
sampling settings, the variants alternating inside every repeat (this machine is shared: each
speed is reported as a ratio to greedy measured in the same rounds)::

    greedy        temperature 0: the argmax, no pass (the reference)
    sampled       temperature 1 (an OpenAI request that omits it)
    top_k_top_p   temperature 0.8, top-k 50, top-p 0.9
    logprobs      temperature 1, logprobs 5 (the chosen id's and the top 5, one copy back)
    penalties     temperature 1, repetition 1.1, frequency 0.3 over the row's ids (eager processing)
    mixed         every other row greedy, the others sampled (one pass, greedy rows unchanged)

A step's time is the wall time from launch to its picks on the host (``result()``), and on the CPU
this process's CPU time over it (the goal's measure: on a shared machine the wall time counts the
time other processes hold the cores; run with ``--threads 1`` so that the two agree on an idle
one), on CUDA the device time (CUDA events, first kernel to the copy back, the goal's measure).
Medians over ``--repeats``. Goals: sampled within 1.1x of greedy on the CPU at batch 16, within
1.05x on the GPU (Llama-3.1-8B shape). On the CPU each variant's pick is also timed alone (its
columns, then the pass or the argmax, on random logits of the step's shape): a step's ratio moves
by a few percent from round to round on a shared machine, the pick alone much less.

    PYTHONPATH=. python -m benchmarks.model.sampling_speed [--device cpu|cuda] [--model NAME]
        [--batches 16] [--context 256] [--variants greedy,sampled,...] [--repeats 15] [--threads 1]
        [--json OUT.json]

Defaults: on the CPU SmolLM2-135M (its GGUF file) at batch 16; on CUDA the ``llama-3.1-8b-random``
preset at batches 1,16,64,256 over 1024 cached tokens. The KV pools hold random values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.gpu.common import BlockAllocator, fill_random, synthetic_inputs
from benchmarks.replay.cost_model import ForwardShape
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine, device_pick
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

VARIANTS: dict[str, SamplingConfig | None] = {
    "greedy": SamplingConfig(),
    "sampled": SamplingConfig(temperature=1.0),
    "top_k_top_p": SamplingConfig(temperature=0.8, top_k=50, top_p=0.9),
    "logprobs": SamplingConfig(temperature=1.0, logprobs=5),
    "penalties": SamplingConfig(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.3),
    "mixed": None,  # every other row greedy, the others temperature 1
}
GOALS = {"cpu": 1.10, "cuda": 1.05}  # sampled / greedy
TOKENS_PER_BLOCK = 32


def build_engine(args: argparse.Namespace, max_batch: int) -> TorchModelEngine:
    device = torch.device(args.device)
    if args.model in MODEL_PRESETS and device.type == "cuda":
        model = LlamaForCausalLM(MODEL_PRESETS[args.model], device=device)  # random weights drawn on the GPU
    else:
        from tensorrt_llm.llmapi.llm_utils import load_model  # a checkpoint (the CPU default: SmolLM2's GGUF file)

        model = load_model(args.model, device=device).model
    blocks = max_batch * (-(-(args.context + 2) // TOKENS_PER_BLOCK)) + 16
    config = ExecutorConfig(
        max_batch_size=max_batch, max_num_tokens=max(2048, max_batch), max_seq_len=args.context + 64,
        kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=blocks),
        cuda_graph_config=CudaGraphConfig() if device.type == "cuda" else None,
    )
    kv = create_kv_cache_manager(config, model=model)
    engine = TorchModelEngine(model, config.max_num_tokens, kv, cuda_graph_config=config.cuda_graph_config,
                              max_batch_size=max_batch, max_seq_len=config.max_seq_len)
    engine.time_forwards = device.type == "cuda"
    fill_random(kv.storage.pools)
    return engine


def set_variant(inputs, name: str) -> None:
    """Every request of ``inputs`` samples as ``name`` says; each has 64 prior output ids (penalties count them)."""
    for i, request in enumerate(inputs.requests):
        config = VARIANTS[name]
        if config is None:
            config = VARIANTS["sampled"] if i % 2 else VARIANTS["greedy"]
        request.sampling_config = config
        if len(request.tokens) == request.orig_prompt_len:
            request.tokens.extend(range(1, 65))


def one_step(engine: TorchModelEngine, inputs) -> tuple[float, float, float | None]:
    """(wall ms, this process's CPU ms, device ms or None) of one step."""
    start, cpu = time.perf_counter(), time.process_time()
    pending = engine.launch(inputs)
    pending.result()
    wall, cpu = (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3
    device_ms = pending.device_time_ms() if hasattr(pending, "device_time_ms") else None
    return wall, cpu, device_ms


def measure(engine: TorchModelEngine, batch: int, variants: list[str], args: argparse.Namespace) -> dict:
    allocator = BlockAllocator(engine.kv_cache_manager.num_blocks)
    shape = ForwardShape(decodes=((1, args.context - 1),) * batch)
    inputs = synthetic_inputs(shape, allocator, engine.kv_cache_manager.tokens_per_block, engine.vocab_size)
    times = {v: {"wall": [], "cpu": [], "device": []} for v in variants}
    for name in variants:  # warm-up: graphs captured, allocator settled
        set_variant(inputs, name)
        for _ in range(2):
            one_step(engine, inputs)
    for _ in range(args.repeats):
        for name in variants:  # alternated: every variant sees the same machine in each round
            set_variant(inputs, name)
            wall, cpu, device_ms = one_step(engine, inputs)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
            if device_ms is not None:
                times[name]["device"].append(device_ms)
    row = {"batch": batch, "context": args.context, "variants": {}}
    for name in variants:
        entry = {}
        for kind, values in times[name].items():
            if values:
                entry[f"{kind}_ms"] = statistics.median(values)
                entry[f"{kind}_min_ms"] = min(values)
                entry[f"{kind}_ratio"] = entry[f"{kind}_ms"] / statistics.median(times["greedy"][kind])
        row["variants"][name] = entry
    if engine.device.type == "cpu":  # the pass alone, on logits of the step's shape: its share of a step
        greedy_cpu = row["variants"]["greedy"]["cpu_ms"]
        for name in variants:
            set_variant(inputs, name)
            pass_cpu = pass_alone(engine, inputs, batch, args.repeats)
            row["variants"][name]["pass_cpu_ms"] = pass_cpu
            row["variants"][name]["pass_share_of_greedy_step"] = pass_cpu / greedy_cpu
    return row


def pass_alone(engine: TorchModelEngine, inputs, batch: int, repeats: int) -> float:
    """This process's CPU ms of the pick alone (the pass's columns, then the pass or the argmax)
    on random logits of the model's dtype, median of ``repeats``."""
    logits = torch.randn(batch, engine.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    logits = logits.to(engine.model.config.torch_dtype)
    times = []
    for _ in range(repeats):
        cpu = time.process_time()
        columns = inputs.sampling_columns(engine.vocab_size)
        if columns is None:
            logits.argmax(dim=-1)
        else:
            device_pick(logits, columns, torch.from_numpy, None)
        times.append((time.process_time() - cpu) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default=None)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    args.model = args.model or ("llama-3.1-8b-random" if cuda else "smollm2-135m-instruct")
    args.batches = args.batches or ("1,16,64,256" if cuda else "16")
    args.context = args.context or (1024 if cuda else 256)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    if variants[0] != "greedy":
        variants.insert(0, "greedy")
    batches = [int(b) for b in args.batches.split(",")]
    started = time.time()
    with torch.inference_mode():
        engine = build_engine(args, max(batches))
        rows = []
        for batch in batches:
            row = measure(engine, batch, variants, args)
            rows.append(row)
            kinds = ("device", "wall") if cuda else ("cpu", "wall")
            parts = [f"{name} " + ", ".join(f"{k} {e[k + '_ms']:.2f} ms {e[k + '_ratio']:.3f}x" for k in kinds)
                     + (f", pick alone {e['pass_cpu_ms']:.2f} ms" if "pass_cpu_ms" in e else "")
                     for name, e in row["variants"].items()]
            print(f"batch {batch:4d}: " + "; ".join(parts), flush=True)
    goal = GOALS[args.device]
    # On the CPU this process's CPU time: on a shared machine the wall time also counts the time
    # other processes hold the cores (with one thread the two agree on an idle machine).
    key = "device_ratio" if cuda else "cpu_ratio"
    met = {str(row["batch"]): row["variants"]["sampled"][key] <= goal for row in rows if "sampled" in row["variants"]}
    result = {
        "config": {**vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "device_name": torch.cuda.get_device_name() if cuda else "cpu"},
        "goal": {"sampled_over_greedy": goal, "measured_by": key, "met": met},
        "rows": rows,
        "wall_s": time.time() - started,
    }
    print(f"goal: sampled within {goal}x of greedy ({key}): " + ", ".join(f"batch {b} {'met' if ok else 'MISSED'}"
                                                                         for b, ok in met.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
