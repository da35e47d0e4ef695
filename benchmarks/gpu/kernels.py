"""One attention layer of the engine at the roofline cases' shapes, against torch's contiguous kernels.

Cases (Mistral-NeMo-12B attention: 32 query heads, 8 KV heads, head dim 128, bf16, 32-token
blocks in shuffled order):

* prefill 4096 with no prefix, and a 4096-token chunk after a 16k cached prefix: the engine's
  layer call (KV write, gather when there is a prefix, flash varlen) and the flash call alone;
  baseline SDPA on contiguous K/V (``is_causal``; lower-right ``CausalBias`` for the chunk).
  TFLOP/s counts 4 * head_dim * heads per (query, key) pair, causal pairs only. Beside them,
  the road not taken: cuDNN (a chunk over a prefix as two calls merged by log-sum-exp, since
  cuDNN's causal mask is top-left), timed on its first call of a new shape (the plan build a
  server would pay for every new chunk length) and after.
* decode 64 x 8k and 256 x 2k: the Triton paged kernel under each tile configuration and split
  count, and the engine's layer call (KV write + kernel with its automatic split); baseline SDPA
  on contiguous K/V, and gather-then-SDPA. GB/s counts K and V read once.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import BlockAllocator, time_ms
from tensorrt_llm._torch.attention_backend import build_plan
from tensorrt_llm._torch.attention_backend.kernels import context_attention, flash_varlen

logger = logging.getLogger(__name__)

# (positions per tile, warps, pipeline stages); the first is the kernel's default. Each variant
# is a Triton compile (~1 s), so the sweep is short: tiles at the automatic split count, then
# split counts at the default tile.
DECODE_CONFIGS = ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 3), (128, 8, 3))
# (queries per program, keys per tile, warps, stages) of the Triton context kernel; the first is
# its default.
CONTEXT_CONFIGS = ((128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                   (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 2))


def attention_benchmarks(device: torch.device, *, hq=32, hkv=8, d=128, tpb=32, quick=False) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = d**-0.5
    big = not quick
    prefill_len, chunk, prefix = (4096, 4096, 16384) if big else (256, 128, 512)
    decodes = ((64, 8192), (256, 2048)) if big else ((4, 256), (8, 128))
    max_tokens = max(chunk + prefix, max(b * c for b, c in decodes)) + 64 * tpb
    num_blocks = -(-max_tokens // tpb)
    gen = torch.Generator(device).manual_seed(0)
    k_pool = torch.randn(num_blocks, tpb, hkv, d, device=device, dtype=dtype, generator=gen)
    v_pool = torch.randn(num_blocks, tpb, hkv, d, device=device, dtype=dtype, generator=gen)
    alloc = BlockAllocator(num_blocks)
    repeats = 20 if big else 2
    out: dict = {"shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "tokens_per_block": tpb, "dtype": str(dtype)}}

    def layer_call(new, cached):
        alloc.reset()
        tables = [alloc.take(-(-(c + n) // tpb)) for n, c in zip(new, cached)]
        plan = build_plan(new, cached, tables, tokens_per_block=tpb, num_blocks=num_blocks, num_kv_heads=hkv,
                          device=device)
        layer = plan.layer(k_pool, v_pool)
        t = sum(new)
        q = torch.randn(t, hq, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(t, hkv, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(t, hkv, d, device=device, dtype=dtype, generator=gen)
        return plan, layer, (q, k, v)

    # ---- context -------------------------------------------------------------------------
    cases = (("prefill", [prefill_len], [0]), ("chunk_after_prefix", [chunk], [prefix]))
    if big:  # shapes a serving forward also sees, for the choice between the kernels
        cases += (("chunk_512_after_2k", [512], [2048]),
                  ("mixed_chunks", [2048, 512, 256, 1024], [0, 6000, 300, 12000]))
    for name, new, cached in cases:
        pairs = sum(n * p + n * (n + 1) / 2 for n, p in zip(new, cached))
        flops = 4 * d * hq * pairs
        plan, layer, (q, k, v) = layer_call(new, cached)
        case = {"new_tokens": new, "prefix": cached, "flops": flops}
        engine = time_ms(lambda: layer.attend(q, k, v, scale), device, repeats=repeats)
        kc = layer.k_pool.index_select(0, plan.context.kv_slots) if plan.context.kv_slots is not None else k
        vc = layer.v_pool.index_select(0, plan.context.kv_slots) if plan.context.kv_slots is not None else v
        ctx = plan.context
        kernel = time_ms(lambda: context_attention(q, kc, vc, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.q_lens,
                                                   ctx.k_lens, scale), device, repeats=repeats)
        timed = [("engine_layer", engine), ("context_kernel", kernel)]
        if device.type == "cuda":
            flash = time_ms(lambda: flash_varlen(q, kc, vc, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.q_lens,
                                                 ctx.k_lens, scale), device, repeats=repeats)
            timed.append(("flash_varlen", flash))
            reference = flash_varlen(q, kc, vc, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.q_lens, ctx.k_lens, scale)
            case["triton_sweep"] = triton_context_sweep(q, kc, vc, ctx, scale, flops, repeats, reference)
            ok = [s for s in case["triton_sweep"] if "ms" in s]
            if ok:
                case["triton_best"] = min(ok, key=lambda s: s["ms"])
        if len(new) == 1:
            n, p = new[0], cached[0]
            if device.type == "cuda":
                case["cudnn_split"] = cudnn_variant(q, kc, vc, n, n + p, scale, flops, repeats, reference)
            qt, kt, vt = q.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
            if p == 0:
                baseline = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                                          enable_gqa=True), device, repeats=repeats)
            else:
                from torch.nn.attention.bias import causal_lower_right

                bias = causal_lower_right(n, n + p)
                baseline = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale,
                                                                          enable_gqa=True), device, repeats=repeats)
            timed.append(("sdpa_contiguous", baseline))
        for label, t in timed:
            case[label] = {**t, "tflops": flops / (t["ms"] * 1e-3) / 1e12}
        out[name] = case

    # ---- decode --------------------------------------------------------------------------
    from tensorrt_llm._torch.attention_backend.kernels import decode_attention, has_triton

    for batch, ctx_len in decodes:
        new, cached = [1] * batch, [ctx_len - 1] * batch
        plan, layer, (q, k, v) = layer_call(new, cached)
        kv_bytes = 2 * batch * ctx_len * hkv * d * q.element_size()
        case = {"batch": batch, "context": ctx_len, "kv_bytes": kv_bytes, "auto_splits": plan.decode.num_splits}
        layer.attend(q, k, v, scale)  # writes the new tokens' K/V, so the kernel reads real values
        dec = plan.decode
        y = torch.empty_like(q)
        sweep = []
        if device.type == "cuda" and has_triton():
            from tensorrt_llm._torch.attention_backend.triton_paged_decode import DecodeConfig, paged_decode_attention

            variants = [(c, dec.num_splits) for c in DECODE_CONFIGS]
            variants += [(DECODE_CONFIGS[0], s) for s in (1, 2, 4, 8) if s != dec.num_splits]
            for (block_n, warps, stages), splits in variants:
                cfg = DecodeConfig(block_n, warps, stages)
                try:
                    t = time_ms(lambda: paged_decode_attention(
                        q, layer.k_pool, layer.v_pool, y, dec.rows, dec.block_tables, dec.seq_lens,
                        tokens_per_block=tpb, scale=scale, num_splits=splits, config=cfg), device, repeats=repeats)
                except Exception as error:  # a tile that does not fit shared memory: record, go on
                    sweep.append({"config": [block_n, warps, stages], "splits": splits, "error": repr(error)[:200]})
                    continue
                sweep.append({"config": [block_n, warps, stages], "splits": splits, **t,
                              "tb_s": kv_bytes / (t["ms"] * 1e-3) / 1e12})
        case["triton_sweep"] = sweep
        ok = [s for s in sweep if "ms" in s]
        if ok:
            case["triton_best"] = min(ok, key=lambda s: s["ms"])
        kernel = time_ms(lambda: decode_attention(q, layer.k_pool, layer.v_pool, y, dec.rows, dec.block_tables,
                                                  dec.seq_lens, tokens_per_block=tpb, scale=scale,
                                                  num_splits=dec.num_splits), device, repeats=repeats)
        engine = time_ms(lambda: layer.attend(q, k, v, scale), device, repeats=repeats)
        # Baselines: contiguous K/V (the bandwidth roofline of SDPA), and gather-then-SDPA.
        kc = torch.randn(batch, hkv, ctx_len, d, device=device, dtype=dtype, generator=gen)
        vc = torch.randn(batch, hkv, ctx_len, d, device=device, dtype=dtype, generator=gen)
        qb = q[:, :, None, :].reshape(batch, hq, 1, d)
        contiguous = time_ms(lambda: F.scaled_dot_product_attention(qb, kc, vc, scale=scale, enable_gqa=True),
                             device, repeats=repeats)
        del kc, vc
        positions = torch.arange(ctx_len, device=device)
        slots = (dec.block_tables.long()[:, positions // tpb] * tpb + positions % tpb)  # (B, ctx)

        def gather_sdpa():
            kg = layer.k_pool[slots].transpose(1, 2)  # (B, Hkv, ctx, D)
            vg = layer.v_pool[slots].transpose(1, 2)
            return F.scaled_dot_product_attention(qb, kg, vg, scale=scale, enable_gqa=True)

        gathered = time_ms(gather_sdpa, device, repeats=repeats)
        for label, t in (("engine_layer", engine), ("decode_kernel_auto", kernel), ("sdpa_contiguous", contiguous),
                         ("gather_then_sdpa", gathered)):
            case[label] = {**t, "tb_s": kv_bytes / (t["ms"] * 1e-3) / 1e12}
        out[f"decode_{batch}x{ctx_len}"] = case
    del k_pool, v_pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _rel_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference||, in float32."""
    reference = reference.float()
    return float((out.float() - reference).norm() / reference.norm())


