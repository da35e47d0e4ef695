"""Paged decode attention in Triton: one query token per sequence, K/V read in place from the pool.

Why a kernel of our own: torch's kernels cannot read a paged pool of 32-token blocks. Gathering
each sequence's blocks into a contiguous copy first and running SDPA costs about 3.4x the bytes
of reading them once (``../shared/calibration/attention_h200.md``), and the flash kernel bundled
with torch only pages blocks of a multiple of 256 tokens. Decode is bound by the bytes of K/V it
reads, so this kernel reads every cached K/V row exactly once, straight from its slot.

Layout (see ``PagedAttentionPlan``)::

    q        (T, Hq, D)                the flat forward's queries; row rows[b] is sequence b's
    k_pool   (num_slots, Hkv, D)       a layer's pool viewed flat: slot = block * tpb + offset
    tables   (B, W) int32              block ids of each sequence, in position order
    seq_lens (B,) int32                positions each sequence attends to (cached + itself)

One program handles one (sequence, KV head, split): the G = Hq / Hkv query heads that share the KV
head are the rows of one ``tl.dot`` (padded to 16), so each K/V row is loaded once for the whole
group. A tile of ``BLOCK_N`` positions may span several blocks: each position finds its slot
through the table. With ``num_splits`` > 1 (flash-decoding) the positions are split into
contiguous ranges whose partial softmax states are combined by a second kernel, so that few
sequences still fill the GPU. The number of splits depends only on the batch size, never on the
context lengths, so a CUDA graph captured for a batch size stays valid for any lengths.

An FP8 pool (``kv_quant``) is read as it is stored, one byte an element, with a kernel of its own
(:func:`_fp8_scores_kernel`) and tile shape (:data:`FP8_CONFIG`).

**Scores from the FP8 tile.** A tile of FP8 bytes holds twice the positions of a bf16 tile, so the
per-position work (widening, dot products, softmax) is twice as much per byte, and widening K and V
to float16 before 16-bit dot products held the first FP8 kernel to 2.0-2.2 TB/s on an H100 where
bf16 reads 2.8-2.9 (``benchmarks/gpu/fp8_mma_forms.py`` times the forms; the layout was ruled out
by ``fp8 --sections layout``). The FP8 kernel therefore

* takes the scores from the K tile as stored, with e4m3 tensor-core dot products
  (:func:`fp8_scores_supported`: compute capability 8.9 or newer and a head dimension a multiple
  of 32, else the pool is widened in :func:`_decode_kernel`);
* holds ``q`` as two e4m3 terms, ``hi + lo``, each scaled per head to e4m3's range: about 8
  significant bits, against 4 for one term, whose rounding would add as much error to the scores
  as K's own storage does;
* turns the dot around, positions as its rows (M = ``block_n``) and heads as its
  columns, the two terms of head g in columns 2g and 2g + 1. The MMA result keeps adjacent columns
  in one thread, so adding the terms is a split in registers, and the softmax runs over the
  group padded to 8 columns, not 16;
* widens V (``cvt`` e4m3x2 to f16x2; every e4m3 value is exact in float16) for ``V^T P^T``, with
  each head's probabilities in both of its columns (the MMA's N must be 16);
* applies ``k_scale`` with the softmax scale and ``q``'s per-head scales once a tile of scores,
  and ``v_scale`` once at the end: no per-element scale.

Where e4m3 dot products are missing, :func:`_decode_kernel` widens a whole FP8 tile at a time to
float16 in registers, ``q`` times the softmax scale rounded to float16 once per program. It widens
V before the dot, in the layout it was loaded in (``tl.trans(tl.trans(v).to(...))``): left to
itself Triton moves the cast after the shared-memory read of the dot operand, and a transposed
8-bit operand is then read one byte per load.

Both kernels can read the block table one tile ahead (``DecodeConfig.table_ahead``), which was
measured to hurt the widened kernel on an H100. The K tile's addresses then come from the previous
iteration, not from a load in this one, so Triton's pipeliner keeps more than one tile in flight:
compiled for sm_90, the scores kernel in three stages waits for all but one copy (``async_wait``
1, where it waits for all without), at 162 registers instead of 127, since V's register loads are
pipelined too (``benchmarks/gpu/kernel_asm.py``). ``fp8 --sections kernel`` times it beside the
default; it ships off until a GPU has shown it faster.

``benchmarks/gpu/fp8.py`` measures both against the bytes they read, and times the other shapes
of :class:`DecodeConfig` on the same data. The 16-bit path is the kernel that was measured at 1.08x
of its roofline (64 x 8k, H200); it reads its table in the loop. With float32 queries (the CPU
tests' interpreter) an FP8 pool is widened to float32 in :func:`_decode_kernel`: exact.

Importing this module needs Triton (it is guarded by the caller); running it needs a GPU, or
``TRITON_INTERPRET=1`` set before the import (the CPU tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "DEFAULT_CONFIG", "FP8_CONFIG", "WIDENED_FP8_CONFIG", "DecodeConfig", "config_for", "fp8_scores_supported",
    "paged_decode_attention",
]

_LOG2E = 1.4426950408889634


class DecodeConfig:
    """Tile shape of the decode kernel: positions per tile, warps, pipeline depth, and whether the
    block table is read one tile ahead (module docstring)."""

    __slots__ = ("block_n", "num_warps", "num_stages", "table_ahead")

    def __init__(self, block_n: int = 64, num_warps: int = 4, num_stages: int = 3, table_ahead: bool = False) -> None:
        self.block_n, self.num_warps, self.num_stages, self.table_ahead = block_n, num_warps, num_stages, table_ahead

    def __repr__(self) -> str:
        return (f"DecodeConfig(block_n={self.block_n}, num_warps={self.num_warps}, num_stages={self.num_stages}, "
                f"table_ahead={self.table_ahead})")


DEFAULT_CONFIG = DecodeConfig()  # 16-bit pools
# FP8 pools (scores from the FP8 tile): 64-position tiles read the most bytes a second (an H200 and
# H100s, one layer of 64 x 8k and 256 x 2k: benchmarks/gpu/fp8_mma_forms.py). Three stages: 3% ahead
# of two on two H100s with the calls queued (0.397 against 0.411 ms at 64 x 8k, 0.404 against 0.416
# at 256 x 2k); the H200 run that chose two timed each call alone, on an earlier kernel, and had
# the two within 2%.
FP8_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=3, table_ahead=False)
# An FP8 pool widened for 16-bit dot products (no e4m3 dot products): 128-position tiles carry a
# 64-position bf16 tile's bytes. Reading the block table a tile ahead was predicted to help and
# measured to hurt (H100, one layer of 64 x 8k: 1.86 TB/s with it, 2.04 without).
WIDENED_FP8_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=3, table_ahead=False)


@functools.lru_cache(maxsize=None)
def fp8_scores_supported(device: torch.device) -> bool:
    """Whether the scores of an FP8 pool come straight from its FP8 tiles on ``device``: e4m3
    tensor-core dot products need compute capability 8.9 or newer (Ada, Hopper); Triton's CPU
    interpreter runs them too. Elsewhere the pool is widened before 16-bit dot products."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def config_for(pool_dtype: torch.dtype) -> DecodeConfig:
    """The kernel shape for pools of ``pool_dtype``: :data:`FP8_CONFIG` for float8_e4m3fn, else
    :data:`DEFAULT_CONFIG`."""
    return FP8_CONFIG if pool_dtype == torch.float8_e4m3fn else DEFAULT_CONFIG


