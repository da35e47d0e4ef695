"""Paged attention backends (upstream's ``attention_backend`` package).

On a GPU the model's attention calls :class:`PagedLayerKV.attend`, driven by a
:class:`PagedAttentionPlan` built once per forward by :func:`build_plan`; on the CPU it calls
:class:`CpuLayerKV.attend`, driven by a :class:`CpuAttentionPlan` from :func:`build_cpu_plan`
(``cpu_paged``: padded batches through torch's SDPA, no loop over requests). Importing this package needs neither a GPU nor
Triton; the kernels are chosen at call time by device and dtype (``kernels``).
"""

from tensorrt_llm._torch.attention_backend.cpu_paged import CpuAttentionPlan, CpuLayerKV, build_cpu_plan
from tensorrt_llm._torch.attention_backend.paged import (
    ContextBatch,
    DecodeBatch,
    PagedAttentionPlan,
    PagedLayerKV,
    build_plan,
)

__all__ = ["CpuAttentionPlan", "CpuLayerKV", "build_cpu_plan", "ContextBatch", "DecodeBatch", "PagedAttentionPlan", "PagedLayerKV", "build_plan"]
