"""Figures a peer can compare: a Llama-3.1-8B-shaped model served by ``trtllm-serve`` and measured
by a standard client (GuideLLM 0.8.1), at the lengths peers publish, over a concurrency sweep,
with GuideLLM's defaults (sampled: no ``temperature`` in the body) and with ``temperature: 0``.

    python -m benchmarks.gpu.peer_serving --out OUT --tokenizer DIR [--section serve|engine]
        [--kv-cache-dtype auto|fp8] [--vocab model|tokenizer] [--samplings sampled,greedy]
        [--shapes 1024/128,1024/1024] [--concurrency 1,16,64,128] [--seconds 10] [--budget-s 500]
        [--checkpoints /tmp/hf_checkpoints] [--guidellm "python3 -m guidellm"] [--dry-run]

The checkpoint (``peer_checkpoint``): Llama-3.1-8B's published ``config.json``, random bf16
weights written by transformers on the machine (once; kept under ``--checkpoints``), SmolLM2's
tokenizer beside them. ``--vocab model`` (the default) keeps the published 128,256 rows: the
79,104 ids the tokenizer lacks decode to ``''``; ``--vocab tokenizer`` serves 49,152 rows. The
record states the LM-head bytes either way and what the smaller vocabulary takes off.

``serve`` (the default section):

1. ``trtllm-serve DIR`` with ``kv_cache_config.dtype`` = ``--kv-cache-dtype``, ``max_batch_size``
   256, ``max_num_tokens`` 8192, chunked prefill; the rest the defaults (bf16, CUDA graphs, overlap);
2. a warm-up over HTTP (``warm_up_http``): per sampling, ``max(concurrency)`` requests at once
   asking for 8, 9, ... tokens, so every decode batch size is captured before anything is
   measured; first with short prompts, then with each shape's input length, so that the run
   measured first finds its prefill chunks and long-context attention warm too (without it, each
   shape's first run paid a warm-up the second did not); it also counts the share of generated
   ids the tokenizer lacks;
3. per shape and sampling (in the order sampled, greedy, greedy, sampled, ...), one ``guidellm
   run`` over ``/v1/completions``: synthetic text prompts of exactly ISL tokens, OSL output
   tokens (GuideLLM sends ``ignore_eos``), a ``concurrent`` profile of the ``--concurrency``
   levels, each ``--seconds`` long. ``greedy`` adds ``temperature: 0`` to every body through the
   backend's ``extras`` (``{"body": {"temperature": 0}}``, merged into the body GuideLLM builds);
   each run's prompts come from a seed of its own (``RUN_SEED``), so no run finds another's
   prompts in the prefix cache;
   ``sampled`` sends GuideLLM's own body, without ``temperature``, which the server runs at 1.0.
   Raw JSON: ``OUT/guidellm_<kv>_<isl>_<osl>_<sampling>.json.gz`` (every request's body is in it,
   so the summary shows the temperature each run sent).

``engine``: the same shapes, levels and samplings through ``LLM`` in-process (``peer_engine``).

``OUT/peer_<kv>.json`` / ``OUT/engine_<kv>.json`` hold each level summed up
(``peer_summary.level_summary``); ``python -m benchmarks.gpu.peer_summary OUT ...`` builds the
comparison table. ``--budget-s``: the section skips (and records) the runs that would end past
that many seconds from its start, so a device call is never killed with nothing written.
Preconditions (a GPU unless ``--dry-run``, GuideLLM runnable, the tokenizer, disk) are checked
first. ``--dry-run`` runs everything scaled down on the CPU (the checkpoint too, with the real
vocabulary) to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from benchmarks.gpu import peer_checkpoint
from benchmarks.gpu.peer_summary import summarize_guidellm

SERVE_OPTIONS = {
    "max_batch_size": 256, "max_num_tokens": 8192, "enable_chunked_prefill": True,
    "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True},
}
DRY_RUN_OPTIONS = {"max_batch_size": 16, "max_num_tokens": 512, "max_seq_len": 2048}
#: what a GuideLLM run costs beyond its levels: its start (tokenizer, data, backend check, report) and
#: a gap before each level (a fresh data worker process); the first run's measured wall replaces the guess
GUIDELLM_START_S, GUIDELLM_LEVEL_GAP_S = 15.0, 5.0
#: the body GuideLLM's openai_http backend merges into every request, per sampling
EXTRAS = {"sampled": None, "greedy": {"body": {"temperature": 0}}}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        isl, _, osl = item.partition("/")
        shapes.append((int(isl), int(osl)))
    return shapes


def run_order(shapes: list[tuple[int, int]], samplings: list[str]) -> list[tuple[tuple[int, int], str]]:
    """Shapes in turn, the samplings alternating order (A B, B A, ...): neither always goes first."""
    order = []
    for i, shape in enumerate(shapes):
        order += [(shape, s) for s in (samplings if i % 2 == 0 else samplings[::-1])]
    return order


#: each run's prompts come from a seed of their own (``RUN_SEED`` + the run's index): with block
#: reuse on, a run that re-sent an earlier run's prompts would prefill almost nothing (GuideLLM's
#: synthetic data is seeded 42 by default, so every run sent the same prompts and the second run of
#: a shape found ~1,000 of its 1,024 prompt tokens cached)
RUN_SEED = 1000


def guidellm_command(args, url: str, model: str, directory: Path, shape: tuple[int, int], sampling: str,
                     report: Path, seed: int) -> list[str]:
    isl, osl = shape
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions"}
    if EXTRAS[sampling] is not None:
        backend["extras"] = EXTRAS[sampling]
    streams = ",".join(f"streams[{i}]={c}" for i, c in enumerate(args.concurrency))
    return [
        *shlex.split(args.guidellm), "run",
        "--backend", json.dumps(backend),  # GuideLLM parses a --backend value as YAML/JSON too
        "--profile", f"kind=concurrent,{streams}",
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
        "--seed", f"kind=static,value={seed}",
        "--tokenizer", f"kind=huggingface_auto,model={directory}",
        "--output", f"kind=json,path={report}", "--output", "kind=console", "--disable-progress",
    ]


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
        Path(args.checkpoints).mkdir(parents=True, exist_ok=True)
        directory = peer_checkpoint.checkpoint_dir(args.checkpoints, args.vocab, args.dry_run)
        if not (directory / "config.json").is_file() and shutil.disk_usage(args.checkpoints).free < 20e9:
            problems.append(f"{shutil.disk_usage(args.checkpoints).free / 1e9:.0f} GB free for a 16 GB checkpoint")
    return problems


def prepare_checkpoint(args) -> tuple[Path, dict]:
    """The checkpoint directory (written in a child process if missing) and its vocabulary statement."""
    directory = peer_checkpoint.checkpoint_dir(args.checkpoints, args.vocab, args.dry_run)
    if not (directory / "config.json").is_file():
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.gpu.peer_checkpoint", "--write", str(directory),
                        "--tokenizer", str(args.tokenizer), "--vocab", args.vocab,
                        *(["--dry-run"] if args.dry_run else [])], check=True)
        print(f"wrote {directory} in {time.perf_counter() - began:.0f} s", flush=True)
    config = json.loads((directory / "config.json").read_text())
    size = peer_checkpoint.tokenizer_ids(directory)
    statement = peer_checkpoint.vocab_statement(config, size)
    statement["padded_probability_expected"] = peer_checkpoint.padded_probability(config["vocab_size"], size)
    return directory, statement


def warm_up_lengths(shapes: str) -> tuple[int, ...]:
    """The warm-up's prompt lengths: a short one, then every measured input length once."""
    return (32, *sorted({isl for isl, _ in parse_shapes(shapes)}))


