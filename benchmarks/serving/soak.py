"""A `trtllm-serve` process under load, end to end: the default scenario replayed over HTTP at
several multiples of its rate, with ``/health`` and ``/prometheus/metrics`` polled throughout.

    python -m benchmarks.serving.soak --out DIR [--rates 1,2,4,8] [--duration-s 180] \\
        [--health-interval-s 0.25] [--memory-interval-s 5] [--max-output-tokens N] -- SERVE_ARGS...

Everything after ``--`` goes to ``trtllm-serve`` (the model, ``--device``, ``--max_queue_size``,
``--extra_llm_api_options FILE.yaml``, ...); ``--port 0`` is added. Per rate ``x``, the scenario
is generated with enough requests to arrive over ``duration_s`` at ``x`` times its 7 requests/s
and replayed with ``benchmarks.serving.replay``'s client (streamed, token-id prompts, greedy,
the trace's output lengths); the run then waits for every request to end. What is checked
is what a user of the server sees: each request ends with its output or an HTTP error that
says why, and none is lost to the transport or hangs.

The poller is a separate process, so that the client's own work never delays a poll: its
latencies are the server's. GPU memory (``nvidia-smi``, when there is one) and the server's
resident memory are read at the start and the end of every rate, and the server's memory
gauges (resident memory; torch's allocated and reserved GPU bytes) every
``--memory-interval-s`` through the run: flat memory shows as a small change over the second
half of the run, after the warm-up. ``DIR/soak.json`` holds every
number; one line per rate is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.replay.cli import TraceSpec
from benchmarks.replay.loop import Progress, percentiles
from benchmarks.replay.scenario import ScenarioConfig
from benchmarks.serving.replay import ReplayTarget, counter_diff, discover, replay, scrape_counters, summarize

_SERVING = re.compile(r"serving .* at (http://\S+)")
POLLED = ("/health", "/prometheus/metrics")


class ServerProcess:
    """``trtllm-serve ARGS --port 0`` in a child process; its log goes to ``log_path``."""

    def __init__(self, args: Sequence[str], log_path: Path, start_timeout_s: float = 900.0) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        command = [sys.executable, "-m", "tensorrt_llm.commands.serve", *args, "--port", "0"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url: str | None = None
        started = threading.Event()

        def pump() -> None:  # copy the log; the "serving ... at URL" line gives the port
            for line in self.process.stdout:
                self._log.write(line)
                self._log.flush()
                match = _SERVING.search(line)
                if match and self.url is None:
                    self.url = match.group(1)
                    started.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while not started.wait(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"trtllm-serve did not start; see {log_path}")
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"trtllm-serve never answered /health 200; see {log_path}")

    def rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


#: Prometheus counters whose change over a run is reported (every label set of each)
REPORTED_COUNTERS = ("trtllm_faults_injected_total", "trtllm_request_success_total", "trtllm_requests_rejected_total",
                     "trtllm_failed_batches_total", "trtllm_requests_retried_total")


def scrape_labelled(url: str) -> dict[str, float]:
    """``name{labels}`` -> value for REPORTED_COUNTERS' samples (missing ones are absent)."""
    try:
        text = httpx.get(f"{url}/prometheus/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in REPORTED_COUNTERS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def gpu_memory_mib() -> list[int] | None:
    """Memory used on each GPU (``nvidia-smi``); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    return [int(v) for v in out.stdout.split()] if out.returncode == 0 else None


# ------------------------------------------------------------------------------- the poller


def poll_forever(url: str, interval_s: float, out: Path, memory_every_s: float = 5.0) -> None:
    """The poller process: every ``interval_s``, GET each of POLLED; one JSON line per answer
    (the time, the path, the status or the error, the latency), until it is terminated. Every
    ``memory_every_s`` it also writes the server's memory gauges read from the metrics it got
    (a line with ``memory`` instead of ``path``)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    last_memory = -math.inf
    with httpx.Client(base_url=url, timeout=30) as client, open(out, "w") as sink:
        while True:
            began = time.perf_counter()
            for path in POLLED:
                sent = time.perf_counter()
                try:
                    answer = client.get(path)
                    status: int | str = answer.status_code
                except httpx.HTTPError as error:
                    answer, status = None, type(error).__name__
                sink.write(json.dumps({"t": sent, "path": path, "status": status,
                                       "ms": (time.perf_counter() - sent) * 1e3}) + "\n")
                if path == "/prometheus/metrics" and status == 200 and sent - last_memory >= memory_every_s:
                    sink.write(json.dumps({"t": sent, "memory": memory_gauges(answer.text)}) + "\n")
                    last_memory = sent
                sink.flush()
            time.sleep(max(0.0, interval_s - (time.perf_counter() - began)))


#: the server's memory gauges (metrics.py), summed over GPUs
MEMORY_GAUGES = {"process_resident_memory_bytes": "rss_mib", "trtllm_gpu_memory_allocated_bytes": "gpu_allocated_mib",
                 "trtllm_gpu_memory_reserved_bytes": "gpu_reserved_mib"}


def memory_gauges(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in MEMORY_GAUGES:
            values[MEMORY_GAUGES[family.name]] = sum(sample.value for sample in family.samples) / 2**20
    return values


def summarize_memory(path: Path) -> dict[str, dict[str, float]]:
    """Per memory gauge over the run: the first and last sample, the maximum, and the change over
    the run's second half (after warm-up a flat series changes little there; a leak keeps growing)."""
    samples = [poll["memory"] for poll in read_polls(path) if "memory" in poll]
    summary = {}
    for name in MEMORY_GAUGES.values():
        series = [sample[name] for sample in samples if name in sample]
        if series:
            summary[name] = {"samples": len(series), "first": series[0], "max": max(series), "last": series[-1],
                             "second_half_change": series[-1] - series[len(series) // 2]}
    return summary


def read_polls(path: Path) -> list[dict]:
    """The poller's lines: answers (with ``path``) and memory samples (with ``memory``)."""
    polls = []
    for line in path.read_text().splitlines():
        try:
            polls.append(json.loads(line))
        except json.JSONDecodeError:  # the last line, cut when the poller was stopped
            continue
    return polls


def summarize_polls(path: Path) -> dict:
    """Per endpoint: the answers by status, and the latency's p50, p99 and maximum (ms)."""
    by_path: dict[str, dict] = {}
    for poll in read_polls(path):
        if "path" not in poll:  # a memory sample
            continue
        entry = by_path.setdefault(poll["path"], {"statuses": {}, "ms": []})
        entry["statuses"][str(poll["status"])] = entry["statuses"].get(str(poll["status"]), 0) + 1
        entry["ms"].append(poll["ms"])
    return {p: {"polls": len(e["ms"]), "statuses": e["statuses"], **percentiles(e["ms"]),
                "max": max(e["ms"], default=0.0)} for p, e in by_path.items()}


class Poller:
    def __init__(self, url: str, interval_s: float, memory_interval_s: float, out: Path) -> None:
        self.out = out
        out.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.serving.soak", "--poll", url,
                                         "--health-interval-s", str(interval_s),
                                         "--memory-interval-s", str(memory_interval_s), "--out", str(out)])
        deadline = time.monotonic() + 60  # polls cover the run only once the poller has started
        while not out.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the poller did not start (exit code {self.process.poll()})")
            time.sleep(0.05)

    def stop(self) -> tuple[dict, dict]:
        """The polls' summary and the memory samples' summary."""
        self.process.terminate()
        self.process.wait(timeout=30)
        return summarize_polls(self.out), summarize_memory(self.out)


# ------------------------------------------------------------------------------- one rate


async def with_loop_lag(coro, lags: list[float], period_s: float = 0.05):
    """Await ``coro`` while measuring how late this event loop wakes up (appended to ``lags``).
    A client whose own loop stalls sends late and reads late: its latencies are then its own,
    and a connection it opened may wait long enough for a server to close it as idle."""
    done = False

    async def monitor() -> None:
        while not done:
            began = time.perf_counter()
            await asyncio.sleep(period_s)
            lags.append((time.perf_counter() - began - period_s) * 1e3)

    task = asyncio.create_task(monitor())
    try:
        return await coro
    finally:
        done = True
        await task


def run_rate(server: ServerProcess, rate: float, duration_s: float, max_output_tokens: int | None,
             interval_s: float, memory_interval_s: float, out_dir: Path, timeout_s: float) -> dict:
    url = server.url
    model, vocab = discover(url, None)
    base_qps = ScenarioConfig().qps
    num_requests = math.ceil(duration_s * base_qps * rate)
    trace = TraceSpec(num_requests=num_requests, time_scale=1.0 / rate).load_for(vocab_size=vocab, tokens_per_block=32)
    target = ReplayTarget(url, model, vocab, None, timeout_s)
    start_memory = {"gpu_mib": gpu_memory_mib(), "server_rss_mib": server.rss_mib()}
    poller = Poller(url, interval_s, memory_interval_s, out_dir / f"polls_{rate:g}x.jsonl")
    before, labelled_before = scrape_counters(url), scrape_labelled(url)
    progress = Progress(f"{rate:g}x", len(trace))
    lags: list[float] = []
    try:
        records, first, last = asyncio.run(with_loop_lag(replay(trace, target, max_output_tokens, progress), lags))
    finally:
        polls, memory_over_time = poller.stop()
    after, labelled_after = scrape_counters(url), scrape_labelled(url)
    result = summarize(records, last - first, counter_diff(before, after))
    result["counters"] = {k: v - labelled_before.get(k, 0.0) for k, v in labelled_after.items()
                          if v != labelled_before.get(k, 0.0)}
    progress.close(result["completed"] + result["errored"], f"{result['errored']} errored")
    return {
        "rate": rate, "requests": len(trace), "arrival_span_s": trace.requests[-1].arrival_s if trace.requests else 0.0,
        "result": result, "polls": polls,
        "client_loop_lag_ms": {**percentiles(lags), "max": max(lags, default=0.0)},
        "memory": {"start": start_memory, "end": {"gpu_mib": gpu_memory_mib(), "server_rss_mib": server.rss_mib()},
                   "over_time": memory_over_time},
    }


def line_of(run: dict) -> str:
    r, kinds = run["result"], run["result"]["error_kinds"]
    health = run["polls"].get("/health", {})
    metrics = run["polls"].get("/prometheus/metrics", {})
    return (f"{run['rate']:g}x: {r['completed']}/{r['requests']} completed, statuses {r['statuses'] or '{}'},"
            f" transport errors {kinds.get('transport', 0)}, timeouts {kinds.get('timeout', 0)},"
            f" stream errors {kinds.get('stream', 0)}; TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms,"
            f" ITL p50/p99 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f} ms, {r['output_tokens_per_s']:.0f} tok/s;"
            f" /health p99/max {health.get('p99', 0):.1f}/{health.get('max', 0):.1f} ms {health.get('statuses')},"
            f" /prometheus/metrics p99/max {metrics.get('p99', 0):.1f}/{metrics.get('max', 0):.1f} ms;"
            f" client loop lag p99/max {run['client_loop_lag_ms']['p99']:.0f}/{run['client_loop_lag_ms']['max']:.0f} ms;"
            f" server {r['server']}" + "".join(
                f"; {name} {m['first']:.0f} -> {m['last']:.0f} MiB (max {m['max']:.0f}, second half {m['second_half_change']:+.0f})"
                for name, m in run["memory"].get("over_time", {}).items()))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for soak.json, the polls and the server log")
    parser.add_argument("--rates", default="1,2,4,8", help="multiples of the scenario's 7 requests/s")
    parser.add_argument("--duration-s", type=float, default=180.0, help="arrivals span this long at every rate")
    parser.add_argument("--health-interval-s", type=float, default=0.25)
    parser.add_argument("--memory-interval-s", type=float, default=5.0, help="server memory gauges sampled this often")
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a request not answered by then is a hang")
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the poller process
    args = parser.parse_args(own)
    out = Path(args.out)
    if args.poll:
        poll_forever(args.poll, args.health_interval_s, out, args.memory_interval_s)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    server = ServerProcess(serve_args, out / "server.log")
    document = {"config": {**vars(args), "serve_args": serve_args, "rates": rates}, "runs": []}
    try:
        for rate in rates:
            run = run_rate(server, rate, args.duration_s, args.max_output_tokens, args.health_interval_s,
                           args.memory_interval_s, out, args.timeout_s)
            document["runs"].append(run)
            print(line_of(run), flush=True)
            (out / "soak.json").write_text(json.dumps(document, indent=2) + "\n")
    finally:
        document["server_exit_code"] = server.stop()
        (out / "soak.json").write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
