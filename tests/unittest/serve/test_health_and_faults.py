"""Health stays truthful and every request ends when the executor misbehaves.

- A dead executor loop (upstream's failure mode, by the kill hook): /health turns 503 while
  /v1/models stays 200, in-flight requests end with an error instead of hanging, new ones get 503.
- Fault injection (forward errors, NaN logits, slow forwards): every request ends with output
  or an error, NaN logits fail only their request, /health is 503 while a forward stalls
  past health_check_timeout_s and 200 otherwise, with the failed batches in its body; a
  request that arrives during such a stall is refused (503, Retry-After) rather than queued.
- After shutdown /health is 503.
"""

from __future__ import annotations

import asyncio
import collections

import httpx
import openai
import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm._torch.pyexecutor.engine.fault_injection import FAULT_KINDS
from tensorrt_llm.llmapi import LLM, KvCacheConfig

NO_HANG_S = 120  # every request of a test must end well within this


def prompt_of(length: int, seed: int) -> list[int]:
    return [1 + (seed * 97 + i * 41) % 500 for i in range(length)]


def failure_kind(error: openai.APIError) -> str:
    return "nan" if "NaN" in error.message else "forward" if "fault injection" in error.message else error.message


def test_dead_executor_loop_is_unhealthy_and_fails_in_flight_requests(one_torch_thread):
    # Slow forwards keep the requests in flight when the loop dies.
    llm = LLM("tiny-random", max_seq_len=512, fault_injection=FaultInjectionConfig(slow_forward_every=1, slow_forward_s=0.02))
    server = RunningServer(llm, api_key=None)
    try:
        async def scenario() -> None:
            async with server.async_client() as client:
                streams = [await client.completions.create(model=server.model, prompt=prompt_of(20, i), max_tokens=400,
                                                           stream=True) for i in range(3)]
                for stream in streams:
                    await stream.__anext__()  # generating
                plain = asyncio.create_task(client.completions.create(model=server.model, prompt=prompt_of(9, 7),
                                                                      max_tokens=400))
                await asyncio.sleep(0.1)
                server.executor.kill_loop_for_testing()
                for stream in streams:
                    with pytest.raises(openai.APIError, match="executor loop died"):
                        async for _ in stream:
                            pass
                with pytest.raises(openai.APIStatusError, match="executor loop died") as failed:
                    await plain
                assert failed.value.status_code == 503
                with pytest.raises(openai.APIStatusError, match="cannot take requests") as refused:
                    await client.completions.create(model=server.model, prompt=[1, 2, 3], max_tokens=2)
                assert refused.value.status_code == 503

        asyncio.run(asyncio.wait_for(scenario(), NO_HANG_S))
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and "executor loop died" in health.json()["reason"]
        assert httpx.get(f"{server.url}/v1/models").status_code == 200  # what upstream's health check looked at
        assert "trtllm_executor_healthy 0.0" in httpx.get(f"{server.url}/prometheus/metrics").text
    finally:
        server.stop()


def test_fault_injection_every_request_ends_and_health_tells_the_truth(one_torch_thread):
    faults = FaultInjectionConfig(forward_error_every=23, nan_logits_every=6, slow_forward_every=10, slow_forward_s=0.5,
                                  seed=3)
    llm = LLM("tiny-random", max_seq_len=256, max_batch_size=4, max_num_tokens=64, enable_chunked_prefill=True,
              health_check_timeout_s=0.2, fault_injection=faults,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128))
    server = RunningServer(llm, api_key=None)
    num_requests = 32
    outcomes: collections.Counter[str] = collections.Counter()
    unhealthy_reasons: set[str] = set()
    try:
        async def one(client: openai.AsyncOpenAI, i: int) -> None:
            kwargs = dict(model=server.model, prompt=prompt_of(10 + 3 * i, i), max_tokens=6, temperature=0)
            try:
                if i % 2:
                    finish = [c.choices[0].finish_reason async for c in await client.completions.create(**kwargs, stream=True)][-1]
                else:
                    finish = (await client.completions.create(**kwargs)).choices[0].finish_reason
                outcomes[f"completed:{finish}"] += 1
            except openai.APIStatusError as error:
                if error.status_code == 503:  # arrived during a stall: refused at admission
                    assert error.response.headers["retry-after"] and "has not finished an iteration" in error.message
                    outcomes["rejected:unhealthy"] += 1
                else:
                    outcomes[f"failed:{failure_kind(error)}"] += 1
            except openai.APIError as error:  # a streamed request's error event
                outcomes[f"failed:{failure_kind(error)}"] += 1

        async def watch_health(done: asyncio.Event) -> None:
            async with httpx.AsyncClient(base_url=server.url) as http:
                while not done.is_set():
                    response = await http.get("/health")
                    if response.status_code != 200:
                        unhealthy_reasons.add(response.json()["reason"])
                    await asyncio.sleep(0.02)

        async def scenario() -> None:
            done = asyncio.Event()
            watcher = asyncio.create_task(watch_health(done))
            async with server.async_client() as client:
                await asyncio.gather(*(one(client, i) for i in range(num_requests)))
            done.set()
            await watcher

        asyncio.run(asyncio.wait_for(scenario(), NO_HANG_S))
        injected = dict(server.executor.faults_injected())
        print(f"\nfault injection: injected {injected}; outcomes {dict(outcomes)}; hangs 0")

        assert sum(outcomes.values()) == num_requests  # no hang: each one ended, with output or an error
        assert outcomes["completed:length"] > 0 and outcomes["failed:nan"] > 0
        # a failed forward's requests start over once (max_forward_retries=1); forwards fail 23
        # apart and a request here lives fewer forwards than that, so none fails twice
        assert set(outcomes) <= {"completed:length", "failed:nan", "rejected:unhealthy"}, outcomes
        assert sum(s.num_retried_requests for s in server.executor.iteration_stats) > 0
        assert outcomes["failed:nan"] == injected["nan_logits"]  # a NaN fails its request alone
        assert all(injected[kind] > 0 for kind in FAULT_KINDS)
        assert unhealthy_reasons and all("has not finished an iteration" in r for r in unhealthy_reasons)

        server.wait_idle()
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200  # failed batches do not make it unhealthy: the loop serves on ...
        assert health.json()["failed_batches"] == injected["forward_error"]  # ... but they show
        metrics = httpx.get(f"{server.url}/prometheus/metrics").text
        assert f'trtllm_faults_injected_total{{kind="nan_logits"}} {float(injected["nan_logits"])}' in metrics
        retried = sum(s.num_retried_requests for s in server.executor.iteration_stats)
        assert f"trtllm_requests_retried_total {float(retried)}" in metrics
        admitted = num_requests - outcomes["rejected:unhealthy"]
        assert f'trtllm_request_success_total{{finished_reason="error"}} {float(admitted - outcomes["completed:length"])}' in metrics
        assert f'trtllm_requests_rejected_total{{reason="unhealthy"}} {float(outcomes["rejected:unhealthy"])}' in metrics
        assert server.executor.load().kv.num_held == 0  # drained: every block free or cached

        server.llm.shutdown()
        after = httpx.get(f"{server.url}/health")
        assert after.status_code == 503 and after.json()["reason"] == "the executor is shut down"
    finally:
        server.stop()