def server_options(args) -> dict:
    options = {**SERVE_OPTIONS, "kv_cache_config": {**SERVE_OPTIONS["kv_cache_config"], "dtype": args.kv_cache_dtype}}
    return {**options, **DRY_RUN_OPTIONS} if args.dry_run else options


async def warm_up_http(url: str, model: str, tokenizer_ids: int, concurrency: int,
                       prompt_lens: tuple[int, ...] = (32,)) -> dict:
    """The HTTP twin of ``peer_engine.warm_up``: per prompt length and sampling, a ramp of
    ``concurrency`` requests."""
    import httpx

    from benchmarks.gpu.peer_engine import prompt_source, shares_of

    generated: dict[str, list[int]] = {"greedy": [], "sampled": []}
    limits = httpx.Limits(max_connections=concurrency + 8)  # all at once (httpx's default pool is 100)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for length in prompt_lens:
            next_prompt = prompt_source(length, tokenizer_ids, seed=1)
            for sampling, ids in generated.items():
                extra = {"temperature": 0} if sampling == "greedy" else {}
                bodies = [{"model": model, "prompt": next_prompt(), "max_tokens": 8 + i, "ignore_eos": True, **extra}
                          for i in range(concurrency)]
                answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))
                failed = [a.text[:300] for a in answers if a.status_code != 200]
                if failed:
                    raise RuntimeError(f"warm-up request failed: {failed[0]}")
                ids += [t for a in answers for t in a.json()["choices"][0]["token_ids"]]
    return shares_of(generated, tokenizer_ids)