@triton.jit
def _split_range(seq_lens, seq, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions ``[start, end)`` of sequence ``seq`` that split ``split`` reads: contiguous ranges of
    whole tiles (the last may be empty; its partial state then weighs nothing in the combine)."""
    seq_len = tl.load(seq_lens + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def _block_ids(table, offs_n, valid, TOKENS_PER_BLOCK: tl.constexpr):
    """Block ids of positions ``offs_n`` (masked by ``valid``: 0) from one sequence's block table.
    The positions are taken as unsigned: a split's start is not known to be non-negative, and signed
    ``//`` and ``%`` by the block size compile to a shift with sign fix-ups (11 ``shr.s32`` and 8
    ``sub.s32`` more in the FP8 kernel's loop), where unsigned ones are a shift and a mask."""
    return tl.load(table + offs_n.to(tl.uint32) // TOKENS_PER_BLOCK, mask=valid, other=0)


@triton.jit
def _slots_in(block, offs_n, TOKENS_PER_BLOCK: tl.constexpr):
    """Pool slots of positions ``offs_n`` in their blocks ``block`` (:func:`_block_ids`)."""
    return block.to(tl.int64) * TOKENS_PER_BLOCK + (offs_n.to(tl.uint32) % TOKENS_PER_BLOCK).to(tl.int64)


@triton.jit
def _decode_kernel(
    Q, K, V, Out, Acc, ML,
    rows, tables, seq_lens,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    q_scale, score_scale_log2, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, TABLE_AHEAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens, seq, split, NUM_SPLITS, BLOCK_N)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g  # (GP,) query heads of this KV head
    row = tl.load(rows + seq)
    q_ptrs = Q + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_g[:, None] < GROUP, other=0.0)  # (GP, D)
    if FP8 and not IEEE:
        # The dot products of an FP8 pool run in float16 (module docstring): q times the softmax
        # scale, rounded once; the scores then carry only k_scale * log2(e).
        q = (q.to(tl.float32) * q_scale).to(tl.float16)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = tables + seq * stride_tb
    if TABLE_AHEAD:  # the first tile's block ids, before the loop (module docstring)
        first = start + tl.arange(0, BLOCK_N)
        block_ahead = tl.load(table + first // TOKENS_PER_BLOCK, mask=first < end, other=0)
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,) positions
        valid = offs_n < end
        if TABLE_AHEAD:
            block = block_ahead
            ahead = offs_n + BLOCK_N
            block_ahead = tl.load(table + ahead // TOKENS_PER_BLOCK, mask=ahead < end, other=0)
        else:
            block = tl.load(table + offs_n // TOKENS_PER_BLOCK, mask=valid, other=0)
        slot = block.to(tl.int64) * TOKENS_PER_BLOCK + offs_n % TOKENS_PER_BLOCK  # (BN,)
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=valid[:, None], other=0.0).to(q.dtype)  # (BN, D); an FP8 tile widened
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * score_scale_log2, float("-inf"))  # (GP, BN), log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # (BN, D)
        if FP8:
            # Widened in registers, in the loaded layout: the double transpose keeps Triton from
            # moving the cast after the dot operand's shared-memory read (module docstring).
            v = tl.trans(tl.trans(v).to(q.dtype))
        else:
            v = v.to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    # An FP8 pool's V scale (1.0 otherwise); the combine is linear in acc.
    _write_state(acc * v_scale, m, l, Out, Acc, ML, row, seq, split, head, offs_g < GROUP, offs_d,
                 stride_ot, stride_oh, HEAD_DIM, NUM_SPLITS, NUM_Q_HEADS)


@triton.jit
def _write_state(acc, m, l, Out, Acc, ML, row, seq, split, head, head_ok, offs_d,
                 stride_ot, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_Q_HEADS: tl.constexpr):
    """One split's result for the query heads ``head`` (rows of ``acc``): the output itself with
    one split, else the partial state (unnormalised acc, running max m and sum l, log2 units)
    that :func:`_combine_kernel` merges."""
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        o_ptrs = Out + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=head_ok[:, None])
    else:
        base = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + split  # (GP,)
        tl.store(Acc + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])
        tl.store(ML + base * 2, m, mask=head_ok)
        tl.store(ML + base * 2 + 1, l, mask=head_ok)


