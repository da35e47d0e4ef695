"""The batch-invariant layers: each row's output bits depend on that row alone (and, for the
attention, on its sequence's earlier positions), never on the batch, the thread count or how a
prompt was chunked. ``LlamaForCausalLM`` swaps them in at construction when
``LlamaConfig.batch_invariant`` is set (:func:`make_batch_invariant`); nothing on the step path
asks which kind it runs. The arithmetic is in ``attention_backend/invariant_math.py``, the
paged attention in ``attention_backend/cpu_invariant.py``; ``docs/determinism.md`` says what is
invariant and what it costs.

==========================  ===================================================================
layer                       batch-invariant form
==========================  ===================================================================
``Linear``                  :class:`InvariantLinear`: the weight on a per-output-row grid (once),
                            each input row on its own grid, their integer products exact by
                            int8 GEMMs of 7-bit digits: any blocking gives the same bits
``RMSNorm``                 :class:`InvariantRMSNorm`: the sum of squares exact (row on a grid)
``GatedMLP.act_fn``         :class:`InvariantSiLU`: SiLU from exactly rounded operations
``RotaryEmbedding``         :class:`InvariantRotaryEmbedding`: cos/sin read from a table built once
``CausalAttention``         :class:`InvariantCausalAttention` (``forward_full``); with a cache the
                            engine's plan builder is ``cpu_invariant.CpuInvariantPlanBuilder``
==========================  ===================================================================

A linear kind added later (quantized weights kept quantized) gets a batch-invariant form by one
entry in :func:`make_batch_invariant`'s table: ``InvariantLinear(layer, its dequantized weight)``.
Without one, building a batch-invariant model with it is refused by name.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.cpu_invariant import invariant_attention
from tensorrt_llm._torch.attention_backend.invariant_math import (
    FLOAT64_BITS,
    INT_GRID_BITS,
    int_matmul,
    silu,
    to_digits,
    to_grid,
    weight_digits,
)
from tensorrt_llm._torch.modules.attention import Attention, CausalAttention
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding

__all__ = [
    "InvariantCausalAttention", "InvariantLinear", "InvariantRMSNorm", "InvariantRotaryEmbedding", "InvariantSiLU",
    "dense_weight", "make_batch_invariant",
]

# RoPE tables are computed in pieces of this many values: torch runs an elementwise op of fewer
# than its grain (32768) values on one thread, so the table does not depend on the thread count.
_TABLE_PIECE = 16384


def dense_weight(linear: Linear, float16_weights: bool = False) -> torch.Tensor:
    """The ``(out, in)`` weight ``linear`` multiplies by: its float16-rounded copy in a
    ``float16-weights`` model (whose layers run fbgemm's float16 GEMM, alone or stacked:
    ``models/linear_formats``), else ``weight`` itself."""
    weight = linear.weight.detach()
    return weight.to(torch.float16).to(weight.dtype) if float16_weights or linear.packed_float16 else weight


class InvariantLinear(nn.Module):
    """``y = x @ W.T + b`` with every dot product exact before one rounding: ``W`` rounded once to
    a grid of its own per output row and each input row of ``x`` to one of its own
    (``invariant_math.to_grid``, 20 bits: about float32's precision), their integer products
    computed exactly by int8 GEMMs of 7-bit digits (``invariant_math.int_matmul``: int32 sums, so
    any blocking, thread count or instruction set gives the same bits), the scales (powers of
    two) multiplied back, the bias added in float64 and the result rounded to ``x``'s dtype.

    Built from the layer it replaces and the dense ``(out, in)`` weight that layer multiplies by
    (:func:`dense_weight` for a :class:`Linear`; a dequantized weight for a quantized kind). Keeps
    that layer's ``weight`` and ``bias`` parameters (tied or shared, as they were: the state dict
    and the device do not change) and the weight's three int8 digits as buffers (three bytes a
    weight, read once per forward). One rank only: a sharded layer is refused."""

    def __init__(self, linear: nn.Module, weight: torch.Tensor) -> None:
        super().__init__()
        if getattr(linear, "tensor_parallel_mode", None) is not None:
            raise ValueError("a batch-invariant linear runs on one rank (tensor_parallel_size 1)")
        self.out_features, self.in_features = weight.shape
        self.weight = linear.weight  # the same parameter (device, state_dict, tying)
        self.bias = linear.bias
        ints, scale = to_grid(weight.detach().to(torch.float64), INT_GRID_BITS)  # (out, in), (out, 1)
        self.register_buffer("w_digits", weight_digits(ints.T), persistent=False)  # (in, DIGITS * out) int8
        self.register_buffer("w_scale", scale.view(1, -1), persistent=False)  # (1, out)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float64)
        self.register_buffer("bias64", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float64)  # (T, in)
        ints, scale = to_grid(rows, INT_GRID_BITS)  # (T, in), (T, 1)
        y = int_matmul(to_digits(ints), self.w_digits) * scale * self.w_scale  # (T, out), exact scalings
        if self.bias64 is not None:
            y = y + self.bias64
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class InvariantRMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, in float64 with the sum of
    squares exact (the row on a grid of ``(53 - ceil(log2 n)) // 2`` bits: 21 for 576), rounded
    once to ``x``'s dtype."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.register_buffer("weight64", norm.weight.detach().to(torch.float64), persistent=False)
        self.eps = norm.eps
        size = norm.weight.shape[0]
        self.bits = (FLOAT64_BITS - math.ceil(math.log2(size))) // 2 if size > 1 else 26

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x64 = x.to(torch.float64)
        ints, scale = to_grid(x64, self.bits)  # (..., n), (..., 1)
        mean_square = (ints * ints).sum(dim=-1, keepdim=True) * (scale * scale) / x.shape[-1]
        return (x64 * (1.0 / torch.sqrt(mean_square + self.eps)) * self.weight64).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class InvariantSiLU(nn.Module):
    """SiLU from exactly rounded operations (``invariant_math.silu``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


class InvariantRotaryEmbedding(nn.Module):
    """cos/sin of positions read from tables of every position ``[0, max_positions)``, computed
    once at construction as :class:`RotaryEmbedding` computes them, so a position's values are the
    same in every forward whatever its size (the elementwise ``cos`` and ``sin`` would otherwise
    take a vectorised or a scalar path by the forward's size and the thread count)."""

    def __init__(self, rotary: RotaryEmbedding, max_positions: int) -> None:
        super().__init__()
        step = max(1, _TABLE_PIECE // rotary.inv_freq.numel())  # positions per piece
        positions = torch.arange(max_positions, device=rotary.inv_freq.device)
        pieces = [rotary(positions[start : start + step]) for start in range(0, max_positions, step)]
        self.register_buffer("cos_table", torch.cat([cos for cos, _ in pieces]), persistent=False)  # (P, head_dim/2)
        self.register_buffer("sin_table", torch.cat([sin for _, sin in pieces]), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[position_ids], self.sin_table[position_ids]  # (T, head_dim/2) each


class InvariantCausalAttention(nn.Module):
    """One sequence without a cache (``forward_full``), by the same arithmetic as the paged
    batch-invariant attention (``cpu_invariant.invariant_attention``): query ``i`` at position ``i``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)."""
        positions = torch.arange(q.shape[0], device=q.device)[None]  # (1, T)
        return invariant_attention(q[None], k[None], v[None], positions, scale)[0]


def make_batch_invariant(model: nn.Module, *, max_positions: int, float16_weights: bool = False) -> None:
    """Swap every layer of ``model`` (its weights loaded) for its batch-invariant form, in place,
    once, at construction (``LlamaForCausalLM``). The parameters stay the same objects. A leaf
    module (one with no children: it computes something itself) of a kind with no batch-invariant
    form here is refused by name: its arithmetic could depend on the batch. Containers only
    compose their children (residual adds and views are elementwise)."""
    swaps = {Linear: lambda linear: InvariantLinear(linear, dense_weight(linear, float16_weights)), RMSNorm: InvariantRMSNorm,
             nn.SiLU: lambda _: InvariantSiLU(),
             CausalAttention: lambda _: InvariantCausalAttention(),
             RotaryEmbedding: lambda rotary: InvariantRotaryEmbedding(rotary, max_positions)}
    for module in model.modules():  # stacked projections (linear_formats) would bypass the swapped layers
        if isinstance(module, Attention):
            module.qkv_method = None
        elif isinstance(module, GatedMLP):
            module.gate_up_method = None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swap = swaps.get(type(child))
            if swap is not None:
                setattr(parent, name, swap(child))
            elif next(child.children(), None) is None and not isinstance(child, _INVARIANT_LEAVES):
                raise ValueError(f"batch_invariant: layer {name!r} ({type(child).__name__}) has no batch-invariant form")


# Leaves that are batch-invariant as they are (an embedding is a row lookup) or already swapped.
_INVARIANT_LEAVES = (nn.Embedding, InvariantLinear, InvariantRMSNorm, InvariantSiLU, InvariantRotaryEmbedding,
                     InvariantCausalAttention)
