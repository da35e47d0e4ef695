"""Replay a request trace against a running server over HTTP (docs/design.md §6).

    python -m benchmarks.serving.replay --url http://127.0.0.1:8000 [--trace FILE --format ...] \
        [--num-requests N] [--time-scale X | --qps R | --concurrency N] [--max-output-tokens N] [--json OUT.json]

Without ``--trace`` it sends the built-in default scenario (``benchmarks.replay.scenario``), loaded
and re-timed exactly as ``benchmarks.replay`` loads it. Each request is sent at its trace
timestamp (after ``--time-scale`` / ``--qps``) with the ``openai`` async client, as a
streamed ``/v1/completions`` call whose prompt is the trace's token ids — so the prefix
structure the trace describes reaches the server exactly — asking for the trace's output
length (``ignore_eos``, greedy). ``--concurrency N`` replaces the timestamps by a closed loop: N
users, each sending the trace's next request as soon as its previous one is answered (requests
in trace order; arrival times ignored). Time to first token and inter-token latency are measured at
the client; ``output_tokens_per_s`` is every delivered token over the wall time from the
first send to the last answer. The server's budget counters are the difference of its
``/prometheus/metrics`` before and after the run.

Token ids are drawn from the server's vocabulary (``vocab_size`` of ``/v1/models``, or
``--vocab-size``). A request the server refuses (4xx, e.g. longer than its ``max_seq_len``)
or fails (5xx, a streamed error) counts as errored; ``refused`` and ``errors`` say which.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.replay.cli import TraceSpec
from benchmarks.replay.loop import Progress, percentiles
from benchmarks.replay.traces import DEFAULT_VOCAB_SIZE, Trace, TraceRequest

#: result["server"] key -> the Prometheus sample it is the difference of
SERVER_COUNTERS = {
    "budget_deferrals": "trtllm_budget_deferrals_total",
    "budget_overshoots": "trtllm_budget_overshoots_total",
    "failed_batches": "trtllm_failed_batches_total",
    "prefix_cache_hit_tokens": "trtllm_prefix_cache_hit_tokens_total",
    "prefix_cache_query_tokens": "trtllm_prefix_cache_query_tokens_total",
    "iterations": "trtllm_iterations_total",
}


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    status: int | None = None  # HTTP status of a refused or failed request
    # how it failed: "http" (a status: refused, or failed before streaming), "stream" (an error
    # event in the stream), "transport" (the connection failed), "timeout" (no answer in time)
    error_kind: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayTarget:
    url: str
    model: str
    vocab_size: int
    api_key: str | None
    timeout_s: float


# ------------------------------------------------------------------------------- server side


def scrape_counters(url: str) -> dict[str, float] | None:
    """The SERVER_COUNTERS samples of ``/prometheus/metrics``; None when the server has none."""
    try:
        response = httpx.get(f"{url}/prometheus/metrics", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    wanted = set(SERVER_COUNTERS.values())
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def discover(url: str, api_key: str | None) -> tuple[str, int | None]:
    """(model id, vocabulary size or None) from ``/v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    card = response.json()["data"][0]
    return card["id"], card.get("vocab_size")


# ------------------------------------------------------------------------------- client side


async def send_one(client: openai.AsyncOpenAI, target: ReplayTarget, request: TraceRequest, max_tokens: int,
                   start: float | None) -> RequestRecord:
    """Wait for the request's arrival time (``start`` + its ``arrival_s``; None: send now), then
    stream it and time every token."""
    if start is not None:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    record = RequestRecord(sent=time.perf_counter())
    prompt = request.prompt_token_ids().tolist()
    try:
        # The token ids travel in extra_body, which the client sends as it is: given as
        # ``prompt``, the openai client walks the list element by element (183 ms of Python for
        # a 9k-token prompt on a 2-core machine, against 2 ms), and at 4x the scenario's rate
        # that starved the client's own event loop for up to 62 s on the H200's host.
        stream = await client.completions.create(
            model=target.model, prompt=[], max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"prompt": prompt, "ignore_eos": True},
        )
        last = None
        async for chunk in stream:
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            count = len(getattr(choice, "token_ids", None) or ()) or (1 if choice.text else 0)
            if count == 0:
                continue
            now = time.perf_counter()
            if last is None:
                record.first_token = now
            else:
                record.itl_s.extend([(now - last) / count] * count)
            last = now
    except openai.APIStatusError as error:
        record.error, record.status, record.error_kind = error.message, error.status_code, "http"
    except openai.APITimeoutError as error:
        record.error, record.error_kind = error.message, "timeout"
    except openai.APIConnectionError as error:
        record.error, record.error_kind = f"{error.message} ({type(error.__cause__).__name__})", "transport"
    except openai.APIError as error:  # a streamed error event
        record.error, record.error_kind = error.message, "stream"
    record.done = time.perf_counter()
    return record


async def replay(trace: Trace, target: ReplayTarget, max_output_tokens: int | None,
                 progress: Progress, concurrency: int | None = None) -> tuple[list[RequestRecord], float, float]:
    """Every request of ``trace`` at its time, or (``concurrency``) in trace order by that many
    users in a closed loop; returns (records, first send, last answer)."""
    async with openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.api_key or "none", max_retries=0,
                                  timeout=target.timeout_s) as client:
        start = time.perf_counter()
        done = 0
        users = asyncio.Semaphore(concurrency) if concurrency else None  # FIFO: requests go in trace order

        async def tracked(request: TraceRequest) -> RequestRecord:
            nonlocal done
            max_tokens = min(request.output_len, max_output_tokens or request.output_len)
            if users is None:
                record = await send_one(client, target, request, max_tokens, start)
            else:
                async with users:
                    record = await send_one(client, target, request, max_tokens, None)
            done += 1
            progress.update(done)
            return record

        records = await asyncio.gather(*(tracked(r) for r in trace.requests))
    first = min(r.sent for r in records)
    last = max(r.done for r in records)
    return list(records), first, last


