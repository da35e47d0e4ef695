"""Figures a peer can compare: a Llama-3.1-8B-shaped model served by ``trtllm-serve`` and measured
by a standard client (GuideLLM), at the lengths peers publish, over a concurrency sweep.

    python -m benchmarks.gpu.peer_serving --out OUT --kv-cache-dtype auto|fp8 \\
        --tokenizer DIR [--checkpoint /tmp/hf_checkpoints/llama-3.1-8b] [--shapes 1024/128,1024/1024] \\
        [--concurrency 1,8,32,64,128] [--seconds 30] [--guidellm "python3 -m guidellm"] [--dry-run]
    python -m benchmarks.gpu.peer_serving --out OUT --section engine ...    # the same requests, no HTTP

``serve`` (the default section):

1. the checkpoint: Llama-3.1-8B's published ``config.json`` with random bf16 weights, written by
   transformers (``benchmarks.gpu.hf_checkpoints``) unless it exists, and a tokenizer copied in
   (``--tokenizer``: any Hugging Face tokenizer directory whose ids fit the vocabulary, e.g.
   SmolLM2's from ``python -m tools.gguf_to_hf --tokenizer-only``; a client counts tokens with it
   and the server tokenizes with it, so a 1024-token prompt is 1024 tokens on both sides);
2. ``trtllm-serve DIR`` with ``kv_cache_config.dtype`` = ``--kv-cache-dtype``, ``max_batch_size``
   256, ``max_num_tokens`` 8192, chunked prefill; the rest the defaults (bf16, CUDA graphs, overlap);
3. for each shape, ``guidellm run`` over ``/v1/completions``: synthetic text prompts of exactly
   ISL tokens, OSL output tokens with ``ignore_eos`` (GuideLLM sends it), a ``concurrent`` profile
   of the ``--concurrency`` levels, each ``--seconds`` long. Its raw JSON is kept as
   ``OUT/guidellm_<kv>_<isl>_<osl>.json``; ``OUT/peer_<kv>.json`` sums up each level (output
   tokens/s, requests/s, TTFT and ITL p50 / p99, completed and errored requests).

``engine``: the same shapes and concurrency levels through ``LLM`` in-process (token-id prompts of
ISL random ids, ``ignore_eos``), no HTTP: the engine's throughput, to set beside the server's
(``OUT/engine_<kv>.json``).

Preconditions (a GPU unless ``--dry-run``, GuideLLM runnable, the tokenizer, disk) are checked
first; the run stops at the first failure, as it stops when the server does not come up.
``--dry-run`` runs everything scaled down on the CPU (the checkpoint too) to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVE_OPTIONS = {
    "max_batch_size": 256, "max_num_tokens": 8192, "enable_chunked_prefill": True,
    "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        isl, _, osl = item.partition("/")
        shapes.append((int(isl), int(osl)))
    return shapes


def preconditions(args) -> list[str]:
    problems = []
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        problems.append(f"no tokenizer.json in {args.tokenizer} (python -m tools.gguf_to_hf --out DIR --tokenizer-only)")
    if args.section == "serve":
        done = subprocess.run([*shlex.split(args.guidellm), "--help"], capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"{args.guidellm!r} does not run: {done.stderr.strip()[-300:]}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            return problems + ["no CUDA GPU (use --dry-run to check the script on the CPU)"]
        free, _ = torch.cuda.mem_get_info()
        if free < 60e9:
            problems.append(f"only {free / 1e9:.0f} GB free on the GPU")
        checkpoint = Path(args.checkpoint)
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        if not (checkpoint / "config.json").is_file() and shutil.disk_usage(checkpoint.parent).free < 20e9:
            problems.append(f"{shutil.disk_usage(checkpoint.parent).free / 1e9:.0f} GB free for a 16 GB checkpoint")
    return problems


def prepare_checkpoint(args) -> Path:
    """The checkpoint directory, written if missing, with the tokenizer's files beside the weights."""
    directory = Path(args.checkpoint)
    if not (directory / "config.json").is_file():
        began = time.perf_counter()
        if args.dry_run:
            _write_dry_run_checkpoint(directory, args.tokenizer)
        else:
            subprocess.run([sys.executable, "-m", "benchmarks.gpu.hf_checkpoints", "--write", "llama-3.1-8b",
                            str(directory)], check=True)
        print(f"wrote {directory} in {time.perf_counter() - began:.0f} s", flush=True)
    for name in TOKENIZER_FILES:
        source = Path(args.tokenizer) / name
        if source.is_file():
            shutil.copyfile(source, directory / name)
    return directory


