"""The in-process engine with an FP8 KV cache against a bf16 one, at a few concurrency levels.

``LLM("llama-3.1-8b-random", device="cuda")`` (random bf16 weights drawn on the GPU: no checkpoint,
no tokenizer), twice: one with ``kv_cache_config.dtype`` auto (bf16), one with fp8, each with the
same number of blocks (enough for every level: the pool is not what is compared). ISL random
token ids, OSL tokens with ``ignore_eos``, greedy; ``concurrency`` workers keep one request each in
flight (``drive_levels``).

**The same work for both engines.** Each level first runs each engine for ``--seconds`` (a warm-up:
compiles, not in the figures), then ``--rounds`` times each engine, alternating which goes first so
that drift on the machine falls on both, runs a fixed number of requests per worker: as many as
the bf16 warm-up finished. A window of fixed length would not do: with ``ignore_eos`` every
request has the same length, so the workers' requests start and end in waves, the number of
waves that start before the window closes is a whole number, and the last one's drain (its batch
shrinking to nothing) is in the wall time or not. At c = 16 with 5-s windows this moved an
engine's output tokens/s by 9% from one round to the next with the same iteration times (the
FP8 engine's 0.91x of bf16 at c = 16 on an H100, whose decode iterations were 4% faster than
bf16's and mixed ones as fast)::

    PYTHONPATH=. python3 -m benchmarks.gpu.engine_fp8 --out OUT [--concurrency 1,16,64]
        [--shape 1024/128] [--seconds 10] [--rounds 1] [--profile-level 16 [--profile-seconds 1.5]]
    python -m benchmarks.gpu.engine_fp8 --out OUT --dry-run       # the CPU, tiny-random: checks the script

Writes ``OUT/engine_fp8.json``: per level, each engine's output tokens/s (the median over rounds)
and FP8 over bf16, and each round's executor iterations (:func:`iteration_summary`). The goal: FP8
at least as fast as bf16 at every level. ``--profile-level C`` adds, after that level's rounds, one
more run of each engine at C under the torch profiler (``--profile-seconds``, not in the medians):
the kernels per busy iteration by group and name (``decode_profile.kernel_breakdown``), in
``profiles``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.gpu.peer_serving import parse_shapes


def iteration_summary(stats, since: float) -> dict:
    """The executor's iterations that started at ``since`` (``time.monotonic``) or later: how many,
    their summed, median and longest wall time, split into those that ran a context chunk (mixed) and those
    that only decoded, and the idle ones (nothing to forward). Says where one engine's level time
    goes against the other's: more iterations, or longer ones of which kind."""
    rows = [s for s in stats if s.start_time >= since and s.end_time]
    out = {}
    for kind, keep in (("mixed", lambda s: s.num_context_requests > 0), ("decode", lambda s: s.busy and
                       s.num_context_requests == 0), ("idle", lambda s: not s.busy)):
        times = [(s.end_time - s.start_time) * 1e3 for s in rows if keep(s)]
        out[kind] = {"n": len(times), "sum_ms": sum(times), "median_ms": statistics.median(times) if times else 0.0,
                     "max_ms": max(times, default=0.0)}  # a Triton compile inside the level shows here
    return out


def drive_levels(llm, isl: int, osl: int, concurrency_levels: list[int], seconds: float, rng: random.Random,
                 vocab: int, label: str, requests_per_worker: int | None = None) -> list[dict]:
    """Each level: ``concurrency`` threads keep one request each in flight through ``llm`` (ISL
    random token ids, OSL tokens with ``ignore_eos``), each for ``seconds`` or, when
    ``requests_per_worker`` is given, for exactly that many requests (the same work whatever the
    engine's speed); output tokens/s per level (tokens of finished requests over the wall time)."""
    from tensorrt_llm.llmapi.llm import SamplingParams

    params = SamplingParams(max_tokens=osl, ignore_eos=True)
    levels = []
    for concurrency in concurrency_levels:
        tokens, done, lock = [0], [0], threading.Lock()
        since = time.monotonic()
        stop = since + seconds
        began = time.perf_counter()

        def worker() -> None:
            count = 0
            while (count < requests_per_worker) if requests_per_worker else (time.monotonic() < stop):
                count += 1
                with lock:
                    prompt = [rng.randrange(1, vocab) for _ in range(isl)]
                output = llm.generate(prompt, params)
                with lock:
                    tokens[0] += len(output.outputs[0].token_ids)
                    done[0] += 1

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        iterations = iteration_summary(llm.iteration_stats, since)
        levels.append({"concurrency": concurrency, "requests": done[0], "requests_per_worker": requests_per_worker,
                       "output_tokens": tokens[0],
                       "wall_s": wall, "output_tokens_per_s": tokens[0] / wall, "iterations": iterations})
        steps = ", ".join(f"{kind} {v['n']} x {v['median_ms']:.2f} ms (max {v['max_ms']:.0f} ms, "
                          f"{v['sum_ms'] / 1e3:.2f} s)"
                          for kind, v in iterations.items())
        print(f"{label} {isl}/{osl} c={concurrency}: {tokens[0] / wall:.0f} tok/s; iterations: {steps}", flush=True)
    return levels


