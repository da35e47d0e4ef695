"""The peer benchmark's GuideLLM runs, for real on the CPU: the command ``peer_serving`` builds,
GuideLLM 0.8.1 (its own venv, as ``test_benchmark_client``) against a real server that records
every completions body it receives. ``greedy`` must reach the server with ``temperature: 0`` in
every body and ``sampled`` with none (GuideLLM's defaults); the summary must read the report."""

from __future__ import annotations

import argparse
import json
import threading
import time

import pytest
import uvicorn

from benchmarks.gpu import peer_serving
from benchmarks.gpu.peer_summary import summarize_guidellm
from tests.helpers.guidellm_runs import run_guidellm
from tests.unittest.serve.test_benchmark_client import guidellm  # noqa: F401 - the fixture

from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.serve.http_server import uvicorn_config
from tensorrt_llm.serve.openai_server import OpenAIServer
from tensorrt_llm.serve.server_config import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def recording(app, bodies: list[dict]):
    """``app`` behind an ASGI layer that keeps each /v1/completions body and hands it on unchanged."""

    async def layer(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await app(scope, receive, send)
        messages = []
        while not messages or messages[-1].get("more_body"):
            messages.append(await receive())
        bodies.append(json.loads(b"".join(m.get("body", b"") for m in messages)))
        pending = iter(messages)

        async def replay():
            return next(pending, None) or await receive()

        return await app(scope, replay, send)

    return layer


@pytest.fixture(scope="module")
def recorded(smollm2_tokenizer_checkpoint):
    llm = LLM(str(smollm2_tokenizer_checkpoint), max_seq_len=512, kv_cache_config=KvCacheConfig(num_blocks=128))
    config = ServerConfig(host="127.0.0.1", port=0)
    bodies: list[dict] = []
    server = uvicorn.Server(uvicorn_config(recording(OpenAIServer(llm, config).app, bodies), config, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", llm.model_id, bodies
    server.should_exit = True
    thread.join(timeout=60)
    llm.shutdown()


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_the_body_carries_temperature_0_only_when_greedy(guidellm, recorded, smollm2_tokenizer_checkpoint,  # noqa: F811
                                                         sampling, tmp_path):
    url, model, bodies = recorded
    bodies.clear()
    args = argparse.Namespace(guidellm=str(guidellm), concurrency=[2], seconds=2)  # one level: GuideLLM is slow to start
    report = tmp_path / "report.json"
    command = peer_serving.guidellm_command(args, url, model, smollm2_tokenizer_checkpoint, (32, 8), sampling, report,
                                            peer_serving.RUN_SEED)
    done = run_guidellm(command)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    generated = [body for body in bodies if body.get("max_tokens") == 8]  # the runs' requests
    assert len(generated) >= 2 and all(body["ignore_eos"] for body in generated)
    if sampling == "greedy":
        assert all(body.get("temperature") == 0 for body in generated), generated[0]
    else:
        assert not any("temperature" in body for body in generated), generated[0]
    levels = summarize_guidellm(json.loads(report.read_text()))
    assert [level["concurrency"] for level in levels] == [2]
    for level in levels:
        assert level["errored"] == 0 and level["completed"] >= 1 and level["output_tokens_per_s"] > 0
        assert level["body_temperature"] == ("0" if sampling == "greedy" else "omitted")
        assert level["itl_ms"]["p50"] > 0 and level["ttft_ms"]["p50"] > 0
        assert level["cached_tokens_mean"] is not None
