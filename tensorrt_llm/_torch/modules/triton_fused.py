"""Triton kernels for the fused decoder layer on a GPU (``models/fused_layers.py``): RMSNorm with
the residual add before it, and SiLU-and-multiply of a fused gate/up projection.

At a decode step of one sequence a layer's small kernels cost more in launches than in bytes;
these replace three or four torch kernels each with one:

    add_rms_norm   s = x + r (rounded to the dtype, as torch's add)   -> s and rms_norm(s)
                   (torch: add, then the norm)
    rms_norm       x * rsqrt(mean(x^2) + eps), rounded to the dtype, times the weight
                   (Hugging Face's order: ``weight * hidden.to(input_dtype)``)
    silu_and_mul   silu(g) rounded to the dtype, times u, from one (T, 2F) tensor [g | u]
                   (torch: silu, then mul, over two projections' outputs)

Each computes in float32 and rounds where the torch expressions round, so they agree with them
to the dtype's precision (the sum of squares is reduced in another order). The CPU never runs
them: its modules keep their torch forms, and the float64 reference stays as it is.

Importing this module needs Triton; running it needs a GPU, or ``TRITON_INTERPRET=1`` set before
the import (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "rms_norm", "silu_and_mul"]


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, Sum,
    stride_x, stride_r, stride_o, stride_s,
    n, eps,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded, as torch's add
        tl.store(Sum + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(X.dtype.element_ty) * w
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, total,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), total.stride(0),
            n, eps, BLOCK=block, RESIDUAL=residual is not None, num_warps=min(16, max(4, block // 512)),
        )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x (T, n) (unit stride on n) times ``weight`` (n,)."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (T, n) and RMSNorm of s times ``weight``: returns (s, norm), new tensors."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(GU, Out, stride_g, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GU + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + n + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty)  # rounded, as torch's silu output
    tl.store(Out + row * stride_o + cols, (silu * u).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for gate_up (T, 2F) = [g | u] (unit stride on the last dimension) -> (T, F)."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                           BLOCK=block, num_warps=4)
    return out
