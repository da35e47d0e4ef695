"""Builds a :class:`PyExecutor` and its parts from one :class:`ExecutorConfig`."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, kv_cache_dtype
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.kv_cache.block import BlockTokens
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter, drafter_for
from tensorrt_llm._torch.pyexecutor.engine.fault_injection import FaultInjectingEngine
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import ModelEngine, TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler, TorchSampler
from tensorrt_llm._torch.pyexecutor.scheduler import make_scheduler
from tensorrt_llm._torch.pyexecutor.budget.policies import token_budget_policy_for

logger = logging.getLogger(__name__)

EngineFactory = Callable[[KVCacheManager], ModelEngine]


#: Memory a KV pool of real tensors gets when its size is not given (upstream sizes it from free
#: GPU memory; on the CPU a full batch of full-length sequences of a real model would be tens of GB).
DEFAULT_KV_CACHE_BYTES = 1 << 30


def default_num_blocks(config: ExecutorConfig, bytes_per_block: int = 0) -> int:
    """Without a pool size, room for a full batch of full-length sequences, capped at
    ``DEFAULT_KV_CACHE_BYTES`` of tensors when blocks have a size in bytes."""
    tokens_per_block = config.kv_cache_config.tokens_per_block
    full_batch = config.max_batch_size * -(-config.max_seq_len // tokens_per_block)
    return min(full_batch, max(1, DEFAULT_KV_CACHE_BYTES // bytes_per_block)) if bytes_per_block else full_batch


def blocks_in_memory(free_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` in ``fraction`` of ``free_bytes``: the pool's size is
    its bytes, so a block half the bytes (FP8 against bf16) gives twice the blocks, up to one
    for the rounding down."""
    return int(free_bytes * fraction) // bytes_per_block


def gpu_num_blocks(device: torch.device, fraction: float, bytes_per_block: int) -> int:
    """Blocks that ``fraction`` of the device memory free now holds (call it after the weights
    are loaded: upstream's ``free_gpu_memory_fraction``)."""
    free, _total = torch.cuda.mem_get_info(device)
    num_blocks = blocks_in_memory(free, fraction, bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"free_gpu_memory_fraction {fraction} of the {free / 2**30:.2f} GiB free on {device} holds no KV block "
            f"of {bytes_per_block} bytes"
        )
    logger.info("KV pool: %d blocks (%.2f GiB), %.0f%% of the %.2f GiB free on %s", num_blocks,
                num_blocks * bytes_per_block / 2**30, 100 * fraction, free / 2**30, device)
    return num_blocks


def create_kv_cache_manager(
    config: ExecutorConfig,
    *,
    model: LlamaForCausalLM | None = None,
    kv_bytes_per_token: int | None = None,
    block_hash: Callable[[BlockTokens], int] | None = None,
    kv_scales: KvScales | None = None,
) -> KVCacheManager:
    """With ``model``: real K/V tensors shaped for it, on its device, of ``kv_cache_config.dtype``
    (an FP8 pool with ``kv_scales``, per layer; 1.0 without). Without: bookkeeping only,
    and ``kv_bytes_per_token`` sizes the host tier from ``host_cache_size`` bytes.

    Pool size: ``num_blocks`` or ``max_tokens`` when given; otherwise, on a GPU,
    ``free_gpu_memory_fraction`` of the free device memory, and on the CPU room for a full batch
    of full-length sequences, capped at ``DEFAULT_KV_CACHE_BYTES``. On CUDA one scratch block beyond the pool takes the writes of
    CUDA-graph padding rows."""
    kv_config = config.kv_cache_config
    storage = None
    device = model.device if model is not None else torch.device("cpu")
    if model is not None:
        block_shape = model.kv_cache_shape(1, kv_config.tokens_per_block)[1:]
        dtype = kv_cache_dtype(kv_config.dtype, model.config.torch_dtype)
        bytes_per_block = KVCacheStorage.bytes_per_block(model.config.num_layers, block_shape, dtype)
        if device.type == "cuda" and not kv_config.is_sized:
            num_blocks = gpu_num_blocks(device, kv_config.free_gpu_memory_fraction, bytes_per_block) - 1
        else:
            num_blocks = kv_config.resolve_num_blocks(default_num_blocks(config, bytes_per_block))
    elif kv_config.host_cache_size and not kv_bytes_per_token:
        raise ValueError("host_cache_size needs the model's KV bytes per token to size the host tier")
    else:
        bytes_per_block = (kv_bytes_per_token or 0) * kv_config.tokens_per_block
        num_blocks = kv_config.resolve_num_blocks(default_num_blocks(config))
    num_host_blocks = kv_config.host_cache_size // bytes_per_block if kv_config.host_cache_size else 0
    if model is not None:
        storage = KVCacheStorage(
            num_layers=model.config.num_layers,
            num_blocks=num_blocks,
            num_host_blocks=num_host_blocks,
            block_shape=block_shape,
            dtype=dtype,
            device=device,
            num_scratch_blocks=1 if device.type == "cuda" else 0,
            kv_scales=kv_scales,
        )
    return KVCacheManager(
        kv_config,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        storage=storage,
        block_hash=block_hash,
    )


