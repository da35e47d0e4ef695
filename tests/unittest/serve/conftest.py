"""Fixtures: one real server per configuration and module (see ``server_harness``)."""

from __future__ import annotations

import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig


@pytest.fixture(scope="module")
def tiny_server(one_torch_thread):
    """tiny-random, float64 (greedy outputs do not depend on the batch), chunked prefill, block reuse."""
    llm = LLM("tiny-random", dtype="float64", max_seq_len=256, max_num_tokens=128, max_batch_size=16,
              enable_chunked_prefill=True, iter_stats_max_iterations=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=256))
    server = RunningServer(llm)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server():
    """SmolLM2-135M-Instruct (float32) with its tokenizer and chat template. Block reuse is off and
    the tests send one request at a time, so equal requests run the same arithmetic (a reused
    prefix would change the shapes, and float32 rounding with them)."""
    llm = LLM("smollm2-135m-instruct", max_seq_len=1024, max_num_tokens=512,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128, enable_block_reuse=False))
    server = RunningServer(llm)
    yield server
    server.stop()