@triton.jit
def _fp8_scores_kernel(
    Q, K, V, Out, Acc, ML,
    rows, tables, seq_lens,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    score_scale_log2, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, TABLE_AHEAD: tl.constexpr,
):
    """The FP8 pool's decode with the scores taken from the FP8 K tile as stored (module
    docstring, "Scores from the FP8 tile"); grid and results as :func:`_decode_kernel`'s."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens, seq, split, NUM_SPLITS, BLOCK_N)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g
    row = tl.load(rows + seq)
    # q as two e4m3 terms, hi + lo, each scaled per head to e4m3's range: ~8 significant bits
    # (one term alone has 4, and its rounding would add as much error as K's own). Row r of the
    # dot's operand is term r % 2 of head r // 2: each head is loaded twice, and neither term is
    # moved between rows (8-bit permutes), so the operand is built in place.
    offs_r = tl.arange(0, 2 * GROUP_PAD)
    is_lo = offs_r % 2 == 1
    q2 = tl.load(Q + row * stride_qt + (kv_head * GROUP + offs_r // 2)[:, None] * stride_qh + offs_d[None, :],
                 mask=(offs_r // 2)[:, None] < GROUP, other=0.0).to(tl.float32)  # (2GP, D)
    s_hi = tl.maximum(tl.max(tl.abs(q2), axis=1), 1e-30) / 448.0
    rest = q2 - (q2 / s_hi[:, None]).to(tl.float8e4nv).to(tl.float32) * s_hi[:, None]
    s_lo = tl.maximum(tl.max(tl.abs(rest), axis=1), 1e-30) / 448.0
    qt = tl.trans(tl.where(is_lo[:, None], rest / s_lo[:, None], q2 / s_hi[:, None]).to(tl.float8e4nv))  # (D, 2GP)
    col_scale = tl.where(is_lo, s_lo, s_hi) * score_scale_log2  # (2GP,)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    # The softmax's sum per position, summed over positions once at the end: positions are the
    # dot's rows, spread over the warps, so a sum over them is a reduction across warps (shared
    # memory and a barrier); kept per position, a tile pays for one such reduction (the maximum).
    l_rows = tl.zeros([BLOCK_N, GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM, 2 * GROUP_PAD], dtype=tl.float32)  # (D, 2GP): each head twice
    table = tables + seq * stride_tb
    if TABLE_AHEAD:  # the first tile's block ids, before the loop (module docstring)
        first = start + tl.arange(0, BLOCK_N)
        block_ahead = _block_ids(table, first, first < end, TOKENS_PER_BLOCK)
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,) positions
        valid = offs_n < end
        if TABLE_AHEAD:
            block = block_ahead
            ahead = offs_n + BLOCK_N
            block_ahead = _block_ids(table, ahead, ahead < end, TOKENS_PER_BLOCK)
        else:
            block = _block_ids(table, offs_n, valid, TOKENS_PER_BLOCK)
        slot = _slots_in(block, offs_n, TOKENS_PER_BLOCK)  # (BN,)
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # (BN, D) float8, as stored
        # Positions are the dot's rows (M = BN), heads its columns: the two terms of each head are
        # adjacent columns, which the MMA's result layout keeps in one thread, so the split is free.
        hi, lo = tl.split(tl.reshape(tl.dot(k, qt) * col_scale[None, :], (BLOCK_N, GROUP_PAD, 2)))
        st = tl.where(valid[:, None], hi + lo, float("-inf"))  # (BN, GP), log2 units
        m_new = tl.maximum(m, tl.max(st, axis=0))
        alpha = tl.exp2(m - m_new)
        pt = tl.exp2(st - m_new[None, :])
        l_rows = l_rows * alpha[None, :] + pt
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # (BN, D)
        vt = tl.trans(v.to(tl.float16))  # (D, BN); every e4m3 value is exact in float16
        p2 = tl.reshape(tl.join(pt, pt), (BLOCK_N, 2 * GROUP_PAD)).to(tl.float16)
        alpha2 = tl.reshape(tl.join(alpha, alpha), (2 * GROUP_PAD,))
        acc = acc * alpha2[None, :] + tl.dot(vt, p2)
        m = m_new

    acc, _ = tl.split(tl.reshape(acc, (HEAD_DIM, GROUP_PAD, 2)))  # (D, GP): one copy of each head
    l = tl.sum(l_rows, axis=0)
    _write_state(tl.trans(acc) * v_scale, m, l, Out, Acc, ML, row, seq, split, head, offs_g < GROUP, offs_d,
                 stride_ot, stride_oh, HEAD_DIM, NUM_SPLITS, NUM_Q_HEADS)


@triton.jit
def _combine_kernel(
    Out, Acc, ML, rows,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + offs_s  # (S,)
    m = tl.load(ML + base * 2)
    l = tl.load(ML + base * 2 + 1)
    m_max = tl.max(m, axis=0)  # split 0 always holds a position, so this is finite
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    acc = tl.load(Acc + base[:, None] * HEAD_DIM + offs_d[None, :])  # (S, D)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    row = tl.load(rows + seq)
    tl.store(Out + row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    num_splits: int = 1,
    config: DecodeConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``out[rows[b]]`` = attention of query ``q[rows[b]]`` over positions
    ``[0, seq_lens[b])`` of sequence ``b``, read through ``tables[b]`` from the flat pools.

    q, out: (T, Hq, D); k_pool, v_pool: (num_slots, Hkv, D) with unit stride on D, in q's dtype or
    float8_e4m3fn (read as ``k * k_scale``, ``v * v_scale``); rows: (B,) int64; tables: (B, W)
    int32; seq_lens: (B,) int32, each >= 1. ``num_splits`` a power of two. ``config``: the kernel
    shape (default: :func:`config_for` the pool's dtype; :data:`WIDENED_FP8_CONFIG` for an FP8 pool widened).
    No host synchronisation: safe to capture in a CUDA graph.
    """
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    ieee = q.dtype == torch.float32
    fp8 = k_pool.dtype == torch.float8_e4m3fn
    # e4m3 dot products take 32 elements of the head dimension at a time (the interpreter any)
    scores8 = fp8 and not ieee and fp8_scores_supported(q.device) and (head_dim % 32 == 0 or q.device.type != "cuda")
    config = config or (WIDENED_FP8_CONFIG if fp8 and not scores8 else config_for(k_pool.dtype))
    if num_splits > 1:
        acc = torch.empty((num_seqs * num_q_heads * num_splits, head_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((num_seqs * num_q_heads * num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    grid = (num_seqs, num_kv_heads, num_splits)
    tensors = (q, k_pool, v_pool, out, acc, ml, rows, tables, seq_lens,
               q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
               out.stride(0), out.stride(1), tables.stride(0))
    shape = dict(GROUP=group, HEAD_DIM=head_dim, TOKENS_PER_BLOCK=tokens_per_block, BLOCK_N=config.block_n,
                 NUM_SPLITS=num_splits, NUM_Q_HEADS=num_q_heads, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    if scores8:
        _fp8_scores_kernel[grid](*tensors, scale * k_scale * _LOG2E, v_scale,
                                 GROUP_PAD=max(8, triton.next_power_of_2(group)), TABLE_AHEAD=config.table_ahead,
                                 **shape)
    else:
        if fp8 and not ieee:  # the softmax scale goes into q, the scores carry k_scale (kernel)
            q_scale, score_scale = scale, k_scale * _LOG2E
        else:
            q_scale, score_scale = 1.0, scale * k_scale * _LOG2E
        _decode_kernel[grid](*tensors, q_scale, score_scale, v_scale,
                             GROUP_PAD=max(16, triton.next_power_of_2(group)), IEEE=ieee, FP8=fp8,
                             TABLE_AHEAD=config.table_ahead, **shape)
    if num_splits > 1:
        _combine_kernel[(num_seqs, num_q_heads)](
            out, acc, ml, rows,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, NUM_Q_HEADS=num_q_heads,
            num_warps=4,
        )
