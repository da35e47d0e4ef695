"""Run the Triton kernels under TRITON_INTERPRET=1 against their torch references.

Called by ``test_paged_attention`` in a fresh process (the interpreter must be on before Triton
is imported); prints one JSON line: per case, the kernel, the largest error and whether rows
the kernel must not write were left untouched.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from benchmarks.gpu.interpreter import fix_numpy_2_4


def run_case(num_splits: int, hq: int, hkv: int, fp8: bool = False, half: bool = False, table_ahead: bool | None = None,
             block_n: int | None = None) -> dict:
    """``fp8``: the pools hold an FP8 cache (stored with scales 0.5 and 2), read by the kernel as
    bytes and widened; the reference dequantizes after its gather. ``half``: float16 queries (an
    FP8 pool's dot products then run in float16, the softmax scale folded into q). ``table_ahead``,
    ``block_n``: a kernel shape other than the pool's default (``DecodeConfig``)."""
    from tensorrt_llm._torch.attention_backend.kernels import reference_decode_attention
    from tensorrt_llm._torch.attention_backend.kv_quant import quantize
    from tensorrt_llm._torch.attention_backend.triton_paged_decode import DecodeConfig, config_for, paged_decode_attention

    head_dim, tpb, num_blocks = 16, 4, 40
    gen = torch.Generator().manual_seed(10 * num_splits + hq)
    k_pool = torch.randn(num_blocks * tpb, hkv, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks * tpb, hkv, head_dim, generator=gen)
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    if fp8:
        k_pool, v_pool = quantize(k_pool, 0.5), quantize(v_pool, 2.0)
    lens = [1, 5, 17, 30, 64]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), 16, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // tpb)):
            tables[i, j] = free.pop()
    rows = torch.tensor([6, 0, 3, 4, 1])
    q = torch.randn(8, hq, head_dim, generator=gen)
    if half:
        q = q.half()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = torch.full_like(q, float("nan"), dtype=torch.float32)
    got = torch.full_like(q, float("nan"))
    reference_decode_attention(q.float(), k_pool, v_pool, expected, rows, tables, seq_lens, tokens_per_block=tpb,
                               scale=0.25, **scales)
    config = config_for(k_pool.dtype)
    if table_ahead is not None or block_n is not None:
        config = DecodeConfig(block_n=block_n or config.block_n, table_ahead=config.table_ahead if table_ahead is None
                              else table_ahead)
    paged_decode_attention(
        q, k_pool, v_pool, got, rows, tables, seq_lens, tokens_per_block=tpb, scale=0.25, num_splits=num_splits,
        config=config, **scales,
    )
    got = got.float()
    # float16 dot products: q, the probabilities and the output rounded to 11 bits.
    tolerance = 5e-3 if half else 1e-5
    return {
        "kernel": "paged_decode_fp8" if fp8 else "paged_decode",
        "dtype": str(q.dtype), "config": repr(config), "tolerance": tolerance,
        "num_splits": num_splits,
        "heads": [hq, hkv],
        "untouched_rows_nan": bool(torch.isnan(got[[2, 5, 7]]).all()),
        "max_abs_err": float((got[rows] - expected[rows]).abs().max()),
    }


def run_rope_case(hq: int, hkv: int, head_dim: int) -> dict:
    from tensorrt_llm._torch.attention_backend.triton_rope import rotate_qk_
    from tensorrt_llm._torch.models.modeling_llama import apply_rotary

    gen = torch.Generator().manual_seed(hq * head_dim)
    tokens = 5
    q = torch.randn(tokens, hq, head_dim, generator=gen)
    k = torch.randn(tokens, hkv, head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotate_qk_(q, k, cos, sin)
    err = max(float((q - expected_q).abs().max()), float((k - expected_k).abs().max()))
    return {"kernel": "rope", "heads": [hq, hkv], "untouched_rows_nan": True, "max_abs_err": err}


def run_context_case(block_m: int, block_n: int, hq: int, hkv: int, fp8: bool = False) -> dict:
    """``fp8``: K and V are an FP8 cache's stored values (scales 0.5 and 2)."""
    from tensorrt_llm._torch.attention_backend.kernels import reference_context_attention
    from tensorrt_llm._torch.attention_backend.kv_quant import dequantize, quantize
    from tensorrt_llm._torch.attention_backend.triton_context import ContextConfig, context_attention_triton

    head_dim = 16
    gen = torch.Generator().manual_seed(block_m * block_n + hq)
    # No prefix, a long prefix, one query over a prefix, a chunk ending on a tile edge, and one
    # shorter than a tile after a prefix that is not a tile multiple.
    q_lens, k_lens = (5, 33, 1, 32, 7), (5, 70, 9, 48, 26)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=gen)
    k = torch.randn(sum(k_lens), hkv, head_dim, generator=gen)
    v = torch.randn(sum(k_lens), hkv, head_dim, generator=gen)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    scales = {}
    if fp8:
        k, v = quantize(k, 0.5), quantize(v, 2.0)
        scales = dict(k_scale=0.5, v_scale=2.0)
        expected = reference_context_attention(q, dequantize(k, 0.5, q.dtype), dequantize(v, 2.0, q.dtype), q_lens, k_lens,
                                               0.3)
    else:
        expected = reference_context_attention(q, k, v, q_lens, k_lens, 0.3)
    got = context_attention_triton(q, k, v, cu_q, cu_k, max(q_lens), 0.3,
                                   config=ContextConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1),
                                   **scales)
    # The kernel writes a fresh output whole: "untouched" here means no row left unwritten (empty_like's garbage).
    return {"kernel": "context_fp8" if fp8 else "context", "tiles": [block_m, block_n], "heads": [hq, hkv],
            "untouched_rows_nan": bool(torch.isfinite(got).all()), "max_abs_err": float((got - expected).abs().max())}