def _write_dry_run_checkpoint(directory: Path, tokenizer: str) -> None:
    """A Llama checkpoint of two tiny layers whose vocabulary holds the tokenizer's (the CPU check)."""
    import torch
    import transformers

    vocab = transformers.AutoTokenizer.from_pretrained(tokenizer).__len__()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def _figures(metrics: dict, name: str) -> dict:
    figures = metrics.get(name, {}).get("successful", {})
    percentiles = figures.get("percentiles", {})
    return {"p50": figures.get("median"), "p99": percentiles.get("p99"), "mean": figures.get("mean")}


def summarize_guidellm(report: dict) -> list[dict]:
    """One row per benchmark (concurrency level) of a GuideLLM JSON report."""
    rows = []
    for benchmark in report.get("benchmarks", []):
        metrics = benchmark.get("metrics", {})
        strategy = benchmark.get("config", {}).get("strategy", {}) or benchmark.get("scheduler", {}).get("strategy", {})
        totals = metrics.get("request_totals", {})
        rows.append({
            "concurrency": strategy.get("streams") or strategy.get("max_concurrency"),
            "output_tokens_per_s": _figures(metrics, "output_tokens_per_second")["mean"],
            "requests_per_s": _figures(metrics, "requests_per_second")["mean"],
            "ttft_ms": _figures(metrics, "time_to_first_token_ms"),
            "itl_ms": _figures(metrics, "inter_token_latency_ms"),
            "successful": totals.get("successful"), "errored": totals.get("errored"),
            "incomplete": totals.get("incomplete"),
        })
    return rows


def serve_section(args, out: Path) -> dict:
    from benchmarks.serving.soak import ServerProcess

    directory = prepare_checkpoint(args)
    options = dict(SERVE_OPTIONS, kv_cache_config={**SERVE_OPTIONS["kv_cache_config"], "dtype": args.kv_cache_dtype})
    if args.dry_run:
        options.update(max_batch_size=8, max_num_tokens=256)
    options_path = out / f"serve_{args.kv_cache_dtype}.yaml"
    options_path.write_text(json.dumps(options))  # JSON is YAML
    serve = [str(directory), "--extra_llm_api_options", str(options_path), "--device", "cpu" if args.dry_run else "cuda"]
    record: dict = {"kv_cache_dtype": args.kv_cache_dtype, "options": options, "shapes": {}}
    began = time.perf_counter()
    server = ServerProcess(serve, out / f"server_{args.kv_cache_dtype}.log", start_timeout_s=900)
    record["start_to_health_s"] = time.perf_counter() - began
    try:
        log = (out / f"server_{args.kv_cache_dtype}.log").read_text()
        record["start_up_line"] = next((line for line in log.splitlines() if "KV pool" in line), None)
        model = directory.name
        for isl, osl in parse_shapes(args.shapes):
            report = out / f"guidellm_{args.kv_cache_dtype}_{isl}_{osl}.json"
            streams = ",".join(f"streams[{i}]={c}" for i, c in enumerate(args.concurrency))
            command = [
                *shlex.split(args.guidellm), "run",
                "--backend", f"kind=openai_http,target={server.url},model={model},request_format=/v1/completions",
                "--profile", f"kind=concurrent,{streams}",
                "--constraint", f"kind=max_duration,seconds={args.seconds}",
                "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
                "--tokenizer", f"kind=huggingface_auto,model={directory}",
                "--output", f"kind=json,path={report}", "--output", "kind=console", "--disable-progress",
            ]
            began = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.seconds * len(args.concurrency) * 3
                                  + 300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
            (out / f"guidellm_{args.kv_cache_dtype}_{isl}_{osl}.log").write_text(done.stdout + done.stderr)
            shape = {"wall_s": time.perf_counter() - began, "returncode": done.returncode}
            if report.is_file():
                shape["levels"] = summarize_guidellm(json.loads(report.read_text()))
            record["shapes"][f"{isl}/{osl}"] = shape
            print(f"{args.kv_cache_dtype} {isl}/{osl}: " + json.dumps(shape.get("levels"), default=str), flush=True)
    finally:
        record["server_exit"] = server.stop()
    return record


