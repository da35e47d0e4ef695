"""The new tokens' K/V into their pool slots in one Triton kernel, RoPE of q and k with it.

A layer's paged write was two ``index_copy_`` kernels (K, V), and over an FP8 pool three more
each to quantize (widen, clamp, cast), with RoPE one kernel before them: three to nine launches
a layer, which at a decode step of one sequence cost more than the bytes they move. This kernel
does all of it with one launch, one program per token::

    q[t], k[t]      rotated in place (``ROTATE``; the rotated k rounded to the model's dtype, as
                    the separate RoPE kernel leaves it)
    k_pool[slot[t]] = k[t], v_pool[slot[t]] = v[t]        a 16-bit or float32 pool
                    = saturate(k[t] / k_scale) as e4m3     an FP8 pool (``kv_quant.quantize``:
                                                           the same IEEE division, round to
                                                           nearest even, +-448 at most)

so an FP8 pool stores exactly the bytes ``kv_quant.quantize`` gives for the values the other
path writes. Rows are read through their strides (q, k, v may be views of one fused QKV
projection); the pools are one layer's slot views ``(num_slots, Hkv, D)``, contiguous.

Importing this module needs Triton; running it needs a GPU, or ``TRITON_INTERPRET=1`` set before
the import (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotate_and_write_kv_"]

_FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value (kv_quant.FP8_MAX)


@triton.jit
def _store_kv(pool, slot, stride_ps, stride_ph, heads, offs, mask, x, scale, FP8: tl.constexpr):
    """Store ``x`` (heads, n) (the model's dtype) at ``pool[slot, heads, offs]``, quantized for an FP8 pool."""
    ptrs = pool + slot * stride_ps + heads[:, None] * stride_ph + offs[None, :]
    if FP8:
        y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's x.float() / scale
        y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
        tl.store(ptrs, y.to(pool.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, x.to(pool.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kernel(
    Q, K, V, COS, SIN, KP, VP, SLOTS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_ps, stride_ph,
    k_scale, v_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, ROTATE: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HALF)  # (HALF,) the first half of a head's channels
    slot = tl.load(SLOTS + t)
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None]
    k_first = K + t * stride_kt + kv_heads[:, None] * stride_kh + offs_h[None, :]
    k1 = tl.load(k_first, mask=kv_mask, other=0.0)  # (KVP, HALF)
    k2 = tl.load(k_first + HALF, mask=kv_mask, other=0.0)
    if ROTATE:
        cos = tl.load(COS + t * stride_ct + offs_h).to(tl.float32)[None, :]  # (1, HALF)
        sin = tl.load(SIN + t * stride_st + offs_h).to(tl.float32)[None, :]
        q_heads = tl.arange(0, Q_HEADS_PAD)
        q_mask = (q_heads < NUM_Q_HEADS)[:, None]
        q_first = Q + t * stride_qt + q_heads[:, None] * stride_qh + offs_h[None, :]
        x1 = tl.load(q_first, mask=q_mask, other=0.0).to(tl.float32)
        x2 = tl.load(q_first + HALF, mask=q_mask, other=0.0).to(tl.float32)
        tl.store(q_first, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=q_mask)
        tl.store(q_first + HALF, (x1 * sin + x2 * cos).to(Q.dtype.element_ty), mask=q_mask)
        x1, x2 = k1.to(tl.float32), k2.to(tl.float32)
        k1 = (x1 * cos - x2 * sin).to(K.dtype.element_ty)  # rounded as the model's k is
        k2 = (x1 * sin + x2 * cos).to(K.dtype.element_ty)
        tl.store(k_first, k1, mask=kv_mask)
        tl.store(k_first + HALF, k2, mask=kv_mask)
    _store_kv(KP, slot, stride_ps, stride_ph, kv_heads, offs_h, kv_mask, k1, k_scale, FP8)
    _store_kv(KP, slot, stride_ps, stride_ph, kv_heads, offs_h + HALF, kv_mask, k2, k_scale, FP8)
    v_first = V + t * stride_vt + kv_heads[:, None] * stride_vh + offs_h[None, :]
    v1 = tl.load(v_first, mask=kv_mask, other=0.0)
    v2 = tl.load(v_first + HALF, mask=kv_mask, other=0.0)
    _store_kv(VP, slot, stride_ps, stride_ph, kv_heads, offs_h, kv_mask, v1, v_scale, FP8)
    _store_kv(VP, slot, stride_ps, stride_ph, kv_heads, offs_h + HALF, kv_mask, v2, v_scale, FP8)


def rotate_and_write_kv_(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by cos, sin (T, D/2) (none of the three:
    no RoPE), then write k and v (T, Hkv, D) into ``slots`` (T,) int64 of the slot views
    ``k_pool``, ``v_pool`` (num_slots, Hkv, D), quantized with the scales in an FP8 pool.
    D/2 a power of two; unit stride on the last dimension of every tensor."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    rotate = cos is not None
    half = k.shape[-1] // 2
    num_q_heads = q.shape[1] if rotate else 1
    dummy = k  # unread when not rotating
    _rope_write_kernel[(num_tokens,)](
        q if rotate else dummy, k, v, cos if rotate else dummy, sin if rotate else dummy, k_pool, v_pool, slots,
        q.stride(0) if rotate else 0, q.stride(1) if rotate else 0, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0) if rotate else 0, sin.stride(0) if rotate else 0,
        k_pool.stride(0), k_pool.stride(1),
        k_scale, v_scale,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF=half, ROTATE=rotate,
        FP8=k_pool.dtype == torch.float8_e4m3fn, num_warps=4,
    )
