"""`trtllm-serve` on the GPU, end to end (skipped without CUDA; run on the H200 by
``benchmarks/gpu/h200_serving.sh``): the real command with ``--device auto`` picks
the GPU, and 20 of the default scenario's requests, replayed over HTTP, all complete."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from benchmarks.replay import TraceSpec
from benchmarks.replay.loop import Progress
from benchmarks.serving.replay import ReplayTarget, discover, replay
from benchmarks.serving.soak import ServerProcess

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_server_serves_on_the_gpu_and_replays_20_requests(tmp_path):
    server = ServerProcess(["small-random", "--max_num_tokens", "4096", "--enable_chunked_prefill",
                            "--kv_cache_config.free_gpu_memory_fraction", "0.2"], tmp_path / "server.log")
    try:
        log = server.log_path.read_text()
        assert "on cuda" in log and "(bfloat16)" in log, log[-2000:]
        model, vocab = discover(server.url, None)
        trace = TraceSpec(num_requests=40, time_scale=0.1).load_for(vocab_size=vocab, tokens_per_block=32)
        # the first 20 that fit small-random's 8192 positions with their 16 tokens
        trace = dataclasses.replace(trace, requests=[r for r in trace.requests if r.input_len + 16 <= 8192][:20])
        assert len(trace) == 20
        target = ReplayTarget(server.url, model, vocab, None, 300.0)
        records, _, _ = asyncio.run(replay(trace, target, 16, Progress("gpu", len(trace), enabled=False)))
        failed = [(r.status, r.error) for r in records if r.error is not None]
        assert not failed and all(r.output_tokens > 0 for r in records), failed
    finally:
        assert server.stop() == 0
