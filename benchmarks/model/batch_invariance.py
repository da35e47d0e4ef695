"""What the batch-invariant mode (``LLM(..., batch_invariant=True)``, docs/determinism.md) costs on
the CPU: a decode step and a prefill, against the default kernels, alternating A and B in one run.

Both modes serve the same model (``--model``, in its default CPU dtype unless ``--dtype``) with
block reuse off, on the same threads. Each repeat runs, for each mode in turn (default, then
batch-invariant; the order flips every repeat):

* **decode**: ``batch`` prompts of ``--prompt-len`` random token ids generate ``--output-len``
  tokens each (``ignore_eos``); one decode step is the median time of the iterations that ran all
  ``batch`` requests together and no prompt (the executor's iteration statistics: schedule, KV,
  forward, sampling, responses);
* **prefill**: one ``--prefill-len``-token prompt, one chunk (the iteration that computed it).

The fastest repeat of each is kept (this machine is shared: only ratios measured in the same run
are reported); ``ratio`` is batch-invariant / default. The run also checks the mode's promise on
its own prompts: in the batch-invariant LLM, the first decode prompt's tokens and logprobs alone
equal the ones it got inside the largest batch (``batch_equals_alone``).

    python -m benchmarks.model.batch_invariance [--model smollm2-135m-instruct] [--dtype D]
        [--batch-sizes 1,8] [--prompt-len 64] [--output-len 16] [--prefill-len 256] [--repeats 3]
        [--threads N] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from benchmarks.model.decode_speed import executor_prefill
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig

MODES = ("default", "batch_invariant")
TOKENS_PER_BLOCK = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a preset, packaged name, .gguf or HF directory")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: its CPU default)")
    p.add_argument("--batch-sizes", default="1,8", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of each decode prompt")
    p.add_argument("--output-len", type=int, default=16, help="tokens each decode request generates")
    p.add_argument("--prefill-len", type=int, default=256, help="tokens of the prefill prompt")
    p.add_argument("--repeats", type=int, default=3, help="A/B rounds; the fastest of each is kept")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Distinct prompts of random ids (nothing shared: no prefix to reuse, none across repeats)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def build(mode: str, args: argparse.Namespace, batch: int) -> LLM:
    tokens = max(args.prefill_len, batch * args.prompt_len)
    blocks = -(-(batch * (args.prompt_len + args.output_len) + args.prefill_len) // TOKENS_PER_BLOCK) + 8
    return LLM(args.model, dtype=args.dtype, batch_invariant=mode == "batch_invariant", max_num_tokens=tokens,
               max_batch_size=max(batch, 1), max_seq_len=max(args.prefill_len, args.prompt_len + args.output_len) + 1,
               kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=blocks,
                                             enable_block_reuse=False))


def decode_step_ms(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    before = len(llm.iteration_stats)
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    steps = [s for s in llm.iteration_stats[before:]
             if s.num_generation_requests == len(prompts) and s.num_context_requests == 0]
    if not steps:
        raise RuntimeError(f"no decode iteration ran all {len(prompts)} requests together")
    return statistics.median(s.end_time - s.start_time for s in steps) * 1e3


def batch_equals_alone(llm: LLM, prompts: list[list[int]], output_len: int) -> bool:
    """The mode's promise on this run's prompts: the first one alone gets what it got in the batch."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params)[0].outputs[0]
    alone = llm.generate(prompts[0], params).outputs[0]
    return together.token_ids == alone.token_ids and together.logprobs == alone.logprobs


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    largest = max(sizes)
    llms = {mode: build(mode, args, largest) for mode in MODES}
    vocab = llms["default"].model_config.vocab_size
    decode = {b: {m: [] for m in MODES} for b in sizes}
    prefill = {m: [] for m in MODES}
    try:
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for b in sizes:
                prompts = random_prompts(vocab, b, args.prompt_len, seed=1000 * repeat + b)
                for mode in order:
                    decode[b][mode].append(decode_step_ms(llms[mode], prompts, args.output_len))
            prompt = random_prompts(vocab, 1, args.prefill_len, seed=10_000 + repeat)[0]
            for mode in order:
                prefill[mode].append(executor_prefill(llms[mode], prompt))
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"decode b{b} {decode[b]['default'][-1]:.1f}/{decode[b]['batch_invariant'][-1]:.1f} ms" for b in sizes)
                + f", prefill {prefill['default'][-1]:.0f}/{prefill['batch_invariant'][-1]:.0f} ms (default/invariant)",
                flush=True)
        check = batch_equals_alone(llms["batch_invariant"], random_prompts(vocab, largest, args.prompt_len, seed=7),
                                   args.output_len)
        model = llms["default"].model_config
    finally:
        for llm in llms.values():
            llm.shutdown()

    def entry(times: dict[str, list[float]]) -> dict:
        best = {m: min(times[m]) for m in MODES}
        return {"default_ms": best["default"], "batch_invariant_ms": best["batch_invariant"],
                "ratio": best["batch_invariant"] / best["default"], "all_ms": times}

    return {
        "config": {**vars(args), "model_dtype": model.dtype, "threads": torch.get_num_threads(),
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
        "results": {
            "decode_step": {f"batch {b}": entry(decode[b]) for b in sizes},
            "prefill": {f"{args.prefill_len} tokens": entry(prefill)},
            "batch_equals_alone": check,
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    report = run(args)
    results = report["results"]
    print(f"\n{args.model} ({report['config']['model_dtype']}), {report['config']['threads']} threads, "
          f"{report['config']['cpu_capability']}: batch-invariant / default, fastest of {args.repeats}")
    for name, entry in [*results["decode_step"].items(), *(("prefill " + k, v) for k, v in results["prefill"].items())]:
        label = name if name.startswith("prefill") else "decode step, " + name
        print(f"  {label:<28} {entry['default_ms']:9.1f} ms  {entry['batch_invariant_ms']:9.1f} ms   x{entry['ratio']:.2f}")
    print(f"  a prompt alone gets the bits it got in the batch: {results['batch_equals_alone']}")
    print(f"  ({time.monotonic() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if results["batch_equals_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())
