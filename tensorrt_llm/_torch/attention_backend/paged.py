"""Paged attention for accelerators: a per-forward plan built once on the host, read by every layer.

On a GPU a loop over requests in every layer, or any read of a device value on the host, would
stall the device, so this backend moves all of it into :meth:`PagedPlanBuilder.build`, which runs
once per forward on the host from plain ints, ships a handful of index tensors to the device, and
decides which kernel serves which request:

    flat forward:  [ chunk A (5 tokens) | chunk B (3) | dec C | dec D ]   (rows of q, k, v)
                     context: one varlen call        decode: one paged kernel
    request:       num_cached  num_new   ->  served by
      A            0           5             context (its K/V are the new tokens' own)
      B            8           3             context (K/V gathered from the pool: 8 cached + 3 new)
      C, D         any         1             decode  (reads its blocks in place)

A request with one new token is a decode whatever its state: attending to all of its positions
is exactly what a one-token chunk does. Every layer then (``PagedLayerKV.attend``):

1. writes the new tokens' K/V into their slots (``kernels.rotate_and_write``: one Triton kernel for
   both pools, quantizing for an FP8 pool, and RoPE of q and k with it for the fused decoder
   layer, ``attend_rotary``; torch's ``index_copy_`` per pool where Triton does not run);
2. runs the context chunks, if any, through one varlen causal call over packed K/V (gathered from
   the pool only when some chunk has a cached prefix);
3. runs the decodes, if any, through the paged decode kernel straight into the output.

Masking follows the CPU path's rule, key ``p`` visible to a query at position ``x`` iff
``p <= x``, for queries at consecutive positions from ``num_cached`` (what the engine builds);
the positions tensor itself is only used for RoPE.

An FP8 pool (``kv_quant``: ``KvCacheConfig.dtype: fp8``) is written quantized, with the layer's
scales (the plan's ``kv_scales``; 1.0 without), and every read goes through the stored values: the
chunks' own new K/V as well as a gathered prefix and the decode kernel's reads.

A plan holds no host state a layer would need to read back, so a forward built from it can be
captured in a CUDA graph: ``cuda_graph_runner`` keeps one static plan per batch size and copies
each step's indices into it.

What depends on the device (how host arrays reach it, how many multiprocessors it has) is settled
once, when a :class:`PagedPlanBuilder` is made (an engine makes one at construction); building a
plan then branches on nothing but the batch. :func:`build_plan` is the one-off form.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.kernels import context_attention, decode_attention, rotate_and_write
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, is_quantized, quantize
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging

__all__ = [
    "ContextBatch", "DecodeBatch", "PagedAttentionPlan", "PagedLayerKV", "PagedPlanBuilder", "build_plan", "device_copier",
    "gather_slots", "layer_scales", "num_sms", "write_new_tokens",
]

ToDevice = Callable[[np.ndarray], torch.Tensor]  # a host array -> a new tensor on the device, without blocking the host


@dataclass(frozen=True, slots=True)
class ContextBatch:
    """The forward's context chunks (requests with 2+ new tokens), packed for one varlen call."""

    rows: torch.Tensor | None  # (Tc,) int64 rows of q holding chunk tokens; None: rows [0, Tc)
    num_tokens: int  # Tc
    cu_seqlens_q: torch.Tensor  # (N+1,) int32
    cu_seqlens_k: torch.Tensor  # (N+1,) int32
    q_lens: tuple[int, ...]  # new tokens per chunk (host copy: the varlen call needs the maximum)
    k_lens: tuple[int, ...]  # cached + new per chunk
    kv_slots: torch.Tensor | None  # (sum k_lens,) int64 slots of every chunk's positions;
    #                                None: no chunk has a cached prefix, its K/V are its own rows


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The forward's one-token requests, for the paged decode kernel."""

    rows: torch.Tensor  # (B,) int64 rows of q
    block_tables: torch.Tensor  # (B, W) int32 block ids, position order
    seq_lens: torch.Tensor  # (B,) int32 positions attended: cached + 1
    num_splits: int  # flash-decoding splits per sequence (from B alone)


