"""Paged attention on the CPU: one plan per forward, a few batched calls per layer.

The GPU plan (``paged.PagedPlanBuilder``) routes a forward's requests to two kernels; on the CPU
the same idea runs on torch's own ops. :func:`build_cpu_plan` (:class:`CpuPlanBuilder`, what the
CPU engine holds) runs once per forward on the host,
from plain ints: it checks the block tables, computes every slot the forward writes and
reads, and packs the requests into a few *groups*, each attended by ONE
``scaled_dot_product_attention`` call over a padded batch. Every layer then
(``CpuLayerKV.attend``):

1. writes the new tokens' K/V into their slots (``index_copy_``, one call per pool);
2. per group: gathers the group's K/V from the pool in one ``index_select`` per pool, attends,
   and writes the rows back. No Python loop runs over requests.

A group of ``n`` sequences padded to ``Q`` queries and ``K`` keys each::

    sequence   cached  new   queries (Q = 3)        keys (K = 7)
      a        4       3     a4 a5 a6               a0 a1 a2 a3 a4 a5 a6
      b        2       2     b2 b3 b3'              b0 b1 b2 b3 b0' b0' b0'
                                   ^ padding: b's last row again, its output dropped
                                                              ^ padding: b's position 0 again, masked

    mask[s, 0, i, j] = j <= cached[s] + min(i, new[s] - 1)      (causal, bottom-right)

Padding repeats a slot the sequence itself reads (its position 0) and a row it owns (its last
query), so the forward reads exactly the slots of positions ``[0, cached + new)`` of each
request, never a stale or unwritten one (a NaN there would poison a masked product).

Decodes (one new token) form groups with ``Q = 1``; their query heads are folded onto their KV
heads, ``(n, Hkv, group, D)``, so grouped-query attention needs no ``repeat_interleave``.
Requests are grouped by length so that padding stays bounded (:func:`group_by_length`): a batch of
similar lengths is one call, a batch with a few long ones a few. A lone context chunk with no
cached prefix (a prefill) attends to its own new K/V with ``is_causal``: the same call a dense
forward makes.

An FP8 pool (``kv_quant``) is written quantized and dequantized on read: the gathered K/V of a
group, and a prefill's own new K/V (what was stored, widened back), so every query sees the
stored values.

Masking follows the GPU plan's rule: queries sit at consecutive positions from ``cached``
(what the engine builds); the positions tensor itself is only used for RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, dequantize, is_quantized
from tensorrt_llm._torch.attention_backend.paged import decode_tables, layer_scales, slot_view, write_new_tokens

__all__ = ["CpuAttentionPlan", "CpuLayerKV", "CpuPlanBuilder", "ForwardLayout", "build_cpu_plan", "forward_layout"]

# A group may hold up to this many times the work of its sequences unpadded (plus a small
# allowance, so that short sequences always share a call): bounded waste, few calls.
_PAD_SLACK = 1.5
_PAD_ALLOWANCE = 4096  # padded (query, key) pairs a group may add whatever its size


@dataclass(frozen=True, slots=True)
class AttendGroup:
    """Sequences attended by one SDPA call, padded to ``q_len`` queries and ``k_len`` keys."""

    num_seqs: int  # n
    q_len: int  # Q (1: decodes, query heads folded onto KV heads)
    k_len: int  # K
    q_rows: torch.Tensor | slice  # (n * Q,) rows of q, padded with each sequence's last row
    out_rows: torch.Tensor | slice  # rows of the output the real queries fill
    real: torch.Tensor | None  # (rows of out_rows,) indices into the n * Q padded queries; None: all real
    kv_slots: torch.Tensor | None  # (n * K,) pool slots, padded with each sequence's position 0;
    #                                None: a prefill from position 0, its keys are its own new rows
    mask: torch.Tensor | None  # (n, 1, Q, K) additive (0 visible, -inf hidden), in the model's dtype;
    #                            None: nothing hidden (decodes of one length) or plain causal (a prefill)


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """What every layer of one CPU forward needs besides its pools."""

    num_tokens: int  # T, rows of the flat forward
    new_slots: torch.Tensor  # (T,) int64 slot each new token's K/V is written to
    groups: tuple[AttendGroup, ...]
    kv_scales: KvScales | None = None  # an FP8 pool's per-layer scales; None: 1.0

    def layer(self, k_pool: torch.Tensor, v_pool: torch.Tensor, index: int | None = None) -> CpuLayerKV:
        """Bind layer ``index``'s pools (num_blocks, tokens_per_block, Hkv, D) (``index`` picks its
        KV scales; needed only when the plan has scales other than 1.0)."""
        return CpuLayerKV(self, slot_view(k_pool), slot_view(v_pool), *layer_scales(self.kv_scales, index))


@dataclass(frozen=True, slots=True)
class CpuLayerKV:
    """One layer's view of a CPU plan: what ``Attention`` calls on the CPU."""

    plan: CpuAttentionPlan
    k_pool: torch.Tensor  # (num_slots, Hkv, D), a view of the layer's pool
    v_pool: torch.Tensor  # (num_slots, Hkv, D)
    k_scale: float = 1.0  # an FP8 pool's scales (kv_quant); 1.0 otherwise
    v_scale: float = 1.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> attention output (T, Hq, D)."""
        plan = self.plan
        # Write first, so that every group reads its own new tokens from the pool.
        stored_k, stored_v = write_new_tokens(self.k_pool, self.v_pool, plan.new_slots, k, v, self.k_scale, self.v_scale)
        if is_quantized(self.k_pool):  # a prefill attends to its own K/V as stored, like every other read
            k, v = dequantize(stored_k, self.k_scale, q.dtype), dequantize(stored_v, self.v_scale, q.dtype)
        groups = plan.groups
        if len(groups) == 1 and groups[0].real is None and groups[0].out_rows == slice(0, plan.num_tokens):
            return self._group(groups[0], q, k, v, scale)  # one call makes the whole output, in order
        out = torch.empty_like(q)  # (T, Hq, D)
        for group in groups:
            y = self._group(group, q, k, v, scale)  # (real rows, Hq, D)
            if isinstance(group.out_rows, slice):
                out[group.out_rows] = y
            else:
                out.index_copy_(0, group.out_rows, y)
        return out

    def _group(self, g: AttendGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        n, Q, K = g.num_seqs, g.q_len, g.k_len
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        qg = q[g.q_rows] if isinstance(g.q_rows, slice) else q.index_select(0, g.q_rows)  # (n * Q, Hq, D)
        if g.kv_slots is None:  # a prefill: its keys are its new rows, plain causal attention
            kg = k[g.q_rows].view(1, Q, Hkv, D).transpose(1, 2)  # (1, Hkv, Q, D)
            vg = v[g.q_rows].view(1, Q, Hkv, D).transpose(1, 2)
            y = F.scaled_dot_product_attention(
                qg.view(1, Q, Hq, D).transpose(1, 2), kg, vg, is_causal=True, scale=scale, enable_gqa=True
            )  # (1, Hq, Q, D)
            return y.transpose(1, 2).reshape(Q, Hq, D)
        kg, vg = self._gather(g.kv_slots, q.dtype)
        kg = kg.view(n, K, Hkv, D).transpose(1, 2)  # (n, Hkv, K, D)
        vg = vg.view(n, K, Hkv, D).transpose(1, 2)
        if Q == 1:  # decodes: each KV head's query heads side by side, one mask row per sequence
            y = F.scaled_dot_product_attention(
                qg.view(n, Hkv, Hq // Hkv, D), kg, vg, attn_mask=g.mask, scale=scale
            )  # (n, Hkv, group, D)
            return y.reshape(n, Hq, D)
        y = F.scaled_dot_product_attention(
            qg.view(n, Q, Hq, D).transpose(1, 2), kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True
        )  # (n, Hq, Q, D)
        y = y.transpose(1, 2).reshape(n * Q, Hq, D)  # (n * Q, Hq, D)
        return y if g.real is None else y.index_select(0, g.real)

    def _gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of ``slots`` (n * K, Hkv, D), dequantized from an FP8 pool."""
        k, v = self.k_pool.index_select(0, slots), self.v_pool.index_select(0, slots)
        if is_quantized(self.k_pool):
            return dequantize(k, self.k_scale, dtype), dequantize(v, self.v_scale, dtype)
        return k, v


