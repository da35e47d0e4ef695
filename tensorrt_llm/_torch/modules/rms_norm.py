"""``RMSNorm``: root-mean-square normalisation over the last dimension, times a learned weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension of ``x`` (any leading shape:
    the hidden states (T, hidden), or Qwen3's per-head q/k (T, heads, head_dim))."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            # Half precision: torch's fused kernel, which accumulates in float32 (one launch
            # instead of eight; what every Llama implementation computes).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return x * rms * self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
