"""What prefix-aware routing buys across replicas: one trace, served by N replicas under Ray
Serve with each router, and by one server with the replicas' total KV memory.

    python -m benchmarks.serving.scale_out [--replicas 2] [--routers prefix_aware,round_robin,power_of_two,single]
        [--num-requests 300] [--trace FILE --format auto] [--blocks-per-replica 2048] [--tokens-per-block 32]
        [--max-output-tokens 32] [--simulated '{context_token_s: 1e-4}'] [--json OUT.json] [--plot OUT.png]

Each configuration is a Ray Serve application (``tensorrt_llm.serve.ray_serve.build_app``) in a
local Ray cluster, reached through Ray Serve's HTTP proxy: real HTTP, the real executor, KV
manager, events and server in every replica; the forward is the simulated engine's
(``LLM(simulated_engine=...)``: each forward sleeps a cost formula of its batch, a 12B model on
one H200 by default; no arithmetic), so N replicas fit a 2-core machine. ``single`` is one
replica with N times the blocks (the same total KV memory) and one replica's compute: the
reference for prefix hits, not for latency.

The trace (default: the replay's built-in multi-turn scenario; or ``--trace``, e.g. Mooncake's
with its ``hash_ids``) is sent at its arrival times as streamed ``/v1/completions`` calls whose
prompts are token ids, so its prefix structure reaches the replicas exactly. Measured at the
client: TTFT, output tokens per second, each request's replica (``x-trtllm-replica``) and its
prefix-hit tokens (``usage.prompt_tokens_details.cached_tokens``). Load imbalance is the busiest
replica's share over the mean: of requests, and of prompt tokens computed (not hit).

Goals (printed as PASS / FAIL): prefix-aware routing reaches >= 90% of the single server's
prefix-hit tokens, and its TTFT p99 is below round-robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx
import yaml

from benchmarks.replay.cli import TraceSpec
from benchmarks.replay.loop import percentiles
from benchmarks.replay.traces import Trace, TraceRequest

ROUTERS = ("prefix_aware", "round_robin", "power_of_two", "single")
MODEL = "mistral-nemo-12b-random"  # the simulated engine reads its shape only: 131072 positions, vocabulary 131072
#: The forward's cost (SimulatedEngineConfig): the defaults (12B on one H200) with prefill at 10,000 tokens/s, so
#: that recomputing a prefix costs what it does on a loaded GPU.
SIMULATED = {"context_token_s": 1e-4}
REPLICA_HEADER = "x-trtllm-replica"


@dataclass(slots=True)
class Record:
    """One request as the client saw it (``time.perf_counter()`` seconds)."""

    sent: float = 0.0
    first_token: float | None = None
    done: float = 0.0
    replica: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


# ------------------------------------------------------------------------------- the client


async def send(client: httpx.AsyncClient, request: TraceRequest, max_tokens: int, start: float) -> Record:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    record = Record(sent=time.perf_counter())
    body = {"prompt": request.prompt_token_ids().tolist(), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            record.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record.error = chunk["error"]["message"]
                    elif chunk.get("usage") and not chunk.get("choices"):
                        usage = chunk["usage"]
                        record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    elif record.first_token is None and any(c.get("token_ids") for c in chunk["choices"]):
                        record.first_token = time.perf_counter()
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.done = time.perf_counter()
    return record


async def replay(url: str, trace: Trace, max_output_tokens: int, timeout_s: float) -> list[Record]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(send(client, r, min(r.output_len, max_output_tokens), start)
                                           for r in trace.requests)))


def summarize(records: Sequence[Record], replicas: int) -> dict:
    completed = [r for r in records if r.error is None]
    wall = max(r.done for r in records) - min(r.sent for r in records)
    ttft = [(r.first_token - r.sent) * 1e3 for r in completed if r.first_token is not None]
    per_replica: dict[str, dict] = collections.defaultdict(lambda: {"requests": 0, "prompt_tokens": 0,
                                                                    "computed_tokens": 0})
    for r in completed:
        entry = per_replica[r.replica or "?"]
        entry["requests"] += 1
        entry["prompt_tokens"] += r.prompt_tokens
        entry["computed_tokens"] += r.prompt_tokens - r.cached_tokens
    loads = list(per_replica.values()) + [{"requests": 0, "computed_tokens": 0}] * (replicas - len(per_replica))

    def imbalance(key: str) -> float:
        values = [entry[key] for entry in loads]
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 0.0

    prompt = sum(r.prompt_tokens for r in completed)
    hits = sum(r.cached_tokens for r in completed)
    return {
        "requests": len(records), "completed": len(completed), "errored": len(records) - len(completed),
        "errors": dict(collections.Counter(r.error[:160] for r in records if r.error).most_common(3)),
        "prompt_tokens": prompt, "prefix_hit_tokens": hits, "prefix_hit_rate": hits / prompt if prompt else 0.0,
        "ttft_ms": percentiles(ttft), "e2e_ms": percentiles([(r.done - r.sent) * 1e3 for r in completed]),
        "output_tokens_per_s": sum(r.output_tokens for r in completed) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "imbalance_requests": imbalance("requests"), "imbalance_computed_tokens": imbalance("computed_tokens"),
        "per_replica": {f"replica {i}": entry for i, (_, entry) in enumerate(sorted(per_replica.items()))},
    }


# ------------------------------------------------------------------------------- the cluster


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deploy(serve, url: str, router: str, replicas: int, args: argparse.Namespace, simulated: dict) -> str:
    """One configuration's application, running and healthy; its name."""
    from tensorrt_llm.serve.ray_serve import build_app

    blocks = args.blocks_per_replica * (replicas if router == "single" else 1)
    name = f"scale-out-{router}"
    app = build_app(model=MODEL, num_replicas=1 if router == "single" else replicas,
                    router="prefix_aware" if router == "single" else router,
                    max_load_gap=args.max_load_gap, replica_num_cpus=0.5, ingress_num_cpus=0.5,
                    llm={"simulated_engine": simulated, "max_num_tokens": args.max_num_tokens,
                         "enable_chunked_prefill": True, "max_batch_size": 128,
                         "kv_cache_config": {"tokens_per_block": args.tokens_per_block, "num_blocks": blocks}})
    serve.run(app, name=name, route_prefix="/")
    want = 1 if router == "single" else replicas
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).json().get("healthy_replicas") == want:
                return name
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name}: the replicas did not report healthy in 180 s")


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    simulated = {**SIMULATED, **(yaml.safe_load(args.simulated) or {})} if args.simulated else dict(SIMULATED)
    spec = TraceSpec(path=args.trace, format=args.format, num_requests=args.num_requests, seed=args.seed)
    trace = spec.load_for(vocab_size=131072, tokens_per_block=args.tokens_per_block)
    ray.init(address="local", num_cpus=max(4, args.replicas + 2), include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[dict]] = {router: [] for router in args.routers}
    try:
        for round_ in range(args.rounds):  # routers alternate within a round: the machine's load drifts
            for router in args.routers:
                name = deploy(serve, url, router, args.replicas, args, simulated)
                records = asyncio.run(replay(url, trace, args.max_output_tokens, args.timeout))
                summary = summarize(records, 1 if router == "single" else args.replicas)
                results[router].append(summary)
                print(_row(router, summary, round_), flush=True)
                serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    best = {router: _median_round(runs) for router, runs in results.items()}
    return {
        "config": {"replicas": args.replicas, "routers": list(args.routers), "model": MODEL, "simulated_engine": simulated,
                   "trace": args.trace or "default-scenario", "num_requests": len(trace), "notes": list(trace.notes),
                   "blocks_per_replica": args.blocks_per_replica, "single_server_blocks":
                   args.blocks_per_replica * args.replicas, "tokens_per_block": args.tokens_per_block,
                   "max_output_tokens": args.max_output_tokens, "max_num_tokens": args.max_num_tokens,
                   "max_load_gap": args.max_load_gap, "rounds": args.rounds, "ray": ray.__version__},
        "results": best,
        "rounds": results,
        "goals": goals(best),
    }


