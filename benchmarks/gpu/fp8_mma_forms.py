"""Which tensor-core form makes the FP8 paged decode kernel fast? An experiment over one layer.

The FP8 decode kernel (``triton_paged_decode``) widens every K and V element to float16 before
its dot products and reads 2.0-2.2 TB/s of FP8 bytes on an H100 against bf16's 2.7-3.0: with the
same bytes a tile, it does twice the per-element work (two conversions, twice the positions for
the dot products and the softmax). Its layout was ruled out (``fp8 --sections layout``). This
script times, over the same pools as ``fp8 --sections kernel`` (32 query heads, 8 KV heads of
128, blocks of 32 in a random order, 64 x 8k and 256 x 2k), kernels that differ only in how the
scores and the output are formed:

* ``shipped``: ``triton_paged_decode`` itself (one split), for reference;
* ``widen``: the shipped form: ``q (G, D) @ k^T`` and ``p @ v`` over K and V widened to float16
  (the group G = 4 padded to 16 rows);
* ``qk8``: the scores straight from the FP8 tile: ``q`` quantized to e4m3 per row (its own scale,
  applied to the scores with ``k_scale``), no conversion of K; V widened as before;
* ``qk8_pv8``: as ``qk8``, and ``p`` (in [0, 1], times 448) times the FP8 V tile: no conversion at all;
* ``t_widen``: transposed, so positions are the dot's M dimension (128 rows, the group is N = 16):
  ``k @ q^T`` and ``v^T @ p^T``, over widened K and V (Hopper's warpgroup MMA needs M a multiple of 64);
* ``t_qk8``: transposed, the scores from the FP8 K tile and an e4m3 ``q``; V widened;
* ``t_qk8x2``: as ``t_qk8`` with ``q`` as two e4m3 terms (hi + lo, ~8 significant bits), two dots;
* ``t_qk8s``: the two terms as interleaved columns of one dot, split in registers: the softmax over
  8 columns (the group of 4 padded to 8) instead of 16; built with an 8-bit join and permute of
  the two terms (wrong results on an H100 with Triton 3.6, 0.72 max error: kept as a finding);
* ``t_qk8r``: as ``t_qk8s``, with the operand's rows built in place (row r: term r % 2 of head r // 2,
  each head loaded twice), no 8-bit permute; the probabilities joined to 16 columns for ``V^T P^T``;
* ``t_qk8r16``: as ``t_qk8r`` with the group padded to 16 (32 columns): no join of the probabilities;
* ``t_qk8r_split``: as ``t_qk8r`` with a loop start the compiler cannot know (0 at run time), as the
  shipped kernel's split has; ``t_qk8r_split_u``: the same with the positions as unsigned. If the
  first is as slow as ``shipped`` and the second as fast as ``t_qk8r``, the signed divisions of a
  position by the block size are the shipped kernel's gap (``docs/gpu.md``);
* ceilings, not attention (their error is meaningless): ``t_qk8r_vbytes`` is ``t_qk8r_split_u``
  with V's bytes loaded as 32-bit words and folded by XOR instead of widened and multiplied, the
  time the kernel would take if ``V^T P^T`` cost nothing; ``t_qk8r_nov`` reads no V at all (the K
  half's own time, its TB/s still counted over K and V). Together they say whether the per-position
  work left is V's side (widening, the layout change of ``V^T``, the second dot) or the scores';
* ``t_qk8r_lazyl``: ``t_qk8r_split_u`` with the softmax's sum kept per position (a ``(BN, 8)``
  tile rescaled like ``acc``) and summed once at the end: positions are the dot's rows, spread
  over the warps, so a sum over them per tile is a reduction across warps through shared memory
  and a barrier; this leaves one (the maximum) a tile instead of two.

Each form is checked against float32 attention over the dequantized pools (max abs error of the
output; the quantized ``q`` forms add e4m3's rounding of q). A form that does not compile is
reported with its error. One run, ~1 min::

    python -m benchmarks.gpu.fp8_mma_forms --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch
import triton
import triton.language as tl

from benchmarks.gpu.common import time_queued_ms
from benchmarks.gpu.interpreter import fix_numpy_2_4

logger = logging.getLogger("fp8_mma_forms")

_LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: a jitted function reads no other globals
FORMS = ("widen", "qk8", "qk8_pv8", "t_widen", "t_qk8", "t_qk8x2", "t_qk8s", "t_qk8r", "t_qk8r16", "t_qk8r_split",
         "t_qk8r_split_u", "t_qk8r_vbytes", "t_qk8r_nov", "t_qk8r_lazyl")


@triton.jit
def _forms_kernel(
    Q, K, V, Out, tables, seq_lens,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    sm_scale, k_scale, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TPB: tl.constexpr,
    BLOCK_N: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr, TRANSPOSED: tl.constexpr, FP8_POOL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g
    q = tl.load(Q + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0).to(tl.float32)  # (GP, D)
    if QK8:
        q_amax = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30)
        q_s = q_amax / 448.0
        qq = (q / q_s[:, None]).to(tl.float8e4nv)
        row_scale = q_s * (sm_scale * k_scale * _LOG2E)  # (GP,)
    elif FP8_POOL:  # widened to float16 (every e4m3 value is exact there)
        qq = (q * sm_scale).to(tl.float16)
        row_scale = tl.full([GROUP_PAD], k_scale * _LOG2E, tl.float32)
    else:  # a bf16 pool: no conversion
        qq = (q * sm_scale).to(tl.bfloat16)
        row_scale = tl.full([GROUP_PAD], k_scale * _LOG2E, tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if TRANSPOSED:
        acc = tl.zeros([HEAD_DIM, GROUP_PAD], dtype=tl.float32)
        qt = tl.trans(qq)  # (D, GP)
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = tables + seq * stride_tb
    for n0 in tl.range(0, seq_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < seq_len
        block = tl.load(table + offs_n // TPB, mask=valid, other=0)
        slot = block.to(tl.int64) * TPB + offs_n % TPB
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        if TRANSPOSED:
            if QK8:
                st = tl.dot(k, qt)  # (BN, GP)
            else:
                st = tl.dot(k.to(qq.dtype), qt)
            st = tl.where(valid[:, None], st * row_scale[None, :], float("-inf"))
            m_new = tl.maximum(m, tl.max(st, axis=0))
            alpha = tl.exp2(m - m_new)
            pt = tl.exp2(st - m_new[None, :])  # (BN, GP)
            l = l * alpha + tl.sum(pt, axis=0)
            if FP8_POOL:
                vt = tl.trans(v.to(tl.float16))  # (D, BN)
            else:
                vt = tl.trans(v)
            acc = acc * alpha[None, :] + tl.dot(vt, pt.to(vt.dtype))
        else:
            if QK8:
                s = tl.dot(qq, tl.trans(k))
            else:
                s = tl.dot(qq, tl.trans(k.to(qq.dtype)))
            s = tl.where(valid[None, :], s * row_scale[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if PV8:
                acc = acc * alpha[:, None] + tl.dot((p * 448.0).to(tl.float8e4nv), v)
            else:
                if FP8_POOL:  # widened in the loaded layout (triton_paged_decode's docstring)
                    v16 = tl.trans(tl.trans(v).to(tl.float16))
                else:
                    v16 = v
                acc = acc * alpha[:, None] + tl.dot(p.to(v16.dtype), v16)
        m = m_new
    out_scale = v_scale
    if PV8:
        out_scale = v_scale / 448.0
    if TRANSPOSED:
        out = acc * out_scale / l[None, :]  # (D, GP)
        o_ptrs = Out + seq * stride_ot + head[None, :] * stride_oh + offs_d[:, None]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_g[None, :] < GROUP)
    else:
        out = acc * out_scale / l[:, None]
        o_ptrs = Out + seq * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_g[:, None] < GROUP)


@triton.jit
def _split_q_kernel(
    Q, K, V, Out, tables, seq_lens,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    sm_scale, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TPB: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
    ROWS: tl.constexpr, GP: tl.constexpr, SPLIT_START: tl.constexpr, UNSIGNED: tl.constexpr,
    V_WORK: tl.constexpr = 0, LAZY_L: tl.constexpr = False,
):
    """Transposed, the scores straight from the FP8 K tile, ``q`` as two e4m3 terms (hi + lo, each
    with its own per-row scale: about 8 significant bits). ``PACKED``: hi and lo are interleaved
    columns of one dot (column 2h, 2h + 1), split apart in registers, so the softmax runs over 8
    columns instead of 16; else two dots over 16 columns each. ``V_WORK``: 0 attention; 1 V's bytes
    folded by XOR (no widening, no second dot); 2 no V (the ceilings in the module docstring)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, GP)
    head = kv_head * GROUP + offs_g
    q = tl.load(Q + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0).to(tl.float32)  # (G8 or 16, D)
    s_hi = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / 448.0
    q_hi = (q / s_hi[:, None]).to(tl.float8e4nv)
    rest = q - q_hi.to(tl.float32) * s_hi[:, None]
    s_lo = tl.maximum(tl.max(tl.abs(rest), axis=1), 1e-30) / 448.0
    q_lo = (rest / s_lo[:, None]).to(tl.float8e4nv)
    c = sm_scale * k_scale * _LOG2E
    s_hi = s_hi * c
    s_lo = s_lo * c
    if ROWS:  # row r of the operand is term r % 2 of head r // 2, built in place (each head loaded twice)
        offs_r = tl.arange(0, 2 * GP)
        is_lo = offs_r % 2 == 1
        q2 = tl.load(Q + seq * stride_qt + (kv_head * GROUP + offs_r // 2)[:, None] * stride_qh + offs_d[None, :],
                     mask=(offs_r // 2)[:, None] < GROUP, other=0.0).to(tl.float32)
        r_hi = tl.maximum(tl.max(tl.abs(q2), axis=1), 1e-30) / 448.0
        rest2 = q2 - (q2 / r_hi[:, None]).to(tl.float8e4nv).to(tl.float32) * r_hi[:, None]
        r_lo = tl.maximum(tl.max(tl.abs(rest2), axis=1), 1e-30) / 448.0
        qt = tl.trans(tl.where(is_lo[:, None], rest2 / r_lo[:, None], q2 / r_hi[:, None]).to(tl.float8e4nv))
        col_scale = tl.where(is_lo, r_lo, r_hi) * c
        m = tl.full([GP], float("-inf"), dtype=tl.float32)
        l = tl.zeros([GP], dtype=tl.float32)
        if PACKED:
            acc = tl.zeros([HEAD_DIM, 2 * GP], dtype=tl.float32)
        else:
            acc = tl.zeros([HEAD_DIM, GP], dtype=tl.float32)
    elif PACKED:
        qq = tl.reshape(tl.permute(tl.join(q_hi, q_lo), (0, 2, 1)), (16, HEAD_DIM))  # row 2h + j
        qt = tl.trans(qq)  # (D, 16)
        m = tl.full([8], float("-inf"), dtype=tl.float32)
        l = tl.zeros([8], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM, 16], dtype=tl.float32)
    else:
        qt_hi = tl.trans(q_hi)
        qt_lo = tl.trans(q_lo)
        m = tl.full([16], float("-inf"), dtype=tl.float32)
        l = tl.zeros([16], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM, 16], dtype=tl.float32)
    offs_w = tl.arange(0, HEAD_DIM // 4)
    l_rows = tl.zeros([BLOCK_N, GP], dtype=tl.float32)  # LAZY_L: the sum per position, reduced at the end
    v_fold = tl.zeros([HEAD_DIM // 4], dtype=tl.int32)
    table = tables + seq * stride_tb
    start = 0
    if SPLIT_START:  # a start the compiler cannot know (the shipped kernel's split): 0 at run time
        start = tl.program_id(2) * tl.cdiv(seq_len, BLOCK_N) * BLOCK_N
    for n0 in tl.range(start, seq_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < seq_len
        if UNSIGNED:  # positions as unsigned: block and offset are a shift and a mask
            pos = offs_n.to(tl.uint32)
            block = tl.load(table + pos // TPB, mask=valid, other=0)
            slot = block.to(tl.int64) * TPB + (pos % TPB).to(tl.int64)
        else:
            block = tl.load(table + offs_n // TPB, mask=valid, other=0)
            slot = block.to(tl.int64) * TPB + offs_n % TPB
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        if V_WORK == 0:
            v = tl.load(V + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=valid[:, None],
                        other=0.0)
        elif V_WORK == 1:  # the same bytes as 32-bit words (4 elements each), folded, never widened
            words = tl.load(V.to(tl.pointer_type(tl.int32)) + slot[:, None] * (stride_ks // 4)
                            + kv_head * (stride_kh // 4) + offs_w[None, :], mask=valid[:, None], other=0)
            v_fold = v_fold ^ tl.xor_sum(words, axis=0)
        if ROWS:
            hi, lo = tl.split(tl.reshape(tl.dot(k, qt) * col_scale[None, :], (BLOCK_N, GP, 2)))
            st = hi + lo
        elif PACKED:
            hi, lo = tl.split(tl.reshape(tl.dot(k, qt), (BLOCK_N, 8, 2)))
            st = hi * s_hi[None, :] + lo * s_lo[None, :]  # (BN, 8)
        else:
            st = tl.dot(k, qt_hi) * s_hi[None, :] + tl.dot(k, qt_lo) * s_lo[None, :]  # (BN, 16)
        st = tl.where(valid[:, None], st, float("-inf"))
        m_new = tl.maximum(m, tl.max(st, axis=0))
        alpha = tl.exp2(m - m_new)
        pt = tl.exp2(st - m_new[None, :])
        if LAZY_L:
            l_rows = l_rows * alpha[None, :] + pt
        else:
            l = l * alpha + tl.sum(pt, axis=0)
        if V_WORK != 0:  # a ceiling: acc only rescaled, no V^T P^T
            acc = acc * tl.reshape(tl.join(alpha, alpha), (2 * GP,))[None, :]
        elif PACKED:
            vt = tl.trans(v.to(tl.float16))  # (D, BN)
            p16 = tl.reshape(tl.join(pt, pt), (BLOCK_N, 2 * GP)).to(tl.float16)
            a16 = tl.reshape(tl.join(alpha, alpha), (2 * GP,))
            acc = acc * a16[None, :] + tl.dot(vt, p16)
        else:
            vt = tl.trans(v.to(tl.float16))  # (D, BN)
            acc = acc * alpha[None, :] + tl.dot(vt, pt.to(tl.float16))
        m = m_new
    if LAZY_L:
        l = tl.sum(l_rows, axis=0)
    if PACKED:
        acc, _ = tl.split(tl.reshape(acc, (HEAD_DIM, GP, 2)))
    out = acc * v_scale / l[None, :]
    if V_WORK == 1:  # keeps V's loads: a fold that is never exactly -1 at run time adds nothing
        out += tl.sum(tl.where(v_fold == -1, 1.0, 0.0), axis=0)
    o_ptrs = Out + seq * stride_ot + head[None, :] * stride_oh + offs_d[:, None]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_g[None, :] < GROUP)


# The forms _split_q_kernel runs, each as its constexpr flags (what each form is: the module docstring).
_ROWS = dict(PACKED=True, ROWS=True, GP=8, SPLIT_START=False, UNSIGNED=False)
_SPLIT_U = {**_ROWS, "SPLIT_START": True, "UNSIGNED": True}
_SPLIT_Q_FORMS = {
    "t_qk8x2": {**_ROWS, "PACKED": False, "ROWS": False, "GP": 16},
    "t_qk8s": {**_ROWS, "ROWS": False},
    "t_qk8r": _ROWS,
    "t_qk8r16": {**_ROWS, "PACKED": False, "GP": 16},
    "t_qk8r_split": {**_ROWS, "SPLIT_START": True},
    "t_qk8r_split_u": _SPLIT_U,
    "t_qk8r_vbytes": {**_SPLIT_U, "V_WORK": 1},
    "t_qk8r_nov": {**_SPLIT_U, "V_WORK": 2},
    "t_qk8r_lazyl": {**_SPLIT_U, "LAZY_L": True},
}


def run_form(form: str, q, k, v, out, tables, seq_lens, tpb: int, k_scale: float, v_scale: float,
             block_n: int, num_warps: int, num_stages: int) -> None:
    batch, hq, d = q.shape
    if form == "shipped":  # the kernel as it ships, in the given tile shape (one split)
        from tensorrt_llm._torch.attention_backend.triton_paged_decode import DecodeConfig, paged_decode_attention
        rows = torch.arange(batch, device=q.device)
        paged_decode_attention(q, k, v, out, rows, tables, seq_lens, tokens_per_block=tpb, scale=d ** -0.5,
                               config=DecodeConfig(block_n, num_warps, num_stages), k_scale=k_scale, v_scale=v_scale)
        return
    hkv = k.shape[1]
    if form in _SPLIT_Q_FORMS:
        _split_q_kernel[(batch, hkv)](
            q, k, v, out, tables, seq_lens,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), tables.stride(0),
            d ** -0.5, k_scale, v_scale,
            GROUP=hq // hkv, HEAD_DIM=d, TPB=tpb, BLOCK_N=block_n, **_SPLIT_Q_FORMS[form],
            num_warps=num_warps, num_stages=num_stages,
        )
        return
    group = hq // hkv
    _forms_kernel[(batch, hkv)](
        q, k, v, out, tables, seq_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        d ** -0.5, k_scale, v_scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, TPB=tpb, BLOCK_N=block_n,
        QK8=form in ("qk8", "qk8_pv8", "t_qk8"), PV8=form == "qk8_pv8", TRANSPOSED=form.startswith("t_"),
        FP8_POOL=k.dtype == torch.float8_e4m3fn,
        num_warps=num_warps, num_stages=num_stages,
    )


def reference(q, k, v, tables, seq_lens, tpb, k_scale, v_scale, seqs) -> torch.Tensor:
    """float32 attention of sequences ``seqs`` over the dequantized pools."""
    outs = []
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    for b in seqs:
        n = int(seq_lens[b])
        slots = (tables[b].long()[:, None] * tpb + torch.arange(tpb, device=q.device)).reshape(-1)[:n]
        kk = (k[slots].float() * k_scale).repeat_interleave(group, dim=1)  # (n, hq, d)
        vv = (v[slots].float() * v_scale).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * d ** -0.5
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1, to check the script")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--shapes", default="64x8192,256x2048")
    parser.add_argument("--tiles", default="128:4:3,64:4:3,128:8:3,256:8:2", help="block_n:warps:stages, tried per form")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs the forms under Triton's interpreter: set TRITON_INTERPRET=1")
        fix_numpy_2_4()
    # The interpreter has no bfloat16 arithmetic (numpy's dot of the raw bits is garbage), so the
    # check runs the 16-bit cases in float16; and it times nothing worth repeating.
    wide = "bfloat16" if device.type == "cuda" else "float16"
    repeats = dict(warmup=3, repeats=7) if device.type == "cuda" else dict(calls=1, warmup=0, repeats=1)
    hq, hkv, d, tpb = 32, 8, 128, 32
    k_scale, v_scale = 0.5, 0.5
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "triton": triton.__version__, "cases": {}}
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        blocks = batch * context // tpb
        torch.manual_seed(0)
        tables = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=getattr(torch, wide))
        out = torch.empty_like(q)
        runs = []
        for kv in (wide, "fp8"):
            dtype = q.dtype if kv == wide else torch.float8_e4m3fn
            k = (torch.randn(blocks * tpb, hkv, d, device=device) * 2).to(dtype)
            v = (torch.randn(blocks * tpb, hkv, d, device=device) * 2).to(dtype)
            nbytes = 2 * k.numel() * k.element_size()
            ref = reference(q, k, v, tables, seq_lens, tpb, k_scale, v_scale, [0, batch - 1])
            forms = ["shipped", "widen", "t_widen"] if kv == wide else ["shipped"] + args.forms.split(",")
            for form in forms:
                for tile in args.tiles.split(","):
                    block_n, warps, stages = map(int, tile.split(":"))
                    entry = {"kv": kv, "form": form, "block_n": block_n, "warps": warps, "stages": stages}

                    def call(form=form, block_n=block_n, warps=warps, stages=stages):
                        run_form(form, q, k, v, out, tables, seq_lens, tpb, k_scale, v_scale, block_n, warps, stages)
                    try:
                        out.fill_(float("nan"))
                        call()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        err = (out[[0, batch - 1]].float() - ref).abs().max().item()
                        timed = time_queued_ms(call, device, **repeats)  # launches hidden
                    except Exception as error:  # noqa: BLE001 (a form or tile that does not compile)
                        entry["error"] = f"{type(error).__name__}: {str(error)[-600:]}"
                        logger.info("%s %-8s %-8s %s: %s", shape, kv, form, tile, entry["error"][-300:])
                        runs.append(entry)
                        continue
                    entry.update(ms=timed["ms"], tb_s=nbytes / (timed["ms"] * 1e-3) / 1e12, max_abs_err=err,
                                 finite=math.isfinite(err))
                    logger.info("%s %-8s %-8s %-10s %.3f ms  %.2f TB/s  err %.4f", shape, kv, form, tile, timed["ms"],
                                entry["tb_s"], err)
                    runs.append(entry)
            del k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["cases"][shape] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