def triton_context_sweep(q, k, v, ctx, scale: float, flops: float, repeats: int, reference: torch.Tensor) -> list[dict]:
    """The Triton context kernel under each tile configuration: time, TFLOP/s, error against
    ``reference`` (flash-2's output)."""
    from tensorrt_llm._torch.attention_backend.kernels import has_triton

    if not has_triton():
        return []
    from tensorrt_llm._torch.attention_backend.triton_context import ContextConfig, context_attention_triton

    sweep = []
    for block_m, block_n, warps, stages in CONTEXT_CONFIGS:
        cfg = ContextConfig(block_m, block_n, warps, stages)

        def call():
            return context_attention_triton(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k, max(ctx.q_lens), scale,
                                            config=cfg)
        try:
            err = _rel_err(call(), reference)
            t = time_ms(call, q.device, repeats=repeats)
        except Exception as error:  # a tile that does not fit shared memory or registers: record, go on
            sweep.append({"config": [block_m, block_n, warps, stages], "error": repr(error)[:200]})
            continue
        sweep.append({"config": [block_m, block_n, warps, stages], **t, "tflops": flops / (t["ms"] * 1e-3) / 1e12,
                      "rel_err_vs_flash": err})
    return sweep


def _cudnn(q4, k4, v4, causal: bool, scale: float):
    """cuDNN attention on (1, H, L, D) views: (output, log-sum-exp (H, Lq), natural log)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q4.shape[1], q4.shape[2]).float()


def single_chunk_cudnn(q, k, v, new: int, total: int, scale: float):
    """One chunk of ``new`` queries over ``total`` keys (prefix, then itself) on cuDNN: the queries
    over their own keys (causal) and over the prefix (no mask), merged by log-sum-exp."""
    prefix = total - new
    q4 = q.transpose(0, 1)[None]  # (1, Hq, new, D)
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, Hkv, total, D)
    own, own_lse = _cudnn(q4, k4[:, :, prefix:], v4[:, :, prefix:], True, scale)
    if prefix == 0:
        return own[0].transpose(0, 1)
    past, past_lse = _cudnn(q4, k4[:, :, :prefix], v4[:, :, :prefix], False, scale)
    top = torch.maximum(own_lse, past_lse)  # (Hq, new)
    w_own = torch.exp(own_lse - top)[..., None]
    w_past = torch.exp(past_lse - top)[..., None]
    merged = (own[0].float() * w_own + past[0].float() * w_past) / (w_own + w_past)  # (Hq, new, D)
    return merged.to(q.dtype).transpose(0, 1)  # (new, Hq, D)


def cudnn_variant(q, k, v, new: int, total: int, scale: float, flops: float, repeats: int,
                  reference: torch.Tensor) -> dict:
    """cuDNN on this chunk: error against ``reference`` (flash-2's output), first call (plan
    build) and steady time."""
    device = q.device
    try:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = single_chunk_cudnn(q, k, v, new, total, scale)
        torch.cuda.synchronize(device)
        first_ms = (time.perf_counter() - t0) * 1e3
        err = _rel_err(out, reference)
        steady = time_ms(lambda: single_chunk_cudnn(q, k, v, new, total, scale), device, repeats=repeats)
    except Exception as error:  # private ops: may refuse these shapes on another torch
        return {"error": repr(error)[:300]}
    return {**steady, "tflops": flops / (steady["ms"] * 1e-3) / 1e12, "first_call_ms": first_ms,
            "rel_err_vs_flash": err}
