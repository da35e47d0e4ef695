"""The peer benchmark's requests through ``LLM`` in-process: no HTTP, no client.

Each level keeps ``concurrency`` requests in flight for ``seconds`` (a request that ends is
replaced at once), as GuideLLM's ``concurrent`` profile does; at the end the requests still
running are aborted and their tokens so far count. Prompts are ``isl`` random ids of the
tokenizer's ordinary tokens (the control tokens left out), outputs ``osl`` tokens with
``ignore_eos``; "sampled" is temperature 1.0 (what the server runs a request without
``temperature`` at), "greedy" temperature 0. Every token's arrival is stamped on the event loop
(``RequestOutputHandle`` consumed with ``async for``), and the level is summed up as
``peer_summary.level_summary`` sums up GuideLLM's.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Callable

from benchmarks.gpu.peer_summary import level_summary, request_figures

#: the first ids of SmolLM2's vocabulary are control tokens: prompts draw from the ids after them
FIRST_ORDINARY_ID = 17


def sampling_params(sampling: str, max_tokens: int):
    from tensorrt_llm.llmapi.llm import SamplingParams

    temperature = {"sampled": 1.0, "greedy": 0.0}[sampling]
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


def prompt_source(isl: int, tokenizer_ids: int, seed: int = 0) -> Callable[[], list[int]]:
    rng = random.Random(seed)
    return lambda: [rng.randrange(FIRST_ORDINARY_ID, tokenizer_ids) for _ in range(isl)]


async def _request(llm, prompt: list[int], params, records: list[dict]) -> dict:
    record = {"start": time.perf_counter(), "times": [], "status": "incomplete", "error": None}
    records.append(record)
    handle = None
    try:
        handle = llm.generate_async(prompt, params)  # a refusal (ValueError) is this request's error
        async for output in handle:
            now = time.perf_counter()
            arrived = len(output.outputs[0].token_ids) - len(record["times"])
            record["times"].extend([now] * arrived)
            if output.error:
                record["status"], record["error"] = "errored", output.error
                return record
        record["status"] = "completed"
    except asyncio.CancelledError:
        if handle is not None:
            handle.abort()  # the level ended: the executor frees it
        raise
    except Exception as error:  # noqa: BLE001 - a failed request is counted, the level goes on
        record["status"], record["error"] = "errored", f"{type(error).__name__}: {error}"
    return record


async def run_level(llm, next_prompt: Callable[[], list[int]], params, concurrency: int, seconds: float) -> dict:
    """One level (module docstring); the executor is drained before it returns."""
    records: list[dict] = []
    began = time.perf_counter()
    deadline = began + seconds

    async def stream() -> None:
        while time.perf_counter() < deadline:
            if (await _request(llm, next_prompt(), params, records))["status"] == "errored":
                return  # a refused request would be refused again at once: the stream stops, counted

    tasks = [asyncio.create_task(stream()) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - began
    await drain(llm)
    requests = [{"status": r["status"], **request_figures(r["start"], [t for t in r["times"] if t <= deadline])}
                for r in records]
    level = level_summary(concurrency, duration, requests)
    errors = [r["error"] for r in records if r["error"]]
    if errors:
        level["first_error"] = errors[0]
    return level


async def drain(llm, timeout_s: float = 60.0) -> None:
    """Until the executor holds no request (the aborted ones freed)."""
    deadline = time.monotonic() + timeout_s
    while llm.executor.has_work and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def warm_up(llm, tokenizer_ids: int, concurrency: int, prompt_lens: tuple[int, ...] = (32,)) -> dict:
    """Per prompt length and sampling, a ramp: ``concurrency`` prompts at once, request i asking
    for 8 + i tokens, so the decode batch shrinks one by one through every size (the decode graphs
    are captured on first use). The measured shapes' own prompt lengths belong in ``prompt_lens``:
    their first prefill chunks and long-context decode attention are then warm as well, and the
    run measured first pays no more than the others. Returns, per sampling, the share of
    generated ids the tokenizer lacks (padded ids: they decode to '')."""
    generated: dict[str, list[int]] = {"greedy": [], "sampled": []}
    for length in prompt_lens:
        next_prompt = prompt_source(length, tokenizer_ids, seed=1)
        for sampling, ids in generated.items():
            handles = [llm.generate_async(next_prompt(), sampling_params(sampling, 8 + i)) for i in range(concurrency)]
            outputs = [await handle.aresult() for handle in handles]
            ids += [t for output in outputs for t in output.outputs[0].token_ids]
    return shares_of(generated, tokenizer_ids)


def shares_of(generated: dict[str, list[int]], tokenizer_ids: int) -> dict:
    """Per sampling, the ids generated -> the record's ``{tokens, padded_share}``: how many, and
    the share of them the tokenizer lacks (padded ids: they decode to '')."""
    return {sampling: {"tokens": len(ids), "padded_share": sum(t >= tokenizer_ids for t in ids) / max(1, len(ids))}
            for sampling, ids in generated.items()}
