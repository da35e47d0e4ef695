"""The server's host cost per streamed token: ``trtllm-serve`` on the simulated engine (no model
arithmetic: each forward sleeps a cost formula of its batch) under N concurrent streaming
``/v1/completions`` clients with fresh text prompts, against the same requests through ``LLM``
in-process on the same engine (the engine's ceiling).

    python -m benchmarks.serving.stream_cost [--streams 128] [--prompt-tokens 1024] [--output-tokens 256]
        [--rounds 3] [--simulated '{"step_s": 0.002}'] [--baseline-tree PATH] [--json OUT.json]

Each round runs, alternated: ``engine`` (``LLM.generate_async`` streams consumed on an event
loop, in a child process), ``serve`` (this tree's ``trtllm-serve``), and with ``--baseline-tree``
``baseline`` (``trtllm-serve`` from another checkout, e.g. ``git worktree add /tmp/base main``:
the server is started with that tree as its working directory, so its ``tensorrt_llm`` is the
one imported). The client is a bare asyncio HTTP/1.1 reader (no httpx, no openai: on a small
machine the client's own cost would otherwise be the measurement); it counts ``data:`` events
with a choice and records each stream's time to first token and inter-token latencies.

The server's CPU seconds are read from ``/proc/<pid>/task/*/stat`` (Linux) around the streaming
phase: the main thread (uvicorn's event loop) apart from every other thread (the executor, the
tokenizer's worker threads). Printed per streamed token, with the output tok/s as a ratio to the
engine's measured in the same round, and ITL / TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "smollm2-135m-instruct"  # the simulated engine reads its config and tokenizer: no weights
#: The forward's cost (SimulatedEngineConfig): decode steps of about 8 ms + 0.05 ms a row + the KV read (an 8B
#: model's order on one H100: about 20 ms at 128 rows of 1,200 tokens), prefill at 100,000 tokens/s so the prompts of 128
#: streams are in within a couple of seconds.
SIMULATED = {"context_token_s": 1e-5, "decode_token_s": 5e-5}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ prompts


def text_prompts(count: int, tokens: int, seed: int) -> list[str]:
    """``count`` distinct texts of about ``tokens`` SmolLM2 tokens each (fresh prompts: no prefix
    is shared, so every prompt is computed and tokenized)."""
    from tensorrt_llm.llmapi.tokenizer import Tokenizer
    from tensorrt_llm._torch.models.checkpoints import packaged_checkpoint_path

    tokenizer = Tokenizer.from_gguf(packaged_checkpoint_path(MODEL))
    rng = random.Random(seed)
    words = [w for w in ("the of and to in is was for on that with as by at from his her an be this which or are had "
                         "but not what all were when we there can more if no out so said one about up time them "
                         "some could into two has than then first way been call who oil its now find long down day "
                         "did get come made may part over new sound take only little work know place year live me "
                         "back give most very after thing our just name good sentence man think say great where "
                         "help through much before line right too mean old any same tell boy follow came want show "
                         "river garden window winter engine market silver orange planet harbour library").split()]
    per_word = len(tokenizer.encode(" ".join(words), add_special_tokens=False)) / len(words)
    prompts = []
    for i in range(count):
        body = " ".join(rng.choice(words) for _ in range(int(tokens / per_word)))
        prompts.append(f"Request {i} of run {seed}. {body}")
    return prompts


# ------------------------------------------------------------------------------ the client


@dataclass(slots=True)
class Stream:
    """One streamed request as the client saw it (``time.perf_counter()`` seconds)."""

    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # a data: event with a choice
    done: bool = False
    error: str | None = None


async def _read_chunked(reader: asyncio.StreamReader, on_data) -> None:
    """A chunked HTTP/1.1 body, fed to ``on_data`` as it arrives, until the last chunk."""
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        on_data(await reader.readexactly(size))
        await reader.readexactly(2)


async def stream_one(host: str, port: int, prompt: str, max_tokens: int) -> Stream:
    record = Stream()
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    record.sent = time.perf_counter()
    writer.write(head + body)
    pending = b""

    def on_data(data: bytes) -> None:
        nonlocal pending
        now = time.perf_counter()
        pending += data
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event == b"data: [DONE]":
                record.done = True
            elif b'"choices":[{' in event:  # a token chunk (the usage chunk has none)
                record.arrivals.append(now)
            elif b'"error"' in event:
                record.error = event.decode()[:200]

    try:
        status = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if b" 200 " not in status:
            record.error = status.decode().strip()
            return record
        await _read_chunked(reader, on_data)
    finally:
        writer.close()
    return record


async def drive(host: str, port: int, prompts: list[str], max_tokens: int) -> tuple[list[Stream], float]:
    start = time.perf_counter()
    streams = await asyncio.gather(*(stream_one(host, port, p, max_tokens) for p in prompts))
    return list(streams), time.perf_counter() - start


# ------------------------------------------------------------------------------ the server


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid``'s main thread and of all its other threads."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def serve_argv(streams: int, prompt_tokens: int, output_tokens: int, simulated: dict) -> list[str]:
    return [MODEL, "--port", "0", "--max_batch_size", str(streams),
            "--max_seq_len", str(prompt_tokens + output_tokens + 256),
            "--kv_cache_config.max_tokens", str(streams * (prompt_tokens + output_tokens + 256)),
            *(arg for key, value in simulated.items() for arg in (f"--simulated_engine.{key}", f"{value:.9f}"))]


def start_server(tree: Path, argv: list[str]) -> tuple[subprocess.Popen, str, int]:
    """``trtllm-serve`` run from ``tree`` (its ``tensorrt_llm`` is imported); (process, host, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorrt_llm.commands.serve", *argv, "--log_level", "info"],
                            cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, log = time.monotonic() + 300, []
    for line in proc.stdout:
        log.append(line)
        match = re.search(r"serving \S+ at http://(\S+):(\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, match.group(1), int(match.group(2))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"trtllm-serve from {tree} did not start:\n" + "".join(log[-20:]))


def run_served(tree: Path, args: argparse.Namespace, prompts: list[str], warmup: list[str]) -> dict:
    proc, host, port = start_server(tree, serve_argv(args.streams, args.prompt_tokens, args.output_tokens,
                                                         args.simulated))
    try:
        asyncio.run(drive(host, port, warmup, 8))  # imports, first-request paths, the tokenizer warm
        before = thread_cpu_s(proc.pid)
        streams, wall_s = asyncio.run(drive(host, port, prompts, args.output_tokens))
        after = thread_cpu_s(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    summary = summarize(streams, wall_s)
    tokens = summary["output_tokens"]
    summary["loop_cpu_s"] = after[0] - before[0]
    summary["other_threads_cpu_s"] = after[1] - before[1]
    summary["loop_us_per_token"] = 1e6 * summary["loop_cpu_s"] / max(tokens, 1)
    summary["server_us_per_token"] = 1e6 * (summary["loop_cpu_s"] + summary["other_threads_cpu_s"]) / max(tokens, 1)
    return summary


# ------------------------------------------------------------------------------ the engine's ceiling


def engine_child() -> None:
    """In a child process: the same requests (JSON on stdin) through ``LLM`` in-process; prints one JSON line."""
    from tensorrt_llm.llmapi import LLM, SamplingParams

    config = json.load(sys.stdin)
    llm = LLM(MODEL, simulated_engine=config["simulated"], max_batch_size=config["streams"],
              max_seq_len=config["prompt_tokens"] + config["output_tokens"] + 256,
              kv_cache_config={"max_tokens": config["streams"] * (config["prompt_tokens"] + config["output_tokens"] + 256)})

    async def one(prompt: str, max_tokens: int) -> Stream:
        record = Stream(sent=time.perf_counter())
        ids = await asyncio.to_thread(llm.tokenizer.encode, prompt)  # as the server does it
        seen = 0
        async for output in llm.generate_async(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                   temperature=0)):
            now = time.perf_counter()
            new = output.outputs[0].token_ids[seen:]
            seen += len(new)
            if new:
                record.arrivals.append(now)
        record.done = True
        return record

    async def run(prompts: list[str], max_tokens: int) -> tuple[list[Stream], float]:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one(p, max_tokens) for p in prompts))
        return list(streams), time.perf_counter() - start

    try:
        asyncio.run(run(config["warmup"], 8))
        streams, wall_s = asyncio.run(run(config["prompts"], config["output_tokens"]))
    finally:
        llm.shutdown()
    print(json.dumps(summarize(streams, wall_s)), flush=True)


