"""The two attention calls of a paged forward, each with a fast kernel and a torch reference.

``context_attention``: every context chunk of the forward in ONE varlen call. Chunk ``i`` has
``q_lens[i]`` queries, the last ones of its ``k_lens[i]`` keys (its cached prefix, then itself),
causal with the diagonal at the bottom right: query ``j`` sees keys ``[0, k_lens[i] - q_lens[i]
+ j]``. On CUDA in bf16/fp16 this is our Triton kernel (``triton_context``) on the GPUs it was
tuned for (compute capability 9.x and 10.x: Hopper and datacenter Blackwell, whose 227 KB of
shared memory its tiles need) with a power-of-two head size up to 128, else torch's bundled
FlashAttention-2 varlen kernel
(``aten::_flash_attention_forward`` with cumulative lengths, native GQA, bottom-right causal);
both pack the chunks without padding. Elsewhere (float32, CPU tests) a per-chunk SDPA with an
explicit mask computes the same function.

Why Triton first: on the H200 (Nemo's 32/8 heads of 128, bf16) it runs a 4096-token chunk after
a 16k prefix at 488 TFLOP/s against flash-2's 334, a 4096-token prefill at 334-394 against 257,
a mixed batch of four chunks at 437 against 243, and a 512-token chunk after 2k at 178 against
171 (``benchmarks/results/h200/context/``). cuDNN runs Hopper's own kernels at a similar rate
on a fixed shape (518 TFLOP/s on the first of those), but it builds an execution plan for every
new shape, and serving rarely repeats one: on the H200 a replay paid ~85 ms per new chunk shape,
more than any forward gains (``benchmarks/results/h200/README.md``). Triton compiles once per
head size, query heads per KV head and dtype.

``decode_attention``: one query per sequence over its paged K/V, read in place by the Triton
kernel (``triton_paged_decode``) on CUDA; a gather-and-mask reference in torch elsewhere.

``rotate_and_write``: a forward's new K and V into their pool slots (quantized for an FP8 pool),
with RoPE of q and k in the same launch when the caller has not applied it (the fused decoder
layer): one Triton kernel (``triton_kv_write``) on CUDA, torch's ops elsewhere.

None of the fast paths synchronises with the host, so all can be captured in a CUDA graph.

FP8 K/V (``kv_quant``): both calls take K and V in float8_e4m3fn with their scales. The Triton
kernels read the FP8 bytes (half a bf16 cache's) and widen each tile to the query's dtype in
registers, with ``k_scale`` folded into the softmax scale and ``v_scale`` into the output; the
other paths dequantize first.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.attention_backend.kv_quant import dequantize, is_quantized, quantize

__all__ = ["context_attention", "decode_attention", "flash_varlen", "flash_varlen_available", "fused_rope_applies",
           "has_triton", "rotate_and_write", "rotate_qk_"]


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def flash_varlen_available(q: torch.Tensor) -> bool:
    """True where the flash varlen kernel runs: CUDA, half precision, head dim a multiple of 8."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    q_lens: tuple[int, ...],
    k_lens: tuple[int, ...],
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q (Tq, Hq, D) packed chunk queries; k, v (Tk, Hkv, D) packed chunk keys -> (Tq, Hq, D).

    cu_seqlens_q/k: (N+1,) int32 on q's device; q_lens/k_lens: the same lengths on the host.
    k, v in float8_e4m3fn: an FP8 cache's stored values, read as ``k * k_scale``, ``v * v_scale``.
    """
    if flash_varlen_available(q):
        if _triton_context_takes(q) and max(k_lens) * max(k.stride(0), v.stride(0)) < 2**31:
            from tensorrt_llm._torch.attention_backend.triton_context import context_attention_triton

            return context_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max(q_lens), scale,
                                            k_scale=k_scale, v_scale=v_scale)
        k, v = _dequantized(k, v, k_scale, v_scale, q.dtype)
        return flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_lens, k_lens, scale)
    k, v = _dequantized(k, v, k_scale, v_scale, q.dtype)
    return reference_context_attention(q, k, v, q_lens, k_lens, scale)


def _dequantized(k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype):
    """FP8 K and V widened to ``dtype`` with their scales; others as they are."""
    if not is_quantized(k):
        return k, v
    return dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)


def _triton_context_takes(q: torch.Tensor) -> bool:
    """Where the Triton context kernel runs (module docstring): a power-of-two head size from 16 to
    128, on a GPU of compute capability 9.x or 10.x."""
    return _triton_takes(q) and _power_of_two_in(q.shape[-1], 16, 128) and _capability(q.device)[0] in (9, 10)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_lens, k_lens, scale) -> torch.Tensor:
    """torch's bundled FlashAttention-2, varlen, bottom-right causal, native GQA."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max(q_lens), max(k_lens),
        0.0,  # dropout
        True,  # causal, bottom-right aligned when a chunk has fewer queries than keys
        False,  # return_debug_mask
        scale=scale,
    )[0]


