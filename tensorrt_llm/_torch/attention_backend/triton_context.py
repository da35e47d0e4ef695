"""Context attention in Triton: every chunk of a forward in one varlen launch, causal with the
diagonal at the bottom right, grouped-query heads read from their shared KV head.

Why a kernel of our own: the context chunk over a long cached prefix (a 4096-token chunk after
16k cached tokens, every later chunk of a long prompt) spends half of a 12B forward in attention,
and torch's bundled FlashAttention-2 runs it at about 340 TFLOP/s on an H200. cuDNN runs the same
shape much faster but builds a plan per shape (``kernels``' docstring). Triton compiles once per
tile configuration and head size, whatever the lengths, and lowers ``tl.dot`` to Hopper's
warp-group MMA.

Layout, the same as the flash varlen call it stands beside::

    q         (Tq, Hq, D)   every chunk's queries, packed; chunk i owns rows cu_q[i] .. cu_q[i+1]
    k, v      (Tk, Hkv, D)  every chunk's keys (its cached prefix, then itself), packed by cu_k
    out       (Tq, Hq, D)

Query ``j`` of chunk ``i`` sees keys ``[0, k_len - q_len + j]`` of its chunk. One program handles
``BLOCK_M`` queries of one chunk and one query head; the tiles of keys that every query of its
block sees run without a mask, the few on the diagonal with one. Blocks are launched heaviest
first (the last queries of a chunk see the most keys) and the query heads of one KV head side by
side, so that their K/V tiles are shared through L2.

K and V may be an FP8 cache's stored values (``kv_quant``): each tile is widened to the queries'
dtype as it is loaded, ``k_scale`` is folded into the softmax scale and ``v_scale`` into the output.

Importing this module needs Triton (the caller guards it); running it needs a GPU, or
``TRITON_INTERPRET=1`` set before the import (the CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["ContextConfig", "DEFAULT_CONFIG", "context_attention_triton"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """Tile shape: queries per program, keys per tile, warps, pipeline depth."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 4


# The best of ``benchmarks.gpu.kernels``' sweep for a 4096-token chunk after a 16k prefix on the
# H200 (488 TFLOP/s; 64/64/4/3 was within 3% there and ahead on a plain prefill, 394 against 334,
# but whole forwards came out equal or better with this one: ``benchmarks/results/h200/context/``).
DEFAULT_CONFIG = ContextConfig()


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
    lo, hi, offs_m, diagonal, k_len, sm_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into the running softmax state (log2 units)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n  # (BN,) key positions in the chunk
        # 32-bit offsets from the chunk's (64-bit) base: the caller keeps k_len * stride < 2**31
        kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]  # (D, BN)
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]  # (BN, D)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < k_len, other=0.0).to(q.dtype)  # FP8 tiles widened
        else:
            kt = tl.load(kt_ptrs).to(q.dtype)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * sm_scale_log2  # (BM, BN)
        if MASKED:
            s = tl.where(cols[None, :] <= diagonal + offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < k_len, other=0.0).to(q.dtype)
        else:
            v = tl.load(v_ptrs).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _context_kernel(
    Q, K, V, Out, cu_q, cu_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    sm_scale_log2, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest blocks first
    seq = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:  # the grid is sized for the longest chunk
        return
    k_start = tl.load(cu_k + seq)
    k_len = tl.load(cu_k + seq + 1) - k_start
    diagonal = k_len - q_len  # query j sees keys [0, diagonal + j]
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Every query of the block sees keys [0, diagonal + m0]: whole tiles of those need no mask.
    # The first tile either pass folds in holds a key each valid row sees, so no valid row's
    # running maximum stays -inf (which would make alpha NaN).
    unmasked_end = (diagonal + m0 + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(diagonal + m0 + BLOCK_M, k_len)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, unmasked_end, offs_m,
                                  diagonal, k_len, sm_scale_log2, HEAD_DIM, BLOCK_N, False, IEEE)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, unmasked_end, end, offs_m,
                                  diagonal, k_len, sm_scale_log2, HEAD_DIM, BLOCK_N, True, IEEE)
    out = acc / l_i[:, None] * v_scale  # exact for an unquantized cache (v_scale 1.0)
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


def context_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q_len: int,
    scale: float,
    *,
    config: ContextConfig = DEFAULT_CONFIG,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q (Tq, Hq, D), k/v (Tk, Hkv, D) in q's dtype or float8_e4m3fn (read as ``k * k_scale``,
    ``v * v_scale``), unit stride on D; cu_seqlens_q/k (N+1,) int32 on q's
    device; ``max_q_len`` the longest chunk's queries (a host int: it sizes the grid) -> the
    attention output (Tq, Hq, D). Every chunk needs ``k_len >= q_len`` and ``k_len * k.stride(0) <
    2**31`` (a key's offset from its chunk's first is 32-bit); the head size is a power
    of two from 16 (``tl.arange``, ``tl.dot``) to 128 with the default tiles, whose shared memory
    (~160 KB at 128) only Hopper-class GPUs have. No host synchronisation."""
    out = torch.empty_like(q)
    num_chunks = cu_seqlens_q.shape[0] - 1
    if num_chunks == 0 or q.shape[0] == 0:
        return out
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k.shape[1]
    grid = (num_q_heads, triton.cdiv(max_q_len, config.block_m), num_chunks)
    _context_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * k_scale * _LOG2E, v_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
