"""A stream that falls behind catches up in one write: ``Generation.delta_batches`` groups the
responses that arrived while the loop was busy, and the server writes each group's events at
once. Nothing a client reads changes: the same events, in the same order, with the same content."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from tests.helpers.factories import make_sim_executor

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm.llmapi import RequestOutputHandle
from tensorrt_llm.serve.generation import Generation
from tensorrt_llm.serve.metrics import ServerMetrics

PROMPT = [3, 17, 29, 41, 53, 7, 11, 13]


class _Executor:
    """What a handle asks of the executor: the test plays the executor thread by hand."""

    def cancel_request(self, request_id: int) -> None:
        pass


def _generation(request_id: int, *, stop: tuple[str, ...] = ()) -> tuple[Generation, LlmRequest]:
    request = LlmRequest(input_token_ids=list(PROMPT), max_new_tokens=4, request_id=request_id)
    handle = RequestOutputHandle(_Executor(), None, [request])
    handle.first_submission()
    metrics = ServerMetrics(make_sim_executor()).request()  # an executor never started: the metrics read its config
    return Generation(handle, has_text=False, stop_strings=stop, metrics=metrics), request


def _respond(generation: Generation, request: LlmRequest, tokens: list[list[int]]) -> None:
    """The executor's responses, one per step; the last finishes the request."""
    for step, new in enumerate(tokens):
        generation.handle._on_response(0, request, Response(request.request_id, new, step == len(tokens) - 1))


def test_responses_that_arrived_together_are_one_batch_with_the_deltas_one_at_a_time():
    steps = [[5], [6], [7], [8]]

    async def run() -> tuple[list[list[tuple]], list[tuple]]:
        batched, request = _generation(1)
        _respond(batched, request, steps)
        await asyncio.sleep(0)  # the loop runs the posted callbacks: all four are queued
        batches = [[(d.token_ids, d.finish_reason, d.index) async for d in _aiter(batch)]
                   async for batch in batched.delta_batches()]
        single, request = _generation(2)
        _respond(single, request, steps)
        await asyncio.sleep(0)
        deltas = [(d.token_ids, d.finish_reason, d.index) async for d in single.deltas()]
        return batches, deltas

    batches, deltas = asyncio.run(run())
    assert batches == [deltas]
    assert deltas == [([5], None, 0), ([6], None, 0), ([7], None, 0), ([8], "length", 0)]


def test_a_batch_is_lazy_and_ends_with_what_had_arrived():
    """Each response is folded in when its delta is asked for (the usage a chunk reports is the
    request's at that delta); one that arrives later starts the next batch."""

    async def run() -> list[list[tuple[list[int], int]]]:
        generation, request = _generation(3)
        for token in (5, 6, 7):
            generation.handle._on_response(0, request, Response(request.request_id, [token], False))
        await asyncio.sleep(0)
        seen = []
        batches = generation.delta_batches()
        batch = await batches.__anext__()
        seen.append([(d.token_ids, generation.completion_tokens) for d in batch])
        generation.handle._on_response(0, request, Response(request.request_id, [8], True))
        await asyncio.sleep(0)
        async for batch in batches:
            seen.append([(d.token_ids, generation.completion_tokens) for d in batch])
        return seen

    assert asyncio.run(run()) == [[([5], 1), ([6], 2), ([7], 3)], [([8], 4)]]


async def _aiter(items):
    for item in items:
        yield item


# ---- over HTTP -------------------------------------------------------------------------------


def _events(response: httpx.Response) -> tuple[list[dict | str], int]:
    """The SSE events without their per-request id and time, and how many HTTP body chunks
    carried them (one per server write, unless the network split one)."""
    chunks = [chunk for chunk in response.iter_raw() if chunk]
    events = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        data = block[len("data: "):]
        if data == "[DONE]":
            events.append(data)
            continue
        event = json.loads(data)
        event.pop("id"), event.pop("created")
        events.append(event)
    return events, len(chunks)


def test_a_stream_whose_loop_stalled_sends_the_same_events_in_fewer_writes(tiny_server):
    """The server's event loop stalls while the executor generates: the responses pile up and go
    out together, as the same events (token ids, logprobs, continuous usage) a stream that kept
    up gets."""
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    loop = tiny_server._uvicorn.servers[0].get_loop()
    with tiny_server.http() as http:
        http.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).raise_for_status()
        tiny_server.wait_idle()  # both streams below find the prompt in the prefix cache alike
        with http.stream("POST", "/v1/completions", json=body) as response:
            kept_up, _ = _events(response)
        tiny_server.wait_idle()
        with http.stream("POST", "/v1/completions", json=body) as response:
            loop.call_soon_threadsafe(time.sleep, 1.0)  # the executor runs on meanwhile
            stalled, writes = _events(response)
    assert stalled == kept_up
    token_events = [e for e in kept_up if isinstance(e, dict) and e["choices"]]
    assert len(token_events) == 12 and kept_up[-1] == "[DONE]"
    assert [e["usage"]["completion_tokens"] for e in token_events] == list(range(1, 13))
    assert writes < len(token_events)