def create_py_executor(
    config: ExecutorConfig,
    *,
    model: LlamaForCausalLM | None = None,
    engine_factory: EngineFactory | None = None,
    sampler: Sampler | None = None,
    kv_bytes_per_token: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    block_hash: Callable[[BlockTokens], int] | None = None,
    fit_max_seq_len_to_pool: bool = False,
    drafter: Drafter | None = None,
    kv_scales: KvScales | None = None,
) -> PyExecutor:
    """A torch executor (``model``) or one whose engine ``engine_factory`` builds (simulation).

    ``fit_max_seq_len_to_pool``: ``config.max_seq_len`` is a ceiling (the model's positions),
    lowered to what the KV pool holds for one sequence once the pool is sized (on a GPU that
    is only known after the weights are loaded). The executor's ``config`` has the result.

    ``drafter``: speculative decoding's drafter; default: ``config.speculative_config``'s (none
    when it is None). A torch engine drafts with its ``proposer`` the requests whose previous
    forward is in flight (overlap); an engine from ``engine_factory`` is given its own, or none. ``kv_scales``: an FP8 cache's per-layer scales from the checkpoint
    (``attention_backend.kv_scales_from_checkpoint``); None: 1.0."""
    if (model is None) == (engine_factory is None):
        raise ValueError("give exactly one of model (torch engine) or engine_factory")
    token_budget = token_budget_policy_for(config)
    kv = create_kv_cache_manager(config, model=model, kv_bytes_per_token=kv_bytes_per_token, block_hash=block_hash,
                                 kv_scales=kv_scales)
    if fit_max_seq_len_to_pool:
        pool_tokens = kv.num_blocks * config.kv_cache_config.tokens_per_block
        config = dataclasses.replace(config, max_seq_len=min(config.max_seq_len, pool_tokens))
    if drafter is None and config.speculative_config is not None:
        drafter = drafter_for(config.speculative_config, config.max_seq_len)
    if model is not None:
        engine: ModelEngine = TorchModelEngine(
            model,
            config.max_num_tokens,
            kv,
            cuda_graph_config=config.cuda_graph_config,
            max_batch_size=config.max_batch_size,
            max_seq_len=config.max_seq_len,
            max_draft_len=config.speculative_config.max_draft_len if config.speculative_config else 0,
            draft_proposer=drafter.proposer if drafter is not None else None,
        )
        engine.warmup()
        sampler = sampler or TorchSampler()
    else:
        engine = engine_factory(kv)
        if sampler is None:
            raise ValueError("a simulated engine needs its sampler")
    if config.fault_injection is not None and config.fault_injection.enabled:
        engine = FaultInjectingEngine(engine, config.fault_injection)
    scheduler = make_scheduler(config, kv, token_budget)
    return PyExecutor(
        config=config,
        drafter=drafter,
        scheduler=scheduler,
        resource_manager=ResourceManager(kv, token_budget),
        model_engine=engine,
        sampler=sampler,
        clock=clock,
    )
