"""SmolLM2-135M-Instruct on the CPU: decode speed through the executor, and the loader's perplexity.

Decode: ``LLM("smollm2-135m-instruct")`` (float32) serves ``batch`` prompts of ``--prompt-len``
tokens together and generates ``--output-len`` tokens each (``ignore_eos``). The executor's own
iteration statistics time every iteration from its start to its record (schedule, KV
preparation, forward, sampling, responses); the decode iterations are those with all ``batch``
requests generating and none in prefill. Their median is one decode step (each sequence gains
a token: the inter-token latency), and step / batch is the time per generated token. Each batch
size runs ``--repeats`` times on a fresh executor; the fastest run is reported (this machine is
shared and noisy: min-of-N).

Perplexity (``benchmarks.perplexity``: four ordinary English paragraphs): the loader in float32
(what is served), the same loader in float64 (the reference), and the q/k rows left in
llama.cpp's order (a wrong layout, for scale).

    python -m benchmarks.decode_speed [--batch-sizes 1,16] [--output-len 32] [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.perplexity import PARAGRAPHS, paragraph_ids, perplexity
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoints import load_llama_from_gguf, packaged_checkpoint_path
from tensorrt_llm.llmapi import KvCacheConfig

MODEL = "smollm2-135m-instruct"


def _prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """Distinct prompts (no prefix reuse between them) of exactly ``prompt_len`` tokens."""
    prompts = []
    for i in range(batch):
        ids = tokenizer.encode(f"Note {i}. " + " ".join(PARAGRAPHS[j % len(PARAGRAPHS)] for j in range(i, i + 4)))
        prompts.append(ids[:prompt_len])
    return prompts


def decode_run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - start
    batch = len(prompts)
    steps = [
        s.end_time - s.start_time
        for s in llm.iteration_stats
        if s.num_generation_requests == batch and s.num_context_requests == 0
    ]
    if not steps:
        raise RuntimeError(f"no decode iteration ran all {batch} requests together")
    step = statistics.median(steps)
    return {
        "decode_iterations": len(steps),
        "ms_per_step": step * 1e3,
        "ms_per_token": step * 1e3 / batch,
        "tokens_per_s": batch / step,
        "wall_s": wall,
    }


def measure_decode(batch: int, prompt_len: int, output_len: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        kv = KvCacheConfig(tokens_per_block=32, max_tokens=batch * (prompt_len + output_len + 32))
        with LLM(MODEL, max_batch_size=batch, max_num_tokens=max(2048, batch * prompt_len), kv_cache_config=kv) as llm:
            runs.append(decode_run(llm, _prompts(llm.tokenizer, batch, prompt_len), output_len))
    best = min(runs, key=lambda run: run["ms_per_step"])
    return {"batch": batch, **best, "ms_per_step_all_runs": [round(r["ms_per_step"], 2) for r in runs]}


def measure_perplexity() -> dict:
    path = packaged_checkpoint_path(MODEL)
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    texts = paragraph_ids(Tokenizer.from_gguf(path))
    result = {"tokens": sum(len(t) - 1 for t in texts)}
    for name, options in (
        ("float32", {}),
        ("float64_reference", {"dtype": "float64"}),
        ("wrong_qk_float32", {"undo_qk_permutation": False}),
    ):
        result[name] = perplexity(load_llama_from_gguf(path, **options), texts)
    result["relative_difference_float32_vs_float64"] = abs(result["float32"] / result["float64_reference"] - 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size; the fastest is reported")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]

    decode = []
    print(f"{MODEL}, float32, CPU, {args.threads} threads; prompt {args.prompt_len} tokens, {args.output_len} generated")
    print(f"{'batch':>5} {'ms/step':>9} {'ms/token':>9} {'tokens/s':>9} {'steps':>6}  all runs (ms/step)")
    for batch in batches:
        row = measure_decode(batch, args.prompt_len, args.output_len, args.repeats)
        decode.append(row)
        print(
            f"{batch:>5} {row['ms_per_step']:>9.1f} {row['ms_per_token']:>9.2f} {row['tokens_per_s']:>9.1f}"
            f" {row['decode_iterations']:>6}  {row['ms_per_step_all_runs']}",
            flush=True,
        )

    ppl = None
    if not args.skip_perplexity:
        ppl = measure_perplexity()
        print(f"\nperplexity on {len(PARAGRAPHS)} paragraphs ({ppl['tokens']} predicted tokens)")
        print(f"  ours, float32        {ppl['float32']:.4f}")
        difference = ppl["relative_difference_float32_vs_float64"]
        print(f"  reference, float64   {ppl['float64_reference']:.4f}   (relative difference {difference:.1e})")
        print(f"  q/k left permuted    {ppl['wrong_qk_float32']:.4f}   ({ppl['wrong_qk_float32'] / ppl['float32']:.1f}x)")

    if args.json:
        config = {**vars(args), "model": MODEL, "dtype": "float32", "batch_sizes": batches}
        with open(args.json, "w") as f:
            json.dump({"config": config, "decode": decode, "perplexity": ppl}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