def drive_levels(llm, isl: int, osl: int, concurrency_levels: list[int], seconds: float, rng: random.Random,
                 vocab: int, label: str) -> list[dict]:
    """Each level: ``concurrency`` threads keep one request each in flight through ``llm`` for
    ``seconds`` (ISL random token ids, OSL tokens with ``ignore_eos``); output tokens/s per level."""
    from tensorrt_llm.llmapi.llm import SamplingParams

    params = SamplingParams(max_tokens=osl, ignore_eos=True)
    levels = []
    for concurrency in concurrency_levels:
        tokens, done, lock = [0], [0], threading.Lock()
        stop = time.monotonic() + seconds
        began = time.perf_counter()

        def worker() -> None:
            while time.monotonic() < stop:
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
        levels.append({"concurrency": concurrency, "requests": done[0], "output_tokens": tokens[0],
                       "wall_s": wall, "output_tokens_per_s": tokens[0] / wall})
        print(f"{label} {isl}/{osl} c={concurrency}: {tokens[0] / wall:.0f} tok/s", flush=True)
    return levels


def engine_section(args, out: Path) -> dict:
    """The same shapes and levels through LLM in-process: ISL random token ids, OSL tokens
    (ignore_eos), ``concurrency`` requests kept in flight for ``seconds``."""
    from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
    from tensorrt_llm.llmapi.llm import LLM

    directory = prepare_checkpoint(args)
    kv = KvCacheConfig(**SERVE_OPTIONS["kv_cache_config"], dtype=args.kv_cache_dtype)
    options = dict(SERVE_OPTIONS, kv_cache_config=kv)
    if args.dry_run:
        options.update(max_batch_size=8, max_num_tokens=256)
    record: dict = {"kv_cache_dtype": args.kv_cache_dtype, "shapes": {}}
    rng = random.Random(0)
    with LLM(str(directory), device="cpu" if args.dry_run else "cuda", **options) as llm:
        record["start_up_line"] = llm.describe()
        vocab = min(llm.model_config.vocab_size, 32000)
        for isl, osl in parse_shapes(args.shapes):
            levels = drive_levels(llm, isl, osl, args.concurrency, args.seconds, rng, vocab, f"engine {args.kv_cache_dtype}")
            record["shapes"][f"{isl}/{osl}"] = {"levels": levels}
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--section", choices=("serve", "engine"), default="serve")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--checkpoint", default="/tmp/hf_checkpoints/llama-3.1-8b")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory (its ids < 128256)")
    parser.add_argument("--shapes", default="1024/128,1024/1024")
    parser.add_argument("--concurrency", default="1,8,32,64,128", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--seconds", type=int, default=30, help="each concurrency level's duration")
    parser.add_argument("--guidellm", default=f"{sys.executable} -m guidellm", help="the GuideLLM command")
    parser.add_argument("--dry-run", action="store_true", help="scaled down on the CPU: checks the script")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.checkpoint = str(Path(args.checkpoint).with_name(Path(args.checkpoint).name + "-dry-run"))
    problems = preconditions(args)
    if problems:
        print("not run: " + "; ".join(problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    section = serve_section if args.section == "serve" else engine_section
    record = section(args, args.out)
    name = "peer" if args.section == "serve" else "engine"
    (args.out / f"{name}_{args.kv_cache_dtype}.json").write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