# --------------------------------------------------------------------------------------------
# Building a plan on the host
# --------------------------------------------------------------------------------------------


def build_cpu_plan(
    num_new_tokens: Sequence[int],
    num_cached_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    tokens_per_block: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    kv_scales: KvScales | None = None,
) -> CpuAttentionPlan:
    """The plan of one flat forward (request ``r`` owns the next ``num_new_tokens[r]`` rows).

    Every table must cover its request's positions, every block they use must lie in
    ``[0, num_blocks)`` and no two new tokens may share a slot. Raises ValueError naming the
    request otherwise, before any pool is written. ``dtype``: the model's, which the masks are
    built in (SDPA would convert a boolean mask in every layer).
    """
    layout = forward_layout(num_new_tokens, num_cached_tokens, block_tables, tokens_per_block=tokens_per_block,
                            num_blocks=num_blocks)
    new, cached, starts, tables = layout.new, layout.cached, layout.starts, layout.tables
    active = np.flatnonzero(new > 0)
    decodes = active[new[active] == 1]
    contexts = active[new[active] >= 2]
    groups = [
        _group_of(members, new, cached, starts, tables, tokens_per_block, dtype)
        for kind in (decodes, contexts)
        for members in group_by_length(new[kind], cached[kind] + new[kind], kind)
    ]
    return CpuAttentionPlan(int(starts[-1]), torch.from_numpy(layout.new_slots), tuple(groups), kv_scales)


