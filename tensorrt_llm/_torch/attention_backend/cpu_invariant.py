"""Batch-invariant paged attention on the CPU: a query's output bits depend on its own vector, its
position and its sequence's K/V at positions ``[0, position]``, and on nothing else.

Not on the batch (which other sequences, how they are grouped and padded), not on how its prompt
was chunked, not on whether its prefix was computed in this forward or read from the cache
(reused or not), and not on the thread count: every reduction is exact or in an order fixed by
absolute key positions (``invariant_math``). What the batch-invariant mode runs instead of
``cpu_paged``'s SDPA calls, whose kernel, blocking and masks change with the batch.

Per query ``i`` at position ``p`` and head ``h`` (keys ``j <= p`` of its sequence)::

    s_j  = (q . k_j) * scale      q and k_j each on a grid of their own: the dot product is exact
    e_j  = exp(s_j - max s)       invariant_math.exp, then rounded to the absolute grid 2**-24
    den  = sum_j e_j              exact (integers on one grid)
    num  = sum over key blocks b = 0, 1, ... (B = 16 absolute positions each) of
             sum_{j in b} e_j v_j    blocks wholly before p's block: one exact matmul, v on the
                                     block's own grid (all B keys visible, so the grid depends on
                                     visible keys only);
                                     p's own block: products in full precision, added in the
                                     order of their positions (the query sees only part of it)
           combined by a pairwise tree over block indices (``fixed_order_sum``)
    out  = num / den

    positions   0 ............ 15 | 16 ........... 31 | 32 ... p ...... 47
    block       0  (full: matmul) | 1  (full: matmul) | 2  (p's block: in order, keys > p at 0)

The plan reuses ``cpu_paged``'s layout and length groups (padding repeats a sequence's last query
row and its key at position 0; padded keys lie after every real query's position and are
masked). Queries are processed in slices that bound the float64 intermediates (a slice's
results do not depend on the slicing: every query is computed alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.cpu_paged import as_rows, forward_layout, group_by_length
from tensorrt_llm._torch.attention_backend.invariant_math import dot_bits, exp, fixed_order_sum, to_grid
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, dequantize, is_quantized
from tensorrt_llm._torch.attention_backend.paged import gather_slots, layer_scales, slot_view, write_new_tokens

__all__ = ["CpuInvariantPlan", "CpuInvariantPlanBuilder", "InvariantGroup", "InvariantLayerKV", "invariant_attention"]

#: Keys per block of the P.V product (absolute positions [b * B, (b + 1) * B)). A query's own block
#: costs it B products, the blocks before it one partial sum each: B near sqrt(keys) keeps both small.
KEY_BLOCK = 16
#: Grid bits of the softmax numerators (absolute: e_j <= 1) and of V within a block: with
#: ceil(log2 KEY_BLOCK) they fill a float64's 53 bits, so a block's P.V is exact.
PROB_BITS = 24
VALUE_BITS = 53 - PROB_BITS - (KEY_BLOCK - 1).bit_length()
#: The numerators are rounded to 2**-24: a degree-7 exp (relative error below 6e-9) is exact enough.
_EXP_DEGREE = 7
#: float64 intermediates one slice of queries may hold (bytes).
_SLICE_BYTES = 64 << 20


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (n, Q, Hq, D); k, v (n, K, Hkv, D): sequence ``s``'s keys at positions ``0 .. K-1``;
    q_pos (n, Q) int64: query ``i`` of ``s`` sits at position ``q_pos[s, i] < K`` and sees keys
    ``j <= q_pos[s, i]``. Grouped-query: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    Returns (n, Q, Hq, D) in q's dtype, each query computed as described in the module docstring."""
    n, Q, Hq, D = q.shape
    K, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    nb = -(-K // KEY_BLOCK)
    Kp = nb * KEY_BLOCK
    q_bits, k_bits = dot_bits(D)
    f64 = torch.float64
    k_ints, k_scale = to_grid(k.to(f64).transpose(1, 2), k_bits)  # (n, Hkv, K, D), (n, Hkv, K, 1)
    k_ints_t, k_scale_t = k_ints.transpose(-1, -2), k_scale.transpose(-1, -2)  # (n, Hkv, D, K), (n, Hkv, 1, K)
    v64 = torch.nn.functional.pad(v.to(f64).transpose(1, 2), (0, 0, 0, Kp - K))  # (n, Hkv, Kp, D)
    v_ints, v_scale = to_grid(v64.view(n, Hkv, nb, KEY_BLOCK, D), VALUE_BITS, dim=(-2, -1))  # per block
    key_pos = torch.arange(K)  # (K,)
    key_block = torch.arange(Kp) // KEY_BLOCK  # (Kp,)

    out = torch.empty(n, Hkv, g, Q, D, dtype=f64)
    per_query = n * Hq * (4 * Kp + 3 * D + nb * D) * 8
    step = max(1, _SLICE_BYTES // max(per_query, 1))
    for a in range(0, Q, step):
        b = min(Q, a + step)
        Qs = b - a
        # (n, Qs, Hq, D) -> (n, Hkv, g * Qs, D): query head h = kv * g + j, rows j-major
        qs = q[:, a:b].to(f64).permute(0, 2, 1, 3).reshape(n, Hkv, g * Qs, D)
        pos = q_pos[:, a:b].repeat(1, g)  # (n, g * Qs), the same row order
        q_ints, q_scale = to_grid(qs, q_bits)  # (n, Hkv, gQs, D), (n, Hkv, gQs, 1)
        scores = (q_ints @ k_ints_t) * q_scale * k_scale_t * scale  # (n, Hkv, gQs, K): exact dot, one rounding
        visible = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # (n, 1, gQs, K)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = exp(scores - scores.amax(dim=-1, keepdim=True), _EXP_DEGREE)  # (n, Hkv, gQs, K), max exact
        e = torch.round(weights.masked_fill_(~visible, 0.0) * 2.0**PROB_BITS)  # integers <= 2**24
        den = e.sum(dim=-1, keepdim=True)  # (n, Hkv, gQs, 1), exact
        e = torch.nn.functional.pad(e, (0, Kp - K))  # (n, Hkv, gQs, Kp)
        own = torch.div(pos, KEY_BLOCK, rounding_mode="floor")[:, None, :, None]  # (n, 1, gQs, 1) the query's block

        # Blocks wholly before the query's own: one exact matmul per block, v on the block's grid.
        before = key_block < own  # (n, 1, gQs, Kp)
        e_full = e.masked_fill(~before, 0.0).view(n, Hkv, g * Qs, nb, KEY_BLOCK).transpose(2, 3)  # (n,Hkv,nb,gQs,B)
        parts = (e_full @ v_ints) * v_scale  # (n, Hkv, nb, gQs, D), exact per block

        # The query's own block: exact products added in the order of their positions.
        first = (own * KEY_BLOCK).expand(n, Hkv, g * Qs, 1)  # (n, Hkv, gQs, 1) its block's first key
        mine = None
        for offset in range(KEY_BLOCK):
            index = first + offset
            v_at = v64.gather(2, index.expand(n, Hkv, g * Qs, D))  # (n, Hkv, gQs, D)
            term = e.gather(-1, index) * v_at  # exact: a 25-bit integer times v
            mine = term if mine is None else mine + term
        parts.scatter_(2, own[:, :, None].expand(n, Hkv, 1, g * Qs, D), mine[:, :, None])  # its slot held 0

        num = fixed_order_sum(parts, dim=2)  # (n, Hkv, gQs, D): blocks in order of position
        out[:, :, :, a:b] = (num / den).view(n, Hkv, g, Qs, D)
    return out.view(n, Hq, Q, D).transpose(1, 2).to(q.dtype)  # (n, Q, Hq, D)


@dataclass(frozen=True, slots=True)
class InvariantGroup:
    """Sequences attended together, padded to ``q_len`` queries and ``k_len`` keys."""

    num_seqs: int  # n
    q_len: int  # Q
    k_len: int  # K
    q_rows: torch.Tensor | slice  # (n * Q,) rows of q, padded with each sequence's last row
    out_rows: torch.Tensor | slice  # rows of the output the real queries fill
    real: torch.Tensor | None  # indices of the real queries among the n * Q; None: all real
    kv_slots: torch.Tensor  # (n * K,) pool slots of positions 0 .. K-1, padded with position 0's
    q_pos: torch.Tensor  # (n, Q) int64 position of each (padded) query


@dataclass(frozen=True, slots=True)
class CpuInvariantPlan:
    """What every layer of one batch-invariant CPU forward needs besides its pools."""

    num_tokens: int  # T, rows of the flat forward
    new_slots: torch.Tensor  # (T,) int64 slot each new token's K/V is written to
    groups: tuple[InvariantGroup, ...]
    kv_scales: KvScales | None = None  # an FP8 pool's per-layer scales; None: 1.0

    def layer(self, k_pool: torch.Tensor, v_pool: torch.Tensor, index: int | None = None) -> InvariantLayerKV:
        """Bind layer ``index``'s pools (num_blocks, tokens_per_block, Hkv, D)."""
        return InvariantLayerKV(self, slot_view(k_pool), slot_view(v_pool), *layer_scales(self.kv_scales, index))


@dataclass(frozen=True, slots=True)
class InvariantLayerKV:
    """One layer's view of a batch-invariant plan: what ``Attention`` calls."""

    plan: CpuInvariantPlan
    k_pool: torch.Tensor  # (num_slots, Hkv, D), a view of the layer's pool
    v_pool: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> (T, Hq, D). The new K/V are written
        first and every query reads its keys from the pool, as stored: a prefix computed in this
        forward and one read from the cache are the same values."""
        write_new_tokens(self.k_pool, self.v_pool, self.plan.new_slots, k, v, self.k_scale, self.v_scale)
        out = torch.empty_like(q)
        for group in self.plan.groups:
            n, Q, K = group.num_seqs, group.q_len, group.k_len
            qg = q[group.q_rows] if isinstance(group.q_rows, slice) else q.index_select(0, group.q_rows)
            kg, vg = self._gather(group.kv_slots, q.dtype)  # (n * K, Hkv, D)
            y = invariant_attention(qg.view(n, Q, *q.shape[1:]), kg.view(n, K, *kg.shape[1:]),
                                    vg.view(n, K, *vg.shape[1:]), group.q_pos, scale)  # (n, Q, Hq, D)
            y = y.reshape(n * Q, *q.shape[1:])
            if group.real is not None:
                y = y.index_select(0, group.real)
            if isinstance(group.out_rows, slice):
                out[group.out_rows] = y
            else:
                out.index_copy_(0, group.out_rows, y)
        return out

    def _gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = gather_slots(self.k_pool, slots), gather_slots(self.v_pool, slots)
        if is_quantized(self.k_pool):
            return dequantize(k, self.k_scale, dtype), dequantize(v, self.v_scale, dtype)
        return k, v


class CpuInvariantPlanBuilder:
    """Builds the plans of a batch-invariant CPU engine's forwards (the same checks as
    ``cpu_paged.build_cpu_plan``, whose layout and length groups it reuses)."""

    def __init__(self, *, tokens_per_block: int, num_blocks: int, dtype: torch.dtype | None = None,
                 kv_scales: KvScales | None = None) -> None:
        """``dtype`` is accepted for the builders' common signature; nothing here depends on it."""
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.kv_scales = kv_scales

    def build(
        self, num_new_tokens: Sequence[int], num_cached_tokens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> CpuInvariantPlan:
        tpb = self.tokens_per_block
        layout = forward_layout(num_new_tokens, num_cached_tokens, block_tables, tokens_per_block=tpb,
                                num_blocks=self.num_blocks)
        new, cached = layout.new, layout.cached
        active = np.flatnonzero(new > 0)
        groups = []
        for kind in (active[new[active] == 1], active[new[active] >= 2]):  # decodes, then context chunks
            for members in group_by_length(new[kind], cached[kind] + new[kind], kind):
                groups.append(_group_of(members, layout, tpb))
        return CpuInvariantPlan(int(layout.starts[-1]), torch.from_numpy(layout.new_slots), tuple(groups),
                                self.kv_scales)


def _group_of(members: np.ndarray, layout, tpb: int) -> InvariantGroup:
    q_lens, c_lens = layout.new[members], layout.cached[members]  # (n,)
    k_lens = c_lens + q_lens
    n, Q, K = members.size, int(q_lens.max()), int(k_lens.max())
    i = np.arange(Q)
    q_index = np.minimum(i[None, :], q_lens[:, None] - 1)  # (n, Q): padding repeats the last query
    q_rows = (layout.starts[members][:, None] + q_index).reshape(-1)  # (n * Q,)
    real = (i[None, :] < q_lens[:, None]).reshape(-1)
    j = np.arange(K)
    positions = np.where(j[None, :] < k_lens[:, None], j[None, :], 0)  # (n, K): padding reads position 0
    kv_slots = layout.tables[members[:, None], positions // tpb] * tpb + positions % tpb
    return InvariantGroup(
        n, Q, K, as_rows(q_rows), as_rows(q_rows[real]), None if real.all() else torch.from_numpy(np.flatnonzero(real)),
        torch.from_numpy(kv_slots.reshape(-1)), torch.from_numpy(c_lens[:, None] + q_index),
    )
