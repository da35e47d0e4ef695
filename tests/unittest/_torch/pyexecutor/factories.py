"""Factories for tests: requests, configs, KV managers and executors built the way production builds them."""

from __future__ import annotations

import itertools
from typing import Sequence

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager, create_py_executor
from tensorrt_llm._torch.pyexecutor.simulated_engine import SimulatedModelEngine, SyntheticSampler
from tensorrt_llm._torch.pyexecutor.token_budget import make_token_budget_policy

VOCAB = 1000
KV_BYTES_PER_TOKEN = 64  # bookkeeping mode: only sizes the host tier

_ids = itertools.count(10_000)


def make_config(
    *,
    max_num_tokens: int = 64,
    max_batch_size: int = 16,
    max_seq_len: int = 4096,
    enable_chunked_prefill: bool = True,
    tokens_per_block: int = 4,
    num_blocks: int = 64,
    host_blocks: int = 0,
    enable_block_reuse: bool = True,
    enable_partial_reuse: bool = True,
    token_budget_policy: str = "recheck",
    **overrides,
) -> ExecutorConfig:
    kv = KvCacheConfig(
        tokens_per_block=tokens_per_block,
        num_blocks=num_blocks,
        enable_block_reuse=enable_block_reuse,
        enable_partial_reuse=enable_partial_reuse,
        host_cache_size=host_blocks * tokens_per_block * KV_BYTES_PER_TOKEN,
    )
    return ExecutorConfig(
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        enable_chunked_prefill=enable_chunked_prefill,
        token_budget_policy=token_budget_policy,
        kv_cache_config=kv,
        **overrides,
    )


def make_request(
    tokens: Sequence[int] | None = None,
    *,
    prompt_len: int | None = None,
    max_new_tokens: int = 4,
    seed: int | None = None,
    **kwargs,
) -> LlmRequest:
    """A request with the given prompt, or ``prompt_len`` tokens unique to it."""
    request_id = kwargs.pop("request_id", next(_ids))
    if tokens is None:
        assert prompt_len is not None, "give tokens or prompt_len"
        base = request_id if seed is None else seed
        tokens = [1 + (base * 7919 + i * 104729) % (VOCAB - 1) for i in range(prompt_len)]
    return LlmRequest(input_token_ids=list(tokens), max_new_tokens=max_new_tokens, request_id=request_id, **kwargs)


def make_kv_cache_manager(config: ExecutorConfig | None = None, **config_overrides) -> KVCacheManager:
    """A bookkeeping-mode KV manager wired to the config's token-budget policy."""
    config = config or make_config(**config_overrides)
    policy = make_token_budget_policy(
        config.token_budget_policy,
        config.max_num_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        tokens_per_block=config.kv_cache_config.tokens_per_block,
    )
    return create_kv_cache_manager(config, policy, kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def make_sim_executor(config: ExecutorConfig | None = None, **config_overrides) -> PyExecutor:
    """An executor whose engine is simulated (bookkeeping KV, synthetic tokens), everything else real."""
    config = config or make_config(**config_overrides)

    def engine(kv, policy):
        return SimulatedModelEngine(config.max_num_tokens, kv, policy, vocab_size=VOCAB)

    return create_py_executor(
        config, engine_factory=engine, sampler=SyntheticSampler(VOCAB), kv_bytes_per_token=KV_BYTES_PER_TOKEN
    )