def _start(args) -> dict:
    import torch

    return {"argv": sys.argv[1:], "kv_cache_dtype": args.kv_cache_dtype, "dry_run": args.dry_run,
            "seconds_per_level": args.seconds, "concurrency": args.concurrency, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu",
            "runs": {}, "skipped": []}


def serve_section(args, out: Path, deadline: float, record: dict, save: Callable[[dict], None]) -> None:
    """Fills ``record`` (saving it after each run)."""
    from benchmarks.serving.soak import ServerProcess

    directory, record["vocab"] = prepare_checkpoint(args)
    save(record)
    options = server_options(args)
    record["options"] = options
    options_path = out / f"serve_{args.kv_cache_dtype}.yaml"
    options_path.write_text(json.dumps(options))  # JSON is YAML
    serve = [str(directory), "--extra_llm_api_options", str(options_path), "--device", "cpu" if args.dry_run else "cuda"]
    began = time.perf_counter()
    server = ServerProcess(serve, out / f"server_{args.kv_cache_dtype}.log",
                           start_timeout_s=max(60.0, deadline - time.monotonic()))
    record["start_to_health_s"] = time.perf_counter() - began
    tokenizer_ids = record["vocab"]["tokenizer_ids"]
    try:
        log = (out / f"server_{args.kv_cache_dtype}.log").read_text()
        record["start_up_line"] = next((line for line in log.splitlines() if "KV pool" in line), None)
        began = time.perf_counter()
        record["warmup"] = asyncio.run(warm_up_http(server.url, directory.name, tokenizer_ids, max(args.concurrency),
                                                      warm_up_lengths(args.shapes)))
        record["warmup"]["wall_s"] = time.perf_counter() - began
        run_cost = (args.seconds + GUIDELLM_LEVEL_GAP_S) * len(args.concurrency) + GUIDELLM_START_S
        for index, ((isl, osl), sampling) in enumerate(run_order(parse_shapes(args.shapes), args.samplings)):
            shape = f"{isl}/{osl}"
            if time.monotonic() + run_cost > deadline:
                record["skipped"].append(f"{shape} {sampling}: would end past --budget-s (a run takes ~{run_cost:.0f} s)")
                continue
            report = out / f"guidellm_{args.kv_cache_dtype}_{isl}_{osl}_{sampling}.json"
            command = guidellm_command(args, server.url, directory.name, directory, (isl, osl), sampling, report,
                                       RUN_SEED + index)
            began = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=run_cost * 3 + 120,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
            (report.with_suffix(".log")).write_text(done.stdout + done.stderr)
            run = {"wall_s": time.perf_counter() - began, "returncode": done.returncode, "command": command}
            run_cost = 1.1 * run["wall_s"]  # the next run has as many levels as long
            if report.is_file():
                run["levels"] = summarize_guidellm(json.loads(report.read_text()))
                _gzip(report)  # every request's prompt is in it: some MB a run before compression
            record["runs"].setdefault(shape, {})[sampling] = run
            _print_run(f"{args.kv_cache_dtype} {shape} {sampling}", run)
            save(record)  # what is measured survives a call killed later
    finally:
        record["server_exit"] = server.stop()