def profiled_level(llm, isl: int, osl: int, concurrency: int, seconds: float, rng: random.Random, vocab: int,
                   label: str) -> dict:
    """One more level at ``concurrency`` under the torch profiler: its iterations, and the CUDA
    kernels (every thread's: the executor's own included) per busy iteration."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu.decode_profile import kernel_breakdown

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        level, = drive_levels(llm, isl, osl, [concurrency], seconds, rng, vocab, label)
    busy = level["iterations"]["mixed"]["n"] + level["iterations"]["decode"]["n"]
    breakdown = kernel_breakdown(prof.events(), busy)
    groups = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in list(breakdown["groups_us_per_step"].items())[:6])
    print(f"{label} c={concurrency}: per busy iteration {breakdown['kernel_us_per_step'] / 1e3:.2f} ms of kernels "
          f"({groups} ms), GPU idle {breakdown['idle_us_per_step'] / 1e3:.2f} ms", flush=True)
    return {"level": level, "busy_iterations": busy, **breakdown}


def run(args) -> dict:
    from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
    from tensorrt_llm.llmapi.llm import LLM

    (isl, osl), = parse_shapes(args.shape)
    concurrency = max(args.concurrency)
    tokens_per_block = 32
    blocks = concurrency * -(-(isl + osl + 1) // tokens_per_block) + 64
    options = dict(max_batch_size=concurrency, max_num_tokens=8192 if not args.dry_run else 512,
                   enable_chunked_prefill=True)
    model = "tiny-random" if args.dry_run else args.model
    device = "cpu" if args.dry_run else "cuda"
    engines = {}
    record: dict = {"model": model, "shape": args.shape, "blocks": blocks, "levels": {}, "start_up": {}}
    try:
        for kv in ("auto", "fp8"):
            began = time.perf_counter()
            cache = KvCacheConfig(tokens_per_block=tokens_per_block, num_blocks=blocks, dtype=kv, enable_block_reuse=False)
            engines[kv] = LLM(model, device=device, kv_cache_config=cache, **options)
            record["start_up"][kv] = {"line": engines[kv].describe(), "seconds": time.perf_counter() - began}
            print(record["start_up"][kv]["line"], flush=True)
        vocab = min(engines["auto"].model_config.vocab_size, 32000)
        rng = random.Random(0)
        for level in args.concurrency:
            warm = {kv: drive_levels(engines[kv], isl, osl, [level], args.seconds, rng, vocab, f"warm-up {kv}")[0]
                    for kv in ("auto", "fp8")}
            per_worker = max(1, warm["auto"]["requests"] // level)
            runs: dict[str, list[float]] = {"auto": [], "fp8": []}
            for r in range(args.rounds):
                for kv in (("auto", "fp8") if r % 2 == 0 else ("fp8", "auto")):
                    result, = drive_levels(engines[kv], isl, osl, [level], args.seconds, rng, vocab, f"engine {kv}",
                                           requests_per_worker=per_worker)
                    runs[kv].append(result["output_tokens_per_s"])
                    record.setdefault("iterations", []).append(
                        {"kv": kv, "concurrency": level, "round": r, "requests": result["requests"],
                         "output_tokens": result["output_tokens"], "wall_s": result["wall_s"], **result["iterations"]})
            if level == args.profile_level:
                record["profiles"] = {kv: profiled_level(engines[kv], isl, osl, level, args.profile_seconds, rng, vocab,
                                                         f"profiled {kv}") for kv in ("auto", "fp8")}
            entry = {kv: statistics.median(values) for kv, values in runs.items()}
            entry["fp8_over_bf16"] = entry["fp8"] / entry["auto"] if entry["auto"] else float("nan")
            entry["rounds"] = runs
            entry["requests_per_worker"] = per_worker
            entry["warm_up_tokens_per_s"] = {kv: w["output_tokens_per_s"] for kv, w in warm.items()}
            record["levels"][str(level)] = entry
            print(f"c={level}: bf16 {entry['auto']:.0f} tok/s, FP8 {entry['fp8']:.0f} tok/s, "
                  f"FP8/bf16 {entry['fp8_over_bf16']:.3f}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-3.1-8b-random")
    parser.add_argument("--shape", default="1024/128")
    parser.add_argument("--concurrency", default="1,16,64", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile-level", type=int, default=None, help="a concurrency level to profile once more")
    parser.add_argument("--profile-seconds", type=float, default=1.5)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.shape, args.concurrency, args.seconds = "16/4", [1, 2], 0.5
        args.profile_level = 2 if args.profile_level is not None else None
        args.profile_seconds = min(args.profile_seconds, 0.5)
    elif not torch.cuda.is_available():
        print("not run: no CUDA GPU (--dry-run checks the script on the CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    record = run(args)
    (args.out / "engine_fp8.json").write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
