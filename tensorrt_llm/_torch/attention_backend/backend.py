"""A device's attention backend, chosen once: the builder of each forward's plan.

An engine makes its builder when it is constructed (the CPU engine a :class:`CpuPlanBuilder`,
the CUDA engine a :class:`PagedPlanBuilder` with its pinned staging), so that no step asks
which device it runs on. :func:`plan_builder` is the choice by device, for callers that get
their pools from elsewhere (``LlamaForCausalLM.forward``)::

    builder = plan_builder(device, ...)           once
    plan = builder.build(new, cached, tables)     per forward (host work, no device read)
    layer_kv = plan.layer(k_pool, v_pool, i)      per layer i: what ``Attention`` calls ``attend`` on
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from tensorrt_llm._torch.attention_backend.cpu_invariant import CpuInvariantPlan, CpuInvariantPlanBuilder, InvariantLayerKV
from tensorrt_llm._torch.attention_backend.cpu_paged import CpuAttentionPlan, CpuLayerKV, CpuPlanBuilder
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales
from tensorrt_llm._torch.attention_backend.paged import PagedAttentionPlan, PagedLayerKV, PagedPlanBuilder
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging

__all__ = ["AttentionPlan", "LayerKV", "PlanBuilder", "plan_builder"]

LayerKV = CpuLayerKV | InvariantLayerKV | PagedLayerKV  # one layer's paged KV: ``attend(q, k, v, scale)``
# one forward's plan: ``layer(k_pool, v_pool, i) -> LayerKV``
AttentionPlan = CpuAttentionPlan | CpuInvariantPlan | PagedAttentionPlan


class PlanBuilder(Protocol):
    """Builds one forward's attention plan from plain ints (request ``r`` owns the next
    ``num_new_tokens[r]`` rows); raises ValueError for tables that would corrupt the pools."""

    def build(
        self, num_new_tokens: Sequence[int], num_cached_tokens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> AttentionPlan: ...


def plan_builder(
    device: torch.device | str,
    *,
    tokens_per_block: int,
    num_blocks: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    staging: PinnedStaging | None = None,
    kv_scales: KvScales | None = None,
    batch_invariant: bool = False,
) -> PlanBuilder:
    """The builder for pools on ``device``: torch's own ops on the CPU, the paged kernels on an
    accelerator (``staging``: its pinned buffers, see :class:`PagedPlanBuilder`; ``kv_scales``:
    an FP8 pool's per-layer scales, ``kv_quant``). ``batch_invariant``: the CPU's batch-invariant
    attention (``cpu_invariant``); refused on an accelerator."""
    if torch.device(device).type == "cpu":
        builder = CpuInvariantPlanBuilder if batch_invariant else CpuPlanBuilder
        return builder(tokens_per_block=tokens_per_block, num_blocks=num_blocks, dtype=dtype, kv_scales=kv_scales)
    if batch_invariant:
        raise ValueError(f"batch-invariant attention runs on the CPU only, not on {torch.device(device).type}")
    return PagedPlanBuilder(device, tokens_per_block=tokens_per_block, num_blocks=num_blocks,
                            num_kv_heads=num_kv_heads, staging=staging, kv_scales=kv_scales)