class ForwardLayout(NamedTuple):
    """Where one flat forward's requests lie (:func:`forward_layout`), as int64 arrays."""

    new: np.ndarray  # (n,) new tokens per request
    cached: np.ndarray  # (n,) cached tokens per request (its first new token's position)
    starts: np.ndarray  # (n + 1,) first flat row of each request, then the total
    tables: np.ndarray  # (n, W) block tables, zero-padded
    new_slots: np.ndarray  # (T,) the pool slot each new token's K/V is written to


def forward_layout(
    num_new_tokens: Sequence[int],
    num_cached_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    tokens_per_block: int,
    num_blocks: int,
) -> ForwardLayout:
    """The checked layout of one flat forward (request ``r`` owns the next ``num_new_tokens[r]``
    rows): every table covers its request's positions, every block it uses lies in
    ``[0, num_blocks)``, no two new tokens share a slot. Raises ValueError naming the request
    otherwise, before any pool is written."""
    tpb = tokens_per_block
    new = np.asarray(num_new_tokens, dtype=np.int64)
    cached = np.asarray(num_cached_tokens, dtype=np.int64)
    n = len(new)
    needed = -(-(cached + new) // tpb)  # (n,) blocks each request uses
    table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
    short = np.flatnonzero(table_lens < needed)
    if short.size:  # the engine's tables come from the KV manager; AttentionMetadata checks callers' first
        r = int(short[0])
        raise ValueError(f"block_tables[{r}] has {table_lens[r]} blocks, {cached[r]} cached + {new[r]} new tokens "
                         f"need {needed[r]} blocks of {tpb} tokens")
    tables = decode_tables(block_tables).astype(np.int64)  # (n, W), zero-padded
    used = np.arange(tables.shape[1]) < needed[:, None]  # (n, W)
    outside = used & (tables >= num_blocks)
    if outside.any():
        r = int(np.flatnonzero(outside.any(axis=1))[0])
        raise ValueError(
            f"AttentionMetadata.block_tables[{r}] refers to block {int(tables[r][used[r]].max())}, "
            f"but the KV pools hold {num_blocks} blocks"
        )
    starts = np.concatenate(([0], np.cumsum(new)))  # (n+1,) first row of each request
    total = int(starts[-1])
    owner = np.repeat(np.arange(n), new)  # (T,)
    position = cached[owner] + (np.arange(total) - starts[owner])  # (T,)
    new_slots = tables[owner, position // tpb] * tpb + position % tpb  # (T,)
    if np.unique(new_slots).size != total:
        raise ValueError(
            "AttentionMetadata maps two new tokens of this forward to the same KV slot "
            "(a block that is being written is shared)"
        )
    return ForwardLayout(new, cached, starts, tables, new_slots)


class CpuPlanBuilder:
    """Builds the plans of the CPU engine's forwards (:func:`build_cpu_plan` with its settings)."""

    def __init__(self, *, tokens_per_block: int, num_blocks: int, dtype: torch.dtype,
                 kv_scales: KvScales | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.kv_scales = kv_scales

    def build(
        self, num_new_tokens: Sequence[int], num_cached_tokens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> CpuAttentionPlan:
        return build_cpu_plan(num_new_tokens, num_cached_tokens, block_tables, tokens_per_block=self.tokens_per_block,
                              num_blocks=self.num_blocks, dtype=self.dtype, kv_scales=self.kv_scales)


def group_by_length(q_lens: np.ndarray, k_lens: np.ndarray, requests: np.ndarray) -> list[np.ndarray]:
    """``requests`` split into groups whose padded work (sequences x longest queries x longest
    keys) stays within ``_PAD_SLACK`` times their real work plus ``_PAD_ALLOWANCE``: longest
    first, each group taking the next longest while it fits. Groups keep the requests' order."""
    if requests.size == 0:
        return []
    order = np.argsort(-k_lens, kind="stable")
    groups, members = [], [order[0]]
    q_max, k_max, work = int(q_lens[order[0]]), int(k_lens[order[0]]), int(q_lens[order[0]] * k_lens[order[0]])
    for i in order[1:]:
        q, k = int(q_lens[i]), int(k_lens[i])
        padded = (len(members) + 1) * max(q_max, q) * k_max
        if padded <= _PAD_SLACK * (work + q * k) + _PAD_ALLOWANCE:
            members.append(i)
            q_max, work = max(q_max, q), work + q * k
            continue
        groups.append(members)
        members, q_max, k_max, work = [i], q, k, q * k
    groups.append(members)
    return [requests[np.sort(np.asarray(m))] for m in groups]


def as_rows(rows: np.ndarray) -> torch.Tensor | slice:
    """Row indices as a slice when they are one ascending run (no gather needed)."""
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and (rows.size < 2 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.from_numpy(np.ascontiguousarray(rows))


def _group_of(
    members: np.ndarray, new: np.ndarray, cached: np.ndarray, starts: np.ndarray, tables: np.ndarray, tpb: int,
    dtype: torch.dtype,
) -> AttendGroup:
    q_lens, c_lens = new[members], cached[members]  # (n,)
    k_lens = c_lens + q_lens
    n, Q, K = members.size, int(q_lens.max()), int(k_lens.max())
    i = np.arange(Q)
    # Query i of sequence s is its row starts + min(i, new - 1): padding repeats its last row.
    q_index = np.minimum(i[None, :], q_lens[:, None] - 1)  # (n, Q)
    q_rows = (starts[members][:, None] + q_index).reshape(-1)  # (n * Q,)
    real = (i[None, :] < q_lens[:, None]).reshape(-1)  # (n * Q,)
    out_rows = as_rows(q_rows[real])
    real_index = None if real.all() else torch.from_numpy(np.flatnonzero(real))
    if n == 1 and c_lens[0] == 0 and Q > 1:  # a prefill from position 0: its own rows, causal
        return AttendGroup(1, Q, K, as_rows(q_rows), out_rows, None, None, None)
    j = np.arange(K)
    # Key j of sequence s: position j, or position 0 where j is padding (read, then masked).
    positions = np.where(j[None, :] < k_lens[:, None], j[None, :], 0)  # (n, K)
    kv_slots = tables[members[:, None], positions // tpb] * tpb + positions % tpb  # (n, K)
    mask = None
    if Q > 1 or (k_lens != K).any():  # decodes of one length see every key: no mask
        visible = torch.from_numpy(j[None, None, :] <= (c_lens[:, None] + q_index)[:, :, None])  # (n, Q, K)
        mask = torch.zeros(n, 1, Q, K, dtype=dtype).masked_fill_(~visible[:, None], float("-inf"))
    return AttendGroup(n, Q, K, as_rows(q_rows), out_rows, real_index, torch.from_numpy(kv_slots.reshape(-1)), mask)