def engine_section(args, out: Path, deadline: float, record: dict, save: Callable[[dict], None]) -> None:
    """The same shapes, levels and samplings through LLM in-process (``peer_engine``); fills ``record``."""
    from tensorrt_llm.llmapi.llm import LLM

    from benchmarks.gpu import peer_engine

    directory, record["vocab"] = prepare_checkpoint(args)
    save(record)
    options = server_options(args)
    record["options"] = options
    tokenizer_ids = record["vocab"]["tokenizer_ids"]
    began = time.perf_counter()
    with LLM(str(directory), device="cpu" if args.dry_run else "cuda", **options) as llm:
        record["start_to_ready_s"] = time.perf_counter() - began
        record["start_up_line"] = llm.describe()

        async def measure() -> None:
            began = time.perf_counter()
            record["warmup"] = await peer_engine.warm_up(llm, tokenizer_ids, max(args.concurrency),
                                                          warm_up_lengths(args.shapes))
            record["warmup"]["wall_s"] = time.perf_counter() - began
            for index, ((isl, osl), sampling) in enumerate(run_order(parse_shapes(args.shapes), args.samplings)):
                shape, levels = f"{isl}/{osl}", []
                next_prompt = peer_engine.prompt_source(isl, tokenizer_ids, seed=RUN_SEED + index)
                params = peer_engine.sampling_params(sampling, osl)
                for concurrency in args.concurrency:
                    if time.monotonic() + args.seconds + 5 > deadline:
                        record["skipped"].append(f"{shape} {sampling} c={concurrency}: would end past --budget-s")
                        continue
                    levels.append(await peer_engine.run_level(llm, next_prompt, params, concurrency, args.seconds))
                run = {"levels": levels}
                record["runs"].setdefault(shape, {})[sampling] = run
                _print_run(f"engine {args.kv_cache_dtype} {shape} {sampling}", run)
                save(record)

        asyncio.run(measure())


def _gzip(path: Path) -> None:
    with path.open("rb") as raw, gzip.open(path.with_name(path.name + ".gz"), "wb") as packed:
        shutil.copyfileobj(raw, packed)
    path.unlink()


def _print_run(title: str, run: dict) -> None:
    parts = [f"c={lv['concurrency']}: {lv['completed']}+{lv['incomplete']} done+cut, {lv['errored']} errors,"
             f" {lv['output_tokens_per_s'] or 0:.0f} tok/s, ITL p50 {lv['itl_ms']['p50'] or 0:.2f} ms,"
             f" TTFT p50 {lv['ttft_ms']['p50'] or 0:.0f} ms" for lv in run.get("levels") or []]
    print(f"{title}: " + ("; ".join(parts) or f"no levels (returncode {run.get('returncode')})"), flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--section", choices=("serve", "engine"), default="serve")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--vocab", choices=("model", "tokenizer"), default="model",
                        help="128,256 rows (model: the ids the tokenizer lacks decode to '') or the tokenizer's")
    parser.add_argument("--samplings", default="sampled,greedy", type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--checkpoints", default="/tmp/hf_checkpoints")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory (SmolLM2's)")
    parser.add_argument("--shapes", default="1024/128,1024/1024")
    parser.add_argument("--concurrency", default="1,16,64,128", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--seconds", type=float, default=10, help="each concurrency level's duration")
    parser.add_argument("--budget-s", type=float, default=500, help="skip what would end later than this")
    parser.add_argument("--guidellm", default=f"{sys.executable} -m guidellm", help="the GuideLLM command")
    parser.add_argument("--dry-run", action="store_true", help="scaled down on the CPU: checks the script")
    args = parser.parse_args(argv)
    unknown = [s for s in args.samplings if s not in EXTRAS]
    if unknown:
        parser.error(f"unknown samplings {unknown}; known: {', '.join(EXTRAS)}")
    problems = preconditions(args)
    if problems:
        print("not run: " + "; ".join(problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    section = serve_section if args.section == "serve" else engine_section
    path = args.out / f"{'peer' if args.section == 'serve' else 'engine'}_{args.kv_cache_dtype}.json"

    def save(record: dict) -> None:
        record["wall_s"] = time.monotonic() - started
        path.write_text(json.dumps(record, indent=2, default=str))

    record = _start(args)
    try:
        section(args, args.out, started + args.budget_s, record, save)
    except Exception as error:  # the record says what failed, beside what was measured before
        record["error"] = f"{type(error).__name__}: {error}"
        save(record)
        raise
    save(record)
    print(f"{path.name} written after {record['wall_s']:.0f} s"
          + (f"; skipped: {record['skipped']}" if record["skipped"] else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
