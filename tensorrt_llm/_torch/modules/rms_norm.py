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
        # torch's own: in half precision it accumulates in float32 (one launch instead of eight on a
        # GPU; what every Llama implementation computes); in float32 and float64 it computes
        # x * rsqrt(mean(x**2) + eps) * weight in that order, bit for bit, from one Python call
        # instead of six (a decode step of a small model on the CPU makes 61 of them).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
