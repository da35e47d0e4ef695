"""Paged attention backends (upstream's ``attention_backend`` package).

The model's attention calls ``attend`` on one layer's view of a per-forward plan. A device's
plan builder is chosen once (``backend``: :func:`plan_builder`; an engine makes its own at
construction): on a GPU a :class:`PagedPlanBuilder` (``paged``: :class:`PagedAttentionPlan`,
:class:`PagedLayerKV`), on the CPU a :class:`CpuPlanBuilder` (``cpu_paged``: padded batches
through torch's SDPA, no loop over requests). Importing this package needs neither a GPU nor
Triton; the kernels are chosen at call time by device and dtype (``kernels``). The pools hold the
model's dtype or FP8 (``kv_quant``: ``KvCacheConfig.dtype``).
"""

from tensorrt_llm._torch.attention_backend.backend import AttentionPlan, LayerKV, PlanBuilder, plan_builder
from tensorrt_llm._torch.attention_backend.cpu_paged import CpuAttentionPlan, CpuLayerKV, CpuPlanBuilder, build_cpu_plan
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, kv_cache_dtype, kv_scales_from_checkpoint
from tensorrt_llm._torch.attention_backend.paged import (
    ContextBatch,
    DecodeBatch,
    PagedAttentionPlan,
    PagedLayerKV,
    PagedPlanBuilder,
    build_plan,
)

__all__ = [
    "AttentionPlan", "ContextBatch", "CpuAttentionPlan", "CpuLayerKV", "CpuPlanBuilder", "DecodeBatch", "KvScales",
    "LayerKV", "PagedAttentionPlan", "PagedLayerKV", "PagedPlanBuilder", "PlanBuilder", "build_cpu_plan", "build_plan",
    "kv_cache_dtype", "kv_scales_from_checkpoint", "plan_builder",
]
