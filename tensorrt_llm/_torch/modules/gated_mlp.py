"""``GatedMLP``: the SwiGLU feed-forward block of Llama-style decoders, ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel (one
    all-reduce for the block). Bias-free, as every architecture the engine runs."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        tp = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
        self.gate_proj = Linear(hidden_size, intermediate_size, tensor_parallel_mode=TensorParallelMode.COLUMN, **tp)
        self.up_proj = Linear(hidden_size, intermediate_size, tensor_parallel_mode=TensorParallelMode.COLUMN, **tp)
        self.down_proj = Linear(intermediate_size, hidden_size, tensor_parallel_mode=TensorParallelMode.ROW, **tp)
        self.act_fn = nn.SiLU()  # a module of its own: a batch-invariant model swaps it (batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # (T, hidden)