def summarize(records: Sequence[RequestRecord], wall_s: float, server: dict | None) -> dict:
    completed = [r for r in records if r.error is None]
    errors = collections.Counter(f"{r.status or 'stream'}: {r.error[:160]}" for r in records if r.error)
    ttft = [(r.first_token - r.sent) * 1e3 for r in completed if r.first_token is not None]
    itl = [gap * 1e3 for r in completed for gap in r.itl_s]
    output_tokens = sum(r.output_tokens for r in records)
    return {
        "requests": len(records),
        "completed": len(completed),
        "errored": len(records) - len(completed),
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "server": server,
        # beyond docs/design.md §6
        "refused": sum(1 for r in records if r.status is not None and 400 <= r.status < 500),
        "errors": dict(errors.most_common(5)),
        "error_kinds": dict(collections.Counter(r.error_kind for r in records if r.error_kind)),
        "statuses": {str(k): v for k, v in sorted(collections.Counter(r.status for r in records if r.status).items())},
        "output_tokens": output_tokens,
        "e2e_ms": percentiles([(r.done - r.sent) * 1e3 for r in completed]),
    }


def counter_diff(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {key: int(round(after.get(name, 0.0) - before.get(name, 0.0))) for key, name in SERVER_COUNTERS.items()}


# ------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.replay",
                                description="Replay a trace against a running server over HTTP (docs/design.md §6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--trace", help="trace file; default: the built-in default scenario")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "azure", "trtllm"))
    p.add_argument("--num-requests", type=int, default=None, help="keep the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (> 1 = less load)")
    p.add_argument("--qps", type=float, default=None, help="replace arrivals by Poisson arrivals at this rate")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: N users, each sends the next request when its previous one is answered")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output length")
    p.add_argument("--json", metavar="OUT.json", help="write the result")
    p.add_argument("--seed", type=int, default=0, help="scenario seed; Azure content seed; --qps arrival seed")
    p.add_argument("--model", default=None, help="model id; default: the server's first")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids to draw from; default: the server's")
    p.add_argument("--tokens-per-block", type=int, default=32, help="the scenario block-aligns regenerates to this")
    p.add_argument("--api-key", default=None, help="bearer key for /v1 (default: $TRTLLM_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_requests", "max_output_tokens", "vocab_size", "tokens_per_block", "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        parser.error(f"--time-scale must be a finite number >= 0, got {args.time_scale}")
    for name in ("qps", "timeout"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name} must be a finite number > 0, got {value}")
    if args.concurrency is not None and (args.qps is not None or args.time_scale != 1.0):
        parser.error("--concurrency replaces the arrival times: it does not go with --qps or --time-scale")


def format_table(document: dict) -> str:
    c, r = document["config"], document["result"]
    server = r["server"] or {}
    rows = [
        f"serve_replay: {c['trace']} ({c['requests']} requests) -> {c['url']} model {c['model']}",
        *(f"  note: {note}" for note in c["notes"]),
        f"  {'requests':>8} {'completed':>9} {'errored':>7} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16}"
        f" {'out tok/s':>9} {'wall s':>7} {'deferrals':>9} {'overshoots':>10} {'failed batches':>14}",
        f"  {r['requests']:>8} {r['completed']:>9} {r['errored']:>7}"
        f" {r['ttft_ms']['p50']:>8.0f}/{r['ttft_ms']['p99']:<8.0f} {r['itl_ms']['p50']:>7.1f}/{r['itl_ms']['p99']:<8.1f}"
        f" {r['output_tokens_per_s']:>9.1f} {r['wall_s']:>7.1f} {server.get('budget_deferrals', '-'):>9}"
        f" {server.get('budget_overshoots', '-'):>10} {server.get('failed_batches', '-'):>14}",
    ]
    rows += [f"  error x{count}: {message}" for message, count in r["errors"].items()]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    url = args.url.rstrip("/")
    api_key = args.api_key or os.environ.get("TRTLLM_API_KEY")
    try:
        model, server_vocab = discover(url, api_key)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        parser.error(f"cannot read {url}/v1/models: {error}")
    model = args.model or model
    vocab_size = args.vocab_size or server_vocab or DEFAULT_VOCAB_SIZE
    spec = TraceSpec(path=args.trace, format=args.format, num_requests=args.num_requests, seed=args.seed,
                     qps=args.qps, time_scale=args.time_scale)
    trace = spec.load_for(vocab_size=vocab_size, tokens_per_block=args.tokens_per_block)
    target = ReplayTarget(url, model, vocab_size, api_key, args.timeout)

    before = scrape_counters(url)
    progress = Progress("serve", len(trace))
    records, first, last = asyncio.run(replay(trace, target, args.max_output_tokens, progress, args.concurrency))
    after = scrape_counters(url)
    result = summarize(records, last - first, counter_diff(before, after))
    progress.close(result["completed"] + result["errored"], f"{result['errored']} errored")
    notes = list(trace.notes)
    if before is None:
        notes.append("the server has no /prometheus/metrics: server counters are null")
    document = {
        "config": {
            "url": url, "model": model, "trace": args.trace or "default-scenario", "format": trace.format,
            "requests": len(trace), "num_requests": args.num_requests, "time_scale": args.time_scale, "qps": args.qps,
            "concurrency": args.concurrency,
            "seed": args.seed, "max_output_tokens": args.max_output_tokens, "vocab_size": vocab_size,
            "tokens_per_block": args.tokens_per_block, "timeout_s": args.timeout, "notes": notes,
        },
        "result": result,
    }
    print(format_table(document))
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
