"""Attention backends for accelerators (upstream's ``attention_backend`` package).

The CPU path of the model keeps its own per-request loop (``modeling_llama``); on a GPU the
model's attention calls :class:`PagedLayerKV.attend`, driven by a :class:`PagedAttentionPlan`
built once per forward by :func:`build_plan`. Importing this package needs neither a GPU nor
Triton; the kernels are chosen at call time by device and dtype (``kernels``).
"""

from tensorrt_llm._torch.attention_backend.paged import (
    ContextBatch,
    DecodeBatch,
    PagedAttentionPlan,
    PagedLayerKV,
    build_plan,
)

__all__ = ["ContextBatch", "DecodeBatch", "PagedAttentionPlan", "PagedLayerKV", "build_plan"]
