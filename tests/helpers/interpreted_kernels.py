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


def _fix_interpreter_for_numpy_2_4() -> None:
    # Triton's interpreter turns a loaded scalar (a 1-element array) into a loop bound with
    # int(array), which NumPy >= 2.4 refuses; read the element instead.
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


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


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _fix_interpreter_for_numpy_2_4()
    results = [run_case(s, hq, hkv) for s in (1, 2, 4) for hq, hkv in ((4, 2), (8, 1))]
    results += [run_context_case(bm, bn, hq, hkv) for bm, bn in ((16, 16), (32, 16), (16, 32)) for hq, hkv in ((4, 2), (3, 3))]
    results += [run_rope_case(hq, hkv, d) for hq, hkv, d in ((4, 2, 16), (3, 1, 8))]
    results += [run_case(s, 4, 2, fp8=True) for s in (1, 4)] + [run_context_case(16, 16, 4, 2, fp8=True)]
    # FP8 in float16 (the GPU's bf16/fp16 models), the 16-bit path with the table read ahead, and
    # FP8 tiles of 16 positions (several tiles a sequence, so the table read ahead is exercised).
    results += [run_case(s, 4, 2, fp8=True, half=True) for s in (1, 2)]
    results += [run_case(s, 8, 1, table_ahead=True, block_n=16) for s in (1, 4)]
    results += [run_case(s, 4, 2, fp8=True, half=half, block_n=16) for s in (1, 4) for half in (False, True)]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
