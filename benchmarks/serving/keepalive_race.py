"""Idle keep-alive connections closed by the server just as a client reuses them.

    python -m benchmarks.serving.keepalive_race [--idle-s 1.0] [--workers 48] [--rounds 12] [--json OUT.json]

The H200 soak lost 2-22 of 300 streams as ``Connection error`` at 2-4x load, none at 8x, and
none once uvicorn's ``timeout_keep_alive`` went from 5 s to 75 s. The suspected cause: httpx
(under the ``openai`` client) keeps an idle pooled connection for 5 s (``keepalive_expiry``)
and uvicorn closes an idle one after 5 s, so a connection idle for about 5 s is closed by the
server while the client, whose own clock started a little later, still takes it from its pool
and sends a request on it. A POST is not retried, and the server never saw the request, so
nothing is logged or counted on its side.

This reproduces that on the loopback, scaled down: a real ``trtllm-serve`` app (tiny-random),
a client whose pool keeps idle connections for ``idle_s``, and ``workers`` clients that each
send a short completion, wait about ``idle_s`` (uniformly within +-15%, so some reuse lands
just before and some just after the server's close), and repeat for ``rounds``. It runs once
with the server's keep-alive equal to the client's (uvicorn's default against httpx's: both
5 s, here both ``idle_s``) and once with the server's default (``ServerConfig``), and counts
the requests lost to transport errors in each. Loopback and a loaded client both shorten the
window in which a FIN is in flight, so counts are low; any nonzero count in the first run
against zero in the second confirms the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import httpx
import uvicorn

from tensorrt_llm.llmapi import LLM
from tensorrt_llm.serve.openai_server import OpenAIServer
from tensorrt_llm.serve.server_config import ServerConfig


@dataclass(frozen=True, slots=True)
class RaceResult:
    server_keep_alive_s: float
    client_keepalive_expiry_s: float
    requests: int
    completed: int
    transport_errors: int
    error_kinds: dict[str, int]


def _serve_here(keep_alive_s: float, collect_every_s: float, port_file: str) -> None:
    """The server process: tiny-random behind the real app; with ``collect_every_s`` a thread
    runs a full garbage collection that often, holding the GIL as a loaded server's own full
    collections do (a server process tracks ~0.7M objects: ~0.2 s a collection here)."""
    llm = LLM("tiny-random", max_seq_len=4096, max_num_tokens=256, device="cpu")
    server = OpenAIServer(llm)
    config = uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_keep_alive=keep_alive_s)
    running = uvicorn.Server(config)
    if collect_every_s:
        def collect() -> None:
            while not running.should_exit:
                time.sleep(collect_every_s)
                gc.collect()
        threading.Thread(target=collect, daemon=True).start()

    def announce() -> None:
        while not running.started:
            time.sleep(0.01)
        with open(port_file, "w") as out:
            out.write(str(running.servers[0].sockets[0].getsockname()[1]))

    threading.Thread(target=announce, daemon=True).start()
    running.run()


@contextlib.contextmanager
def _server(keep_alive_s: float, collect_every_s: float):
    """A server process; yields its URL."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.serving.keepalive_race", "--serve",
                                    f"--keep-alive-s={keep_alive_s}", f"--collect-every-s={collect_every_s}",
                                    f"--port-file={port_file}"])
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(port_file) or not open(port_file).read():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server process did not start")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{open(port_file).read()}"
        finally:
            process.terminate()
            process.wait(timeout=30)


async def _drive(url: str, model: str, idle_s: float, workers: int, rounds: int,
                 background: int) -> tuple[int, dict[str, int]]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=idle_s)
    errors: dict[str, int] = {}
    completed = 0
    rng = random.Random(0)
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    done = asyncio.Event()

    async def keep_busy(client: httpx.AsyncClient, index: int) -> None:
        """Streams that keep the executor thread (and so the GIL) and both event loops busy, as
        a loaded server is: the window in which a close and a reuse cross grows with that."""
        long = {"model": model, "prompt": [4 + index, 5, 6], "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        while not done.is_set():
            async with client.stream("POST", "/v1/completions", json=long) as response:
                async for _ in response.aiter_lines():
                    if done.is_set():
                        break

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client, \
            httpx.AsyncClient(base_url=url, timeout=60) as loader:
        busy = [asyncio.create_task(keep_busy(loader, i)) for i in range(background)]
        async def worker(index: int) -> None:
            nonlocal completed
            await asyncio.sleep(index * idle_s / workers)  # spread the workers over one idle period
            for _ in range(rounds):
                try:
                    response = await client.post("/v1/completions", json=body)
                    response.raise_for_status()
                    completed += 1
                except httpx.TransportError as error:
                    kind = type(error).__name__
                    errors[kind] = errors.get(kind, 0) + 1
                await asyncio.sleep(idle_s * rng.uniform(0.85, 1.15))

        await asyncio.gather(*(worker(i) for i in range(workers)))
        done.set()
        await asyncio.gather(*busy, return_exceptions=True)
    return completed, errors


def run(idle_s: float, workers: int, rounds: int, background: int, collect_every_s: float) -> list[RaceResult]:
    results = []
    for keep_alive_s in (idle_s, ServerConfig().timeout_keep_alive_s):
        with _server(keep_alive_s, collect_every_s) as url:
            completed, errors = asyncio.run(_drive(url, "tiny-random", idle_s, workers, rounds, background))
        result = RaceResult(keep_alive_s, idle_s, workers * rounds, completed, sum(errors.values()), errors)
        print(f"server keep-alive {keep_alive_s:g} s, client pool expiry {idle_s:g} s: "
              f"{result.completed}/{result.requests} completed, {result.transport_errors} lost {errors or ''}",
              flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=1.0, help="the client's idle expiry (and the racing server's)")
    parser.add_argument("--workers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--background-streams", type=int, default=8, help="long streams that keep the server busy")
    parser.add_argument("--collect-every-s", type=float, default=0.5,
                        help="a full GC in the server this often (0: none), as a loaded server's own")
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--keep-alive-s", type=float, default=5.0, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve_here(args.keep_alive_s, args.collect_every_s, args.port_file)
        return 0
    results = run(args.idle_s, args.workers, args.rounds, args.background_streams, args.collect_every_s)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": vars(args), "results": [asdict(r) for r in results]}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