def run_engine(args: argparse.Namespace, prompts: list[str], warmup: list[str]) -> dict:
    config = {"simulated": args.simulated, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens,
              "prompts": prompts, "warmup": warmup}
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving.stream_cost", "--engine-child"], input=json.dumps(config),
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ results


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(streams: list[Stream], wall_s: float) -> dict:
    """Output tokens counted as chunks with a choice (one token each here: the synthetic sampler
    never emits a partial character, and one step adds one token to a stream)."""
    ttft = [s.arrivals[0] - s.sent for s in streams if s.arrivals]
    itl = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    tokens = sum(len(s.arrivals) for s in streams)
    return {"streams": len(streams), "completed": sum(s.done for s in streams),
            "errors": [s.error for s in streams if s.error][:3], "output_tokens": tokens, "wall_s": wall_s,
            "output_tok_s": tokens / wall_s, "ttft_p50_s": _p50(ttft), "itl_p50_ms": 1e3 * (_p50(itl) or 0.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulated", type=json.loads, default={},
                        help="SimulatedEngineConfig fields over the defaults here, as JSON (e.g. '{\"step_s\": 0.002}')")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout whose trtllm-serve runs alternated with this tree's")
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine reference")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.simulated = {**SIMULATED, **args.simulated}
    if args.engine_child:
        engine_child()
        return 0
    here = Path(__file__).resolve().parents[2]
    trees = {"serve": here} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    results: dict[str, list[dict]] = {name: [] for name in ([] if args.no_engine else ["engine"]) + list(trees)}
    for round_ in range(args.rounds):
        prompts = text_prompts(args.streams, args.prompt_tokens, seed=1000 + round_)
        warmup = text_prompts(4, 64, seed=round_)
        order = list(results) if round_ % 2 == 0 else list(reversed(results))  # A/B alternated
        for name in order:
            result = run_engine(args, prompts, warmup) if name == "engine" else run_served(trees[name], args, prompts,
                                                                                            warmup)
            results[name].append(result)
        for name in order:
            result = results[name][round_]
            ratio = ""
            if name != "engine" and "engine" in results:
                ratio = f"  {result['output_tok_s'] / results['engine'][round_]['output_tok_s']:.2f}x engine"
            cost = (f"  loop {result['loop_us_per_token']:.1f} us/token, server {result['server_us_per_token']:.1f}"
                    f" us/token" if "loop_us_per_token" in result else "")
            print(f"round {round_} {name:8s} {result['output_tok_s']:8.0f} tok/s{ratio}  ITL p50"
                  f" {result['itl_p50_ms']:.1f} ms  TTFT p50 {result['ttft_p50_s']:.2f} s{cost}"
                  f"  ({result['completed']}/{result['streams']} done)", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]
                      if isinstance(runs[0][key], (int, float))} for name, runs in results.items()}
    print("medians:")
    for name, median in medians.items():
        print(f"  {name:8s} " + "  ".join(f"{k} {v:.4g}" for k, v in median.items()))
    document = {"benchmark": "serving.stream_cost", "model": MODEL, "simulated_engine": args.simulated,
                "streams": args.streams, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                "rounds": args.rounds, "runs": results, "medians": medians}
    if args.json:
        args.json.write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