def reference_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...], k_lens: tuple[int, ...], scale: float
) -> torch.Tensor:
    """The varlen call chunk by chunk through SDPA with an explicit bottom-right causal mask."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        qi = q[q0 : q0 + nq].transpose(0, 1)  # (Hq, nq, D)
        ki = k[k0 : k0 + nk].repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, nk, D)
        vi = v[k0 : k0 + nk].repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, nk, D)
        visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)  # (nq, nk)
        yi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=visible, scale=scale)  # (Hq, nq, D)
        out[q0 : q0 + nq] = yi.transpose(0, 1)
        q0, k0 = q0 + nq, k0 + nk
    return out


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    num_splits: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``out[rows[b]]`` = attention of ``q[rows[b]]`` over positions ``[0, seq_lens[b])`` of
    sequence ``b``, whose K/V live in the flat pools (num_slots, Hkv, D) at the slots
    ``block_tables[b]`` gives (FP8 pools read as ``k * k_scale``, ``v * v_scale``). Triton on CUDA,
    the torch reference elsewhere."""
    if _triton_takes(q) and _power_of_two_in(q.shape[-1], 16):
        from tensorrt_llm._torch.attention_backend.triton_paged_decode import paged_decode_attention

        paged_decode_attention(
            q, k_pool, v_pool, out, rows, block_tables, seq_lens,
            tokens_per_block=tokens_per_block, scale=scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
        )
        return
    reference_decode_attention(
        q, k_pool, v_pool, out, rows, block_tables, seq_lens, tokens_per_block=tokens_per_block, scale=scale,
        k_scale=k_scale, v_scale=v_scale,
    )


def reference_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    tokens_per_block: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Gather every sequence's positions (padded to the table width) and attend with a mask
    (FP8 pools dequantized after the gather)."""
    if rows.numel() == 0:
        return
    num_seqs, width = block_tables.shape
    group = q.shape[1] // k_pool.shape[1]
    positions = torch.arange(width * tokens_per_block, device=q.device)  # (L,)
    blocks = block_tables.long()[:, positions // tokens_per_block]  # (B, L)
    slots = blocks * tokens_per_block + positions % tokens_per_block  # (B, L)
    visible = positions[None, :] < seq_lens.long()[:, None]  # (B, L)
    slots = torch.where(visible, slots, 0)
    keys, values = _dequantized(_gather(k_pool, slots), _gather(v_pool, slots), k_scale, v_scale, q.dtype)
    keys = keys.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # (B, Hq, L, D)
    values = values.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # (B, Hq, L, D)
    query = q[rows].unsqueeze(2)  # (B, Hq, 1, D)
    y = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None, None, :], scale=scale)
    out[rows] = y.squeeze(2).to(out.dtype)  # (B, Hq, D)


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for any slot shape (FP8 through a byte view)."""
    if is_quantized(pool):
        return pool.view(torch.uint8)[slots].view(pool.dtype)
    return pool[slots]


def fused_rope_applies(q: torch.Tensor) -> bool:
    """True where :func:`rotate_qk_` runs as one Triton kernel: CUDA, half head dim a power of two."""
    return _triton_takes(q) and _power_of_two_in(q.shape[-1] // 2, 1)


def _power_of_two_in(n: int, low: int, high: int | None = None) -> bool:
    """``n`` a power of two in ``[low, high]`` (the Triton kernels' ``tl.arange`` and ``tl.dot`` sizes)."""
    return n >= low and (high is None or n <= high) and n & (n - 1) == 0


def _triton_takes(q: torch.Tensor) -> bool:
    """The Triton kernels' device and dtypes: CUDA, 16- or 32-bit floats (they accumulate in
    float32, so a float64 model, the reference tests', takes the torch paths and keeps its precision)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and has_triton()


def rotate_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE of q (T, Hq, D) and k (T, Hkv, D), in place, in one kernel (``triton_rope``); only
    where :func:`fused_rope_applies`."""
    from tensorrt_llm._torch.attention_backend.triton_rope import rotate_qk_ as triton_rotate_qk_

    triton_rotate_qk_(q, k, cos, sin)


def rotate_and_write(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """RoPE of q (T, Hq, D) and k (T, Hkv, D) in place by cos, sin (T, D/2) (None: no RoPE), then
    k and v into ``slots`` (T,) of the slot views ``k_pool``, ``v_pool`` (num_slots, Hkv, D),
    quantized with the scales in an FP8 pool (``kv_quant.quantize``). One Triton kernel where
    :func:`fused_rope_applies` (``triton_kv_write``); torch's ops elsewhere, with the same result."""
    if fused_rope_applies(k):
        from tensorrt_llm._torch.attention_backend.triton_kv_write import rotate_and_write_kv_

        rotate_and_write_kv_(q, k, v, cos, sin, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale)
        return
    if cos is not None:
        _rotate_half_(q, cos, sin)
        _rotate_half_(k, cos, sin)
    if is_quantized(k_pool):
        k, v = quantize(k, k_scale), quantize(v, v_scale)
        k_pool, v_pool = k_pool.view(torch.uint8), v_pool.view(torch.uint8)  # no float8 index_copy_ everywhere
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    k_pool.index_copy_(0, slots, k)
    v_pool.index_copy_(0, slots, v)


def _rotate_half_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Llama's rotate-half RoPE of x (T, H, D) in place (``modules.rotary_embedding.apply_rotary``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (T, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    x.copy_(torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1))
