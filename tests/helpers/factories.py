"""Factories for tests: requests, configs, KV managers and executors built the way production builds them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.kv_cache.values import KVAllocation
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import ModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager, create_py_executor
from tensorrt_llm._torch.pyexecutor.executor.validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm._torch.pyexecutor.scheduler import make_scheduler as _make_scheduler
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tensorrt_llm._torch.pyexecutor.budget.policies import TokenBudgetPolicy, token_budget_policy_for

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
    """A bookkeeping-mode KV manager as an executor with ``config`` builds it."""
    config = config or make_config(**config_overrides)
    return create_kv_cache_manager(config, kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def make_policy(config: ExecutorConfig) -> TokenBudgetPolicy:
    """The token-budget policy an executor with ``config`` runs."""
    return token_budget_policy_for(config)


def make_resource_manager(config: ExecutorConfig, kv: KVCacheManager) -> ResourceManager:
    """``prepare_resources`` as an executor with ``config`` runs it over ``kv``: re-check, allocate, fix up."""
    return ResourceManager(kv, make_policy(config))


def make_sim_engine(config: ExecutorConfig, kv: KVCacheManager) -> SimulatedModelEngine:
    """The simulated engine an executor with ``config`` would run over ``kv``."""
    return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB)


@functools.cache
def cost_model():
    """The torch model the cost properties run on the real engine: tiny-random's shape with one
    layer and a vocabulary that holds every id the strategies draw (``VOCAB``), float32."""
    from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM

    return LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], vocab_size=VOCAB, num_layers=1))


def make_torch_engine(config: ExecutorConfig):
    """``(kv, engine)``: the CPU torch engine over real K/V tensors, with the pool ``config`` asks
    for (its host tier too, in blocks as ``make_config`` counts them)."""
    from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine

    model = cost_model()
    kv_config = config.kv_cache_config
    host_blocks = kv_config.host_cache_size // (kv_config.tokens_per_block * KV_BYTES_PER_TOKEN)
    host_bytes = host_blocks * kv_config.tokens_per_block * model.config.kv_bytes_per_token
    config = dataclasses.replace(config, kv_cache_config=dataclasses.replace(kv_config, host_cache_size=host_bytes))
    kv = create_kv_cache_manager(config, model=model)
    assert kv.num_blocks == kv_config.num_blocks and kv.pool.num_host_blocks == host_blocks
    return kv, TorchModelEngine(model, config.max_num_tokens, kv)


def make_scheduler(config: ExecutorConfig, kv: KVCacheManager) -> SimpleScheduler:
    """The two-stage scheduler an executor with ``config`` would build over ``kv``."""
    return _make_scheduler(config, kv, make_policy(config))


def make_sim_executor(
    config: ExecutorConfig | None = None, *, overlap: bool = False, drafter=None, **config_overrides
) -> PyExecutor:
    """An executor whose engine is simulated (bookkeeping KV, synthetic tokens), everything else real.

    ``overlap``: the overlap scheduler over an engine that completes asynchronously (a forward
    runs when its result is first asked for, after the next one was scheduled and prepared) and
    picks the synthetic sampler's tokens itself, as a model on a device does. ``drafter``:
    speculative decoding's (default: the config's); the engine drafts steps built in flight with
    its ``proposer``."""
    config = config or make_config(**config_overrides)
    if overlap:
        config = dataclasses.replace(config, disable_overlap_scheduler=False)
    sampler = SyntheticSampler(VOCAB)
    proposer = drafter.proposer if drafter is not None else None

    def engine(kv):
        if overlap:
            return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB, sampler=sampler, asynchronous=True,
                                        draft_proposer=proposer)
        return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB, draft_proposer=proposer)

    executor = create_py_executor(config, engine_factory=engine, sampler=sampler, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                                  drafter=drafter)
    assert executor.overlap == overlap
    return executor


def make_batch(context=(), generation=(), *, estimated_reusable: dict[int, int] | None = None) -> ScheduledRequests:
    """A batch by hand: ``context`` holds requests (their whole remaining prompt) or
    ``(request, chunk size)`` pairs; ``generation`` requests in generation."""
    chunks = []
    for item in context:
        request, size = item if isinstance(item, tuple) else (item, item.context_remaining_length)
        chunks.append(ContextChunk.of(request, size))
    return ScheduledRequests(
        context_chunks=chunks, generation_requests=list(generation), estimated_reusable=dict(estimated_reusable or {})
    )


# ---- driving one request by hand (building KV states for batch-level tests) ------------


def make_request_limits(config: ExecutorConfig, kv: KVCacheManager, engine: ModelEngine) -> RequestLimits:
    """The limits a :class:`PyExecutor` with this config, KV manager and engine checks at submission."""
    return RequestLimits.of(config, kv, engine)


def is_servable(request: LlmRequest, limits: RequestLimits, kv: KVCacheManager) -> bool:
    """Would the executor accept ``request`` (the same check as ``PyExecutor.validate``)?"""
    try:
        validate_request(request, limits, kv)
    except InvalidRequestError:
        return False
    return True


def prepare_alone(kv: KVCacheManager, request: LlmRequest, chunk: int | None = None) -> KVAllocation:
    """Allocate ``request``'s next step on its own, outside any token budget (the KV manager
    knows none), and record the reuse it found on the request as the executor does.

    A context request's chunk is ``chunk`` tokens (default: the rest of its prompt).
    Allocation is all-or-nothing: when the blocks cannot be had, nothing was claimed and
    ``allocation.deferred`` names the request.
    """
    if request.is_context_init_state:
        size = request.context_remaining_length if chunk is None else chunk
        estimate = {} if kv.is_allocated(request) else {request.request_id: kv.match(request).reusable_tokens}
        batch = make_batch([(request, size)], estimated_reusable=estimate)
    else:
        batch = make_batch(generation=[request])
    allocation = kv.prepare_resources(batch)
    for claim in allocation.claims:
        if claim.reused_tokens:
            request.reuse_prefix(claim.reused_tokens)
    return allocation


def complete(kv: KVCacheManager, batch: ScheduledRequests, sampler: Sampler) -> None:
    """Play the forward for an allocated ``batch``: move each request past what it computed,
    sample where it samples, then record the KV (``PyExecutor._update_requests`` then
    ``commit``)."""
    for chunk in batch.context_chunks:
        request = chunk.request
        request.complete_context_chunk(chunk.end)
        if chunk.is_last:
            request.state = LlmRequestState.GENERATION_IN_PROGRESS
            request.add_new_token(sampler.sample(request, None)[0])
    for request in batch.generation_requests:
        request.add_new_token(sampler.sample(request, None)[0])
        request.is_first_draft = False
    kv.commit(batch)


def run_alone(kv: KVCacheManager, request: LlmRequest, sampler: Sampler, *, chunk: int | None = None) -> bool:
    """One executor iteration for ``request`` alone: allocate, "compute", update its state and the KV.

    A context request runs ``chunk`` tokens (default: the rest of its prompt); a generation
    request one step. Returns False, changing nothing, when the blocks cannot be had.
    """
    allocation = prepare_alone(kv, request, chunk)
    if allocation.deferred:
        return False
    complete(kv, allocation.scheduled, sampler)
    return True


def served_model(model, *, dtype: str | None = None):
    """The torch model ``LLM(model, dtype=dtype)`` serves (same preset or file, same seed)."""
    from tensorrt_llm.llmapi.llm_utils import load_model

    return load_model(model, dtype=dtype).model


def greedy_reference(model, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy decoding with ``forward_full``: the whole sequence every step, no KV cache."""
    import torch

    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model.forward_full(torch.tensor(tokens, dtype=torch.long))  # (L, vocab)
            tokens.append(int(torch.argmax(logits[-1])))
    return tokens[len(prompt) :]