@dataclass(frozen=True, slots=True)
class PagedAttentionPlan:
    """Everything the layers of one flat forward need besides their pools; device tensors only."""

    tokens_per_block: int
    num_tokens: int  # T, rows of the flat forward
    new_slots: torch.Tensor  # (T,) int64 slot each new token's K/V is written to
    context: ContextBatch | None
    decode: DecodeBatch | None
    kv_scales: KvScales | None = None  # an FP8 pool's per-layer scales; None: 1.0

    def layer(self, k_pool: torch.Tensor, v_pool: torch.Tensor, index: int | None = None) -> "PagedLayerKV":
        """Bind layer ``index``'s pools (num_blocks, tokens_per_block, Hkv, D) (``index`` picks its
        KV scales; needed only when the plan has scales other than 1.0)."""
        return PagedLayerKV(self, slot_view(k_pool), slot_view(v_pool), *layer_scales(self.kv_scales, index))


@dataclass(frozen=True, slots=True)
class PagedLayerKV:
    """One layer's view of a plan: what ``Attention`` calls on an accelerator."""

    plan: PagedAttentionPlan
    k_pool: torch.Tensor  # (num_slots, Hkv, D), a view of the layer's pool
    v_pool: torch.Tensor  # (num_slots, Hkv, D)
    k_scale: float = 1.0  # an FP8 pool's scales (kv_quant); 1.0 otherwise
    v_scale: float = 1.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> attention output (T, Hq, D)."""
        return self._write_and_attend(q, k, v, None, None, scale)

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """:meth:`attend` for q and k before RoPE: they are rotated by cos, sin (T, D/2) in place,
        in the kernel that writes the KV (the fused decoder layer's path, ``models/fused_layers.py``)."""
        return self._write_and_attend(q, k, v, cos, sin, scale)

    def _write_and_attend(self, q, k, v, cos, sin, scale: float) -> torch.Tensor:
        plan = self.plan
        # Write first, so that chunks and decodes read their own new tokens from the pool (one
        # kernel for K and V, RoPE with it when cos is given: kernels.rotate_and_write).
        rotate_and_write(q, k, v, cos, sin, self.k_pool, self.v_pool, plan.new_slots, self.k_scale, self.v_scale)
        ctx, dec = plan.context, plan.decode
        if ctx is not None and ctx.kv_slots is None and is_quantized(self.k_pool):
            # Chunks without a prefix attend to their own new K/V as the FP8 pool stored them (kv_quant).
            k, v = gather_slots(self.k_pool, plan.new_slots), gather_slots(self.v_pool, plan.new_slots)
        if ctx is not None:
            y_ctx = self._context(ctx, q, k, v, scale)  # (Tc, Hq, D)
            if dec is None and ctx.rows is None:
                return y_ctx  # the whole forward is context chunks, in order
        y = torch.empty_like(q)  # (T, Hq, D)
        if ctx is not None:
            if ctx.rows is None:
                y[: ctx.num_tokens] = y_ctx
            else:
                y.index_copy_(0, ctx.rows, y_ctx)
        if dec is not None:
            decode_attention(
                q, self.k_pool, self.v_pool, y, dec.rows, dec.block_tables, dec.seq_lens,
                tokens_per_block=plan.tokens_per_block, scale=scale, num_splits=dec.num_splits,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )
        return y

    def _context(self, ctx: ContextBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        if ctx.rows is None:
            qc = q[: ctx.num_tokens]  # (Tc, Hq, D)
        else:
            qc = q.index_select(0, ctx.rows)
        if ctx.kv_slots is None:  # no cached prefix anywhere: the keys are the chunks' own tokens
            kc = k[: ctx.num_tokens] if ctx.rows is None else gather_slots(k, ctx.rows)
            vc = v[: ctx.num_tokens] if ctx.rows is None else gather_slots(v, ctx.rows)
        else:
            kc = gather_slots(self.k_pool, ctx.kv_slots)  # (sum k_lens, Hkv, D)
            vc = gather_slots(self.v_pool, ctx.kv_slots)
        return context_attention(qc, kc, vc, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.q_lens, ctx.k_lens, scale,
                                 k_scale=self.k_scale, v_scale=self.v_scale)


# --------------------------------------------------------------------------------------------
# Building a plan on the host
# --------------------------------------------------------------------------------------------


_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (a nominal 132, an H200's, elsewhere)."""
    if device.type != "cuda":
        return 132
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def decode_num_splits(num_seqs: int, num_kv_heads: int, sms: int, max_splits: int = 16) -> int:
    """Flash-decoding splits so that about two programs per multiprocessor (``sms``, see
    :func:`num_sms`) run: a power of two, from the batch shape alone (a graph captured for a batch
    size keeps it for any lengths)."""
    programs = max(1, num_seqs * num_kv_heads)
    target = 2 * sms
    splits = 1
    while splits < max_splits and programs * splits < target:
        splits *= 2
    return splits


def device_copier(device: torch.device | str, staging: PinnedStaging | None = None) -> ToDevice:
    """How host arrays reach ``device`` without blocking the host, chosen once per device: on
    CUDA through pinned memory (``staging``'s persistent buffers, inside its ``step()``, else a
    pinned copy of each array), elsewhere a plain copy."""
    device = torch.device(device)
    if device.type == "cuda":
        if staging is not None:
            return staging.to_device
        return lambda array: torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    return lambda array: torch.from_numpy(array).to(device)


def slot_view(pool: torch.Tensor) -> torch.Tensor:
    """One layer's pool (num_blocks, tokens_per_block, Hkv, D) as slots (num_slots, Hkv, D), a view."""
    return pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def write_new_tokens(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new tokens' K/V (T, Hkv, D) into their ``slots`` (T,) of the slot views; returns
    what was stored (``k``, ``v`` themselves, or their FP8 form in an FP8 pool: ``kv_quant``)."""
    if is_quantized(k_pool):
        k, v = quantize(k, k_scale), quantize(v, v_scale)
        # Through byte views: not every device has an index_copy_ kernel for float8.
        k_pool.view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
        v_pool.view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
        return k, v
    k_pool.index_copy_(0, slots, k)
    v_pool.index_copy_(0, slots, v)
    return k, v


def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` (a slot view's rows, in the pool's dtype; FP8 through a byte view)."""
    if is_quantized(pool):
        return pool.view(torch.uint8).index_select(0, slots).view(pool.dtype)
    return pool.index_select(0, slots)


def layer_scales(kv_scales: KvScales | None, index: int | None) -> tuple[float, float]:
    """(k_scale, v_scale) of layer ``index``: 1.0 without scales; a ValueError when the plan has
    scales other than 1.0 and no layer was named (they would be applied to the wrong layer)."""
    if kv_scales is None:
        return 1.0, 1.0
    if index is None:
        if kv_scales.is_unit:
            return 1.0, 1.0
        raise ValueError("this plan has per-layer KV scales: bind each layer with plan.layer(k_pool, v_pool, index)")
    return kv_scales.of(index)


def decode_tables(block_tables: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """(B, W) int32 matrix of the tables, zero-padded; W = the longest table unless given."""
    lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lens.max(initial=1)) if width is None else width
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    matrix = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
    matrix[np.arange(matrix.shape[1]) < lens[:, None]] = flat
    return matrix


class PagedPlanBuilder:
    """Builds the plans of one device's forwards over pools of ``num_blocks`` blocks.

    ``staging``: on CUDA, the engine's pinned buffers the index arrays travel through (plans are
    then built inside its ``step()``); without it each array is pinned on its own. ``kv_scales``:
    an FP8 pool's per-layer scales, carried by every plan (None: 1.0). The device's
    copier and multiprocessor count are taken here, once (:func:`device_copier`, :func:`num_sms`).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        tokens_per_block: int,
        num_blocks: int,
        num_kv_heads: int,
        staging: PinnedStaging | None = None,
        kv_scales: KvScales | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.kv_scales = kv_scales
        self._to_device = device_copier(self.device, staging)
        self._sms = num_sms(self.device)

    def build(
        self,
        num_new_tokens: Sequence[int],
        num_cached_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> PagedAttentionPlan:
        """The plan of one flat forward (request ``r`` owns the next ``num_new_tokens[r]`` rows).

        Checks what a wrong table would silently corrupt on a GPU: every table covers its
        positions, names blocks in ``[0, num_blocks)``, and no two new tokens share a slot.
        Raises ValueError naming the request otherwise, before anything is copied to the device.
        """
        tpb, num_blocks, to_device = self.tokens_per_block, self.num_blocks, self._to_device
        new = np.asarray(num_new_tokens, dtype=np.int64)
        cached = np.asarray(num_cached_tokens, dtype=np.int64)
        n = len(new)
        if len(cached) != n or len(block_tables) != n:
            raise ValueError("num_new_tokens, num_cached_tokens and block_tables need one entry per request")
        if n and (new.min() < 0 or cached.min() < 0):
            raise ValueError("token counts must be >= 0")
        table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
        needed = -(-(cached + new) // tpb)
        short = np.flatnonzero(table_lens < needed)
        if short.size:
            r = int(short[0])
            raise ValueError(f"block_tables[{r}] has {table_lens[r]} blocks, {cached[r]} cached + {new[r]} new tokens "
                             f"need {needed[r]} blocks of {tpb} tokens")
        tables = decode_tables(block_tables)  # (n, W) int32
        used = np.arange(tables.shape[1]) < needed[:, None]  # (n, W)
        bad = used & ((tables < 0) | (tables >= num_blocks))
        if bad.any():
            r = int(np.flatnonzero(bad.any(axis=1))[0])
            raise ValueError(f"block_tables[{r}] names a block outside [0, {num_blocks}): {list(block_tables[r])}")

        starts = np.concatenate(([0], np.cumsum(new)))  # (n+1,) first row of each request
        total = int(starts[-1])
        # Slot of every new token: request r's position cached[r] + j lives in block table[r][pos // tpb].
        owner = np.repeat(np.arange(n), new)  # (T,)
        position = cached[owner] + (np.arange(total) - starts[owner])  # (T,)
        new_slots = tables[owner, position // tpb].astype(np.int64) * tpb + position % tpb  # (T,)
        if np.unique(new_slots).size != total:
            raise ValueError("two new tokens of this forward map to the same KV slot (a block being written is shared)")

        is_ctx = new >= 2
        is_dec = new == 1
        context = _context_batch(np.flatnonzero(is_ctx), new, cached, starts, tables, tpb, to_device)
        decode = None
        if is_dec.any():
            dec = np.flatnonzero(is_dec)
            decode = DecodeBatch(
                rows=to_device(starts[dec]),
                block_tables=to_device(np.ascontiguousarray(tables[dec])),
                seq_lens=to_device((cached[dec] + 1).astype(np.int32)),
                num_splits=decode_num_splits(len(dec), self.num_kv_heads, self._sms),
            )
        return PagedAttentionPlan(tpb, total, to_device(new_slots), context, decode, self.kv_scales)


def build_plan(
    num_new_tokens: Sequence[int],
    num_cached_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    tokens_per_block: int,
    num_blocks: int,
    num_kv_heads: int,
    device: torch.device | str,
    staging: PinnedStaging | None = None,
    kv_scales: KvScales | None = None,
) -> PagedAttentionPlan:
    """One plan, from a builder made for it (tests, kernels benchmarks); see :class:`PagedPlanBuilder`."""
    builder = PagedPlanBuilder(device, tokens_per_block=tokens_per_block, num_blocks=num_blocks,
                               num_kv_heads=num_kv_heads, staging=staging, kv_scales=kv_scales)
    return builder.build(num_new_tokens, num_cached_tokens, block_tables)


def _context_batch(
    ctx: np.ndarray, new: np.ndarray, cached: np.ndarray, starts: np.ndarray, tables: np.ndarray, tpb: int,
    to_device: ToDevice,
) -> ContextBatch | None:
    if ctx.size == 0:
        return None
    q_lens = new[ctx]
    k_lens = cached[ctx] + new[ctx]
    num_tokens = int(q_lens.sum())
    rows = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in ctx])  # (Tc,)
    in_order = bool(rows[0] == 0 and rows[-1] == num_tokens - 1)  # contiguous from row 0
    kv_slots = None
    if cached[ctx].any():
        owner = np.repeat(np.arange(ctx.size), k_lens)  # (sum k_lens,)
        k_starts = np.concatenate(([0], np.cumsum(k_lens)))
        position = np.arange(int(k_starts[-1])) - k_starts[owner]
        kv_slots = to_device(tables[ctx[owner], position // tpb].astype(np.int64) * tpb + position % tpb)
    return ContextBatch(
        rows=None if in_order else to_device(rows),
        num_tokens=num_tokens,
        cu_seqlens_q=to_device(np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)),
        cu_seqlens_k=to_device(np.concatenate(([0], np.cumsum(k_lens))).astype(np.int32)),
        q_lens=tuple(int(x) for x in q_lens),
        k_lens=tuple(int(x) for x in k_lens),
        kv_slots=kv_slots,
    )