def _median_round(runs: list[dict]) -> dict:
    """The round with the median TTFT p99 (one round: that one)."""
    return sorted(runs, key=lambda r: r["ttft_ms"]["p99"])[len(runs) // 2]


def goals(results: dict) -> dict:
    out = {}
    if "prefix_aware" in results and "single" in results:
        single = results["single"]["prefix_hit_tokens"]
        ratio = results["prefix_aware"]["prefix_hit_tokens"] / single if single else 0.0
        out["hits_vs_single"] = {"ratio": ratio, "goal": 0.9, "met": ratio >= 0.9}
    if "prefix_aware" in results and "round_robin" in results:
        ours, theirs = results["prefix_aware"]["ttft_ms"]["p99"], results["round_robin"]["ttft_ms"]["p99"]
        out["ttft_p99_vs_round_robin"] = {"prefix_aware_ms": ours, "round_robin_ms": theirs, "met": ours < theirs}
    return out


# ------------------------------------------------------------------------------- report


def _row(router: str, s: dict, round_: int | None = None) -> str:
    tag = f"{router}" + (f" (round {round_})" if round_ is not None else "")
    return (f"  {tag:<24} {s['completed']:>4}/{s['requests']:<4} hits {s['prefix_hit_tokens']:>9} "
            f"({s['prefix_hit_rate']:5.1%})  TTFT p50 {s['ttft_ms']['p50']:7.0f} p99 {s['ttft_ms']['p99']:7.0f} ms  "
            f"{s['output_tokens_per_s']:6.1f} tok/s  imbalance req {s['imbalance_requests']:.2f} "
            f"computed {s['imbalance_computed_tokens']:.2f}")


def markdown_table(document: dict) -> str:
    rows = ["| router | prefix-hit tokens (rate) | TTFT p50 / p99 ms | output tok/s | imbalance: requests / computed tokens |",
            "|---|---|---|---|---|"]
    for router, s in document["results"].items():
        label = f"single server ({document['config']['single_server_blocks']} blocks)" if router == "single" else router
        rows.append(f"| {label} | {s['prefix_hit_tokens']:,} ({s['prefix_hit_rate']:.1%}) | "
                    f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | {s['output_tokens_per_s']:.1f} | "
                    f"{s['imbalance_requests']:.2f} / {s['imbalance_computed_tokens']:.2f} |")
    return "\n".join(rows)


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = document["results"]
    routers = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(routers, [results[r]["prefix_hit_tokens"] for r in routers], color="tab:green")
    axes[0].set_title("prefix-hit tokens")
    width = 0.38
    xs = range(len(routers))
    axes[1].bar([x - width / 2 for x in xs], [results[r]["ttft_ms"]["p50"] for r in routers], width, label="p50")
    axes[1].bar([x + width / 2 for x in xs], [results[r]["ttft_ms"]["p99"] for r in routers], width, label="p99")
    axes[1].set_xticks(list(xs), routers)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    for i, router in enumerate(routers):
        loads = [entry["computed_tokens"] for entry in results[router]["per_replica"].values()]
        bottom = 0
        for load in loads:
            axes[2].bar(i, load, bottom=bottom, edgecolor="white")
            bottom += load
    axes[2].set_xticks(list(xs), routers)
    axes[2].set_title("prompt tokens computed, per replica (stacked)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    c = document["config"]
    fig.suptitle(f"{c['replicas']} replicas under Ray Serve, {c['num_requests']} requests of {c['trace']}"
                 f" (simulated {c['model']}; single server: {c['single_server_blocks']} blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.scale_out", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--trace", default=None, help="trace file; default: the replay's built-in multi-turn scenario")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "azure", "trtllm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks-per-replica", type=int, default=2048, help="each replica's KV pool, in blocks")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--max-output-tokens", type=int, default=32, help="cap each output (the client's CPU streams them)")
    p.add_argument("--max-load-gap", type=int, default=4, help="the prefix-aware router's load bound")
    p.add_argument("--simulated", default=None, help="SimulatedEngineConfig fields over the defaults, as YAML")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every router; the median TTFT p99 is kept")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout, seconds")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--plot", metavar="OUT.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        parser.error(f"unknown router(s) {unknown}; choose from {', '.join(ROUTERS)}")
    for name in ("replicas", "num_requests", "blocks_per_replica", "tokens_per_block", "max_output_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        parser.error("--timeout must be a finite number > 0")
    print(f"scale_out: {args.replicas} replicas, routers {', '.join(args.routers)}", flush=True)
    document = run(args)
    print(markdown_table(document))
    for goal, verdict in document["goals"].items():
        print(f"  {goal}: {'PASS' if verdict['met'] else 'FAIL'} {verdict}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(document, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
