"""Rotary embedding of q and k in one Triton kernel, in place.

The torch expression of RoPE (``modeling_llama.apply_rotary``) is seven elementwise kernels per
tensor; fourteen per layer for q and k, which at a decode step cost more in launches than in
work. This kernel rotates both with one launch: one program per token, every head of q and k,
computed in float32 and rounded once (the torch path rounds after each operation; both agree
to the dtype's precision).

Convention (Llama's rotate-half): channel ``i`` and ``i + D/2`` of each head turn by the token's
angle ``i``; ``cos``, ``sin`` are (T, D/2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotate_qk_"]


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(COS + t * stride_ct + offs_d).to(tl.float32)[None, :]  # (1, HALF)
    sin = tl.load(SIN + t * stride_st + offs_d).to(tl.float32)[None, :]

    heads = tl.arange(0, Q_HEADS_PAD)
    mask = (heads < NUM_Q_HEADS)[:, None]
    first = Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]  # (H, HALF)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x1 * sin + x2 * cos).to(Q.dtype.element_ty), mask=mask)

    heads = tl.arange(0, KV_HEADS_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None]
    first = K + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(K.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x1 * sin + x2 * cos).to(K.dtype.element_ty), mask=mask)


def rotate_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by cos, sin (T, D/2); D/2 a power of two,
    unit stride on the last dimension of every tensor."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = q.shape[-1] // 2
    _rope_kernel[(num_tokens,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_KV_HEADS=k.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]), KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, num_warps=4,
    )