def run_kv_write_case(fp8: bool, rotate: bool) -> dict:
    """RoPE of q, k and the K/V write in one kernel (``triton_kv_write``) against torch's path
    (``kernels.rotate_and_write`` on the CPU): the same rotated q, k and the same pool bytes."""
    from tensorrt_llm._torch.attention_backend.kernels import rotate_and_write
    from tensorrt_llm._torch.attention_backend.kv_quant import FP8
    from tensorrt_llm._torch.attention_backend.triton_kv_write import rotate_and_write_kv_

    gen = torch.Generator().manual_seed(7 + fp8 + 2 * rotate)
    tokens, hq, hkv, d, slots_total = 6, 4, 2, 16, 40
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 40  # a fused projection's output: strided views
    q, k, v = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d), \
        qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    angles = torch.rand(tokens, d // 2, generator=gen) * 6.0
    cos, sin = (angles.cos(), angles.sin()) if rotate else (None, None)
    slots = torch.randperm(slots_total, generator=gen)[:tokens]
    dtype = FP8 if fp8 else torch.float32
    scales = dict(k_scale=0.37, v_scale=2.5) if fp8 else {}
    pools, rotated = [], []
    for fn in ("torch", "triton"):
        qq, kk, vv = (t.clone() for t in (q, k, v))
        k_pool = torch.zeros(slots_total, hkv, d).to(dtype)
        v_pool = torch.zeros(slots_total, hkv, d).to(dtype)
        if fn == "torch":
            rotate_and_write(qq, kk, vv, cos, sin, k_pool, v_pool, slots, **scales)
        else:
            rotate_and_write_kv_(qq if rotate else None, kk, vv, cos, sin, k_pool, v_pool, slots, **scales)
        pools.append(torch.stack((k_pool.view(torch.uint8) if fp8 else k_pool, v_pool.view(torch.uint8) if fp8 else v_pool)))
        rotated.append(torch.cat((qq.reshape(-1), kk.reshape(-1))))
    same_bytes = bool(torch.equal(pools[0], pools[1]))
    if fp8 and not same_bytes:
        # Triton's interpreter casts float32 to e4m3 without carrying a rounded-up mantissa into
        # the exponent (124.95 -> 64, where the GPU's cvt.rn.satfinite gives 128): bytes may differ
        # only there, torch's value a power of two and the interpreter's half of it.
        expected = pools[0].view(FP8).float()
        got = pools[1].view(FP8).float()
        differ = expected != got
        power_of_two = torch.frexp(expected[differ])[0].abs() == 0.5
        same_bytes = bool(power_of_two.all() and torch.equal(got[differ] * 2, expected[differ]))
    err = float((rotated[0] - rotated[1]).abs().max() / rotated[0].abs().max())
    return {"kernel": "kv_write_fp8" if fp8 else "kv_write", "rotate": rotate,
            "untouched_rows_nan": same_bytes, "max_abs_err": err}


def run_fused_kernels_case() -> dict:
    """RMSNorm (+ residual add) and SiLU-and-mul (``modules/triton_fused``) against torch."""
    import torch.nn.functional as F

    from tensorrt_llm._torch.modules.triton_fused import add_rms_norm, rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(11)
    x, r = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    gu = torch.randn(5, 2 * 80, generator=gen)

    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * w

    s, h = add_rms_norm(x, r, w, 1e-5)
    errs = [(rms_norm(x, w, 1e-5) - norm(x)).abs().max(), (s - (x + r)).abs().max(), (h - norm(x + r)).abs().max(),
            (silu_and_mul(gu) - F.silu(gu[:, :80]) * gu[:, 80:]).abs().max()]
    return {"kernel": "norm_silu", "untouched_rows_nan": True, "max_abs_err": float(max(errs))}


def run_fused_model_case(kv_dtype: str, piecewise: bool) -> dict:
    """A small model's forward with its decoder layers fused (``models/fused_layers``: QKV and
    gate/up GEMMs, RoPE with the KV write, add + norm, SiLU-mul) against the same model unfused,
    over paged pools (a forward with chunks, one with a cached prefix and decodes): the same
    hidden states and pool bytes. ``piecewise``: the fused forward through the piecewise runner's
    pieces (eager on the CPU)."""
    import copy
    import dataclasses

    from tensorrt_llm._torch.attention_backend.kv_quant import kv_cache_dtype
    from tensorrt_llm._torch.attention_backend.paged import PagedPlanBuilder
    from tensorrt_llm._torch.models.fused_layers import FusedDecoderLayer, fuse_decoder_layers
    from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
    from tensorrt_llm._torch.pyexecutor.engine.piecewise_cuda_graph import PiecewiseGraphRunner

    config = dataclasses.replace(MODEL_PRESETS["small-random"], dtype="float32", seed=3, num_layers=2, qkv_bias=True)
    plain = LlamaForCausalLM(config)
    fused = copy.deepcopy(plain)
    assert fuse_decoder_layers(fused) == 2 and all(isinstance(layer, FusedDecoderLayer) for layer in fused.model.layers)
    tpb, num_blocks = 8, 16
    dtype = kv_cache_dtype(kv_dtype, torch.float32)
    builder = PagedPlanBuilder("cpu", tokens_per_block=tpb, num_blocks=num_blocks, num_kv_heads=config.num_kv_heads)
    shape = plain.kv_cache_shape(num_blocks, tpb)
    forwards = [  # (new, cached, tables): two prompts; then a chunk over a cached prefix and two decodes
        ([9, 5], [0, 0], [[0, 1], [2]]),
        ([4, 1, 1], [8, 9, 5], [[3, 4], [0, 1], [2]]),
    ]
    gen = torch.Generator().manual_seed(5)
    outs, pools = [], []
    for model in (plain, fused):
        k_cache = [torch.zeros(shape).to(dtype) for _ in range(config.num_layers)]
        v_cache = [torch.zeros(shape).to(dtype) for _ in range(config.num_layers)]
        runner = PiecewiseGraphRunner(model, num_tokens=[16]) if piecewise and model is fused else None
        hidden = []
        for new, cached, tables in forwards:
            ids = torch.randint(0, config.vocab_size, (sum(new),), generator=torch.Generator().manual_seed(sum(new)))
            positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new, cached)])
            plan = builder.build(new, cached, tables)
            forward = runner.forward if runner is not None else model.forward_with_plan
            hidden.append(forward(ids, positions, plan, k_cache, v_cache).clone())
        outs.append(torch.cat(hidden))
        pools.append(torch.stack([*k_cache, *v_cache]).float())
    del gen
    err = float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())
    pool_err = float((pools[0] - pools[1]).abs().max())
    return {"kernel": f"fused_model_{kv_dtype}" + ("_piecewise" if piecewise else ""), "pool_err": pool_err,
            "untouched_rows_nan": pool_err < (0.07 * float(pools[0].abs().max()) if kv_dtype == "fp8" else 1e-4),
            "max_abs_err": err, "tolerance": 1e-4}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    fix_numpy_2_4()
    results = [run_case(s, hq, hkv) for s in (1, 2, 4) for hq, hkv in ((4, 2), (8, 1))]
    results += [run_context_case(bm, bn, hq, hkv) for bm, bn in ((16, 16), (32, 16), (16, 32)) for hq, hkv in ((4, 2), (3, 3))]
    results += [run_rope_case(hq, hkv, d) for hq, hkv, d in ((4, 2, 16), (3, 1, 8))]
    results += [run_case(s, 4, 2, fp8=True) for s in (1, 4)] + [run_context_case(16, 16, 4, 2, fp8=True)]
    # FP8 in float16 (the GPU's bf16/fp16 models), the 16-bit path with the table read ahead, and
    # FP8 tiles of 16 positions (several tiles a sequence, so the table read ahead is exercised).
    results += [run_case(s, 4, 2, fp8=True, half=True) for s in (1, 2)]
    results += [run_case(s, 8, 1, table_ahead=True, block_n=16) for s in (1, 4)]
    results += [run_case(s, 4, 2, fp8=True, half=half, block_n=16) for s in (1, 4) for half in (False, True)]
    # the FP8 scores kernel with its table read ahead (the shape the GPU sweep times beside the default)
    results += [run_case(s, 4, 2, fp8=True, half=True, table_ahead=True, block_n=16) for s in (1, 4)]
    # The FP8 scores kernel over other query groups: one head a KV head, an odd group (padded to 8
    # columns), and 16 (two columns a head over 32).
    results += [run_case(s, hq, hkv, fp8=True, half=True) for s, (hq, hkv) in ((1, (2, 2)), (2, (6, 2)), (4, (16, 1)))]
    # The fused decoder layer's kernels and the whole fused forward.
    results += [run_kv_write_case(fp8, rotate) for fp8 in (False, True) for rotate in (False, True)]
    results += [run_fused_kernels_case()]
    results += [run_fused_model_case(kv, piecewise) for kv, piecewise in (("auto", False), ("fp8", False), ("auto", True))]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
