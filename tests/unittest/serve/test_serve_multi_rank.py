"""Serving on several ranks (``trtllm-serve --tp_size N``): a real server on 127.0.0.1 over
``MultiRankExecutor``, driven with the ``openai`` client.

The TP server's greedy float64 completions (plain and streamed) equal the single-rank
server's; /health, /metrics and /prometheus/metrics answer as with one rank; a rank process
that dies makes /health answer 503 naming it, and the requests in flight end with an error
(nothing hangs). The command line takes ``--tp_size`` and the YAML ``tensor_parallel_size``.
(A model whose heads do not split over the ranks is refused before any rank starts:
``tests/unittest/_torch/distributed/test_llm_multi_rank.py``; the command turns that
``ValueError`` into its start-up error, exit code 2.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.commands.serve import build_parser, llm_kwargs
from tensorrt_llm.llmapi import LLM, KvCacheConfig

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

NO_HANG_S = 90.0
OPTIONS = dict(dtype="float64", max_seq_len=256, max_num_tokens=64, max_batch_size=8, enable_chunked_prefill=True,
               iter_stats_max_iterations=16, kv_cache_config=KvCacheConfig(tokens_per_block=8, num_blocks=128))
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + 9 * i)] for i in range(4)]


def _completions(server: RunningServer) -> tuple[list[list[int]], list[int]]:
    """Greedy completions of every prompt, and the first one streamed."""
    client = server.client()
    plain = [client.completions.create(model=server.model, prompt=p, max_tokens=6, temperature=0).choices[0].token_ids
             for p in PROMPTS]
    streamed = []
    for chunk in client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                           stream=True):
        streamed += chunk.choices[0].token_ids or []
    return plain, streamed


def test_tp_server_answers_as_one_rank_does_and_names_a_dead_rank():
    single = RunningServer(LLM("tiny-random", **OPTIONS), api_key=None)
    try:
        expected, expected_stream = _completions(single)
    finally:
        single.stop()

    server = RunningServer(LLM("tiny-random", tensor_parallel_size=2, **OPTIONS), api_key=None)
    try:
        plain, streamed = _completions(server)
        assert plain == expected and streamed == expected_stream == expected[0]
        assert all(len(tokens) == 6 for tokens in plain)

        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["ranks"] == 2 and health.json()["iterations"] > 0
        stats = httpx.get(f"{server.url}/metrics").json()
        assert health.json()["iterations"] > len(stats) == OPTIONS["iter_stats_max_iterations"]  # the newest, rank 0's
        assert all(s["forward_tokens"] <= OPTIONS["max_num_tokens"] and s["rank"] == 0 for s in stats)
        text = httpx.get(f"{server.url}/prometheus/metrics").text
        assert "trtllm_executor_healthy 1.0" in text and "trtllm_kv_cache_usage_ratio" in text
        assert 'trtllm_request_success_total{finished_reason="length"} 5.0' in text

        async def in_flight_then_kill() -> None:
            async with server.async_client() as client:
                stream = await client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=200,
                                                         temperature=0, stream=True)
                await stream.__anext__()  # generating on both ranks
                plain = asyncio.create_task(client.completions.create(model=server.model, prompt=PROMPTS[2],
                                                                      max_tokens=200, temperature=0))
                await asyncio.sleep(0.05)
                os.kill(server.executor.rank_pids[1], signal.SIGKILL)
                with pytest.raises(openai.APIError):
                    async for _ in stream:
                        pass
                with pytest.raises(openai.APIStatusError) as failed:
                    await plain
                assert failed.value.status_code >= 500

        asyncio.run(asyncio.wait_for(in_flight_then_kill(), NO_HANG_S))
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.url}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "rank 1" in health.json()["reason"], health.json()
        assert "trtllm_executor_healthy 0.0" in httpx.get(f"{server.url}/prometheus/metrics").text
        with pytest.raises(openai.APIStatusError) as later:
            server.client().completions.create(model=server.model, prompt=[1, 2, 3], max_tokens=2)
        assert later.value.status_code == 503
    finally:
        server.stop()


def test_command_line_and_yaml_name_the_ranks(tmp_path):
    assert llm_kwargs(build_parser().parse_args(["tiny-random", "--tp_size", "2"]))["tensor_parallel_size"] == 2
    options = tmp_path / "options.yaml"
    options.write_text("tensor_parallel_size: 3\nenable_attention_dp: true\n")
    kwargs = llm_kwargs(build_parser().parse_args(["tiny-random", "--tp_size", "2", "--extra_llm_api_options",
                                                   str(options)]))
    assert kwargs["tensor_parallel_size"] == 3 and kwargs["enable_attention_dp"] is True  # the file wins
