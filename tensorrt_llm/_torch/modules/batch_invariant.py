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
                            each input row on its own grid, one float64 matmul of integers:
                            exact, so any BLAS blocking gives the same bits
``RMSNorm``                 :class:`InvariantRMSNorm`: the sum of squares exact (row on a grid)
``GatedMLP.act_fn``         :class:`InvariantSiLU`: SiLU from exactly rounded operations
``RotaryEmbedding``         :class:`InvariantRotaryEmbedding`: cos/sin read from a table built once
``CausalAttention``         :class:`InvariantCausalAttention` (``forward_full``); with a cache the
                            engine's plan builder is ``cpu_invariant.CpuInvariantPlanBuilder``
==========================  ===================================================================

Where another linear kind is added (packed or quantized weights), :func:`dense_weight` is the one
place that says which dense weight its batch-invariant form multiplies by.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.cpu_invariant import invariant_attention
from tensorrt_llm._torch.attention_backend.invariant_math import FLOAT64_BITS, dot_bits, silu, to_grid
from tensorrt_llm._torch.modules.attention import CausalAttention
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


def dense_weight(linear: Linear) -> torch.Tensor:
    """The ``(out, in)`` weight ``linear`` multiplies by: its float16-rounded copy when it is packed
    (``Linear.pack_float16``), else ``weight`` itself. A linear kind with other stored weights
    (quantized) gives its dequantized weight here."""
    weight = linear.weight.detach()
    return weight.to(torch.float16).to(weight.dtype) if linear.packed_float16 else weight


class InvariantLinear(nn.Module):
    """``y = x @ W.T + b``, exact up to one rounding per grid: ``W`` rounded once to a grid of its
    own per output row and each input row of ``x`` to one of its own (``invariant_math.to_grid``),
    their integer products summed exactly in float64, the scales (powers of two) multiplied back,
    then the bias added and the result rounded to ``x``'s dtype. The grid bits share a float64's 53
    between the two factors and the ``ceil(log2 in_features)`` the sum needs (``dot_bits``): 21
    and 22 bits for SmolLM2's 576 inputs.

    Holds the original ``weight`` and ``bias`` parameters (tied or shared, as they were) and the
    gridded weight as float64 buffers (twice float32's bytes). One rank only (no tensor parallelism)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        if linear.tensor_parallel_mode is not None:
            raise ValueError("a batch-invariant linear runs on one rank (tensor_parallel_size 1)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter (device, state_dict, tying)
        self.bias = linear.bias
        self.x_bits, w_bits = dot_bits(self.in_features)
        ints, scale = to_grid(dense_weight(linear).to(torch.float64), w_bits)  # (out, in), (out, 1)
        self.register_buffer("w_ints_t", ints.T.contiguous(), persistent=False)  # (in, out)
        self.register_buffer("w_scale", scale.view(1, -1), persistent=False)  # (1, out)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float64)
        self.register_buffer("bias64", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float64)  # (T, in)
        ints, scale = to_grid(rows, self.x_bits)  # (T, in), (T, 1)
        y = (ints @ self.w_ints_t) * scale * self.w_scale  # (T, out): exact sums, exact scalings
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
        device = rotary.inv_freq.device
        pieces = [rotary(torch.arange(start, min(start + max(1, _TABLE_PIECE // rotary.inv_freq.numel()), max_positions),
                                      device=device))
                  for start in range(0, max_positions, max(1, _TABLE_PIECE // rotary.inv_freq.numel()))]
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


def make_batch_invariant(model: nn.Module, *, max_positions: int) -> None:
    """Swap every layer of ``model`` (its weights loaded) for its batch-invariant form, in place,
    once, at construction (``LlamaForCausalLM``). The parameters stay the same objects. A leaf
    module (one with no children: it computes something itself) of a kind with no batch-invariant
    form here is refused by name: its arithmetic could depend on the batch. Containers only
    compose their children (residual adds and views are elementwise)."""
    swaps = {Linear: InvariantLinear, RMSNorm: InvariantRMSNorm, nn.SiLU: lambda _: InvariantSiLU(),
             CausalAttention: lambda _: InvariantCausalAttention(),
             RotaryEmbedding: lambda rotary: InvariantRotaryEmbedding(rotary, max_positions)}
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
