"""What the paged decode kernel compiles to on Hopper, without a GPU: registers, shared memory,
byte loads from shared memory and the pipeline's depth, for each pool's kernel shape.

Triton compiles ahead of time for a target it is given (``GPUTarget("cuda", 90, 32)``: sm_90,
the H100's and H200's) on any machine where it is installed (not a dependency of the project:
``pip install triton`` into your own environment); ``cuobjdump``, which Triton's package carries,
reads the registers off the cubin. What to look for (``docs/gpu.md``, the FP8 decode kernel): an
FP8 kernel with ``ld.shared.b8`` reads a transposed 8-bit operand a byte at a time, and one whose
loop waits with ``async_wait num = 0`` keeps a single tile in flight (the K tile's addresses come
from a block-table load, so every shape prefetches one tile ahead, in any number of stages, unless
the table is read a tile ahead: ``DecodeConfig.table_ahead``). For
the FP8 scores kernel: ``wgmma`` counts Hopper's warpgroup MMAs (``mma_sync`` the older ones),
``cvt.e4m3`` the e4m3x2 widenings in the PTX (V's only), ``barriers`` the CTA-wide barriers; the
registers bound how many programs share a multiprocessor (65536 / (registers x 128 threads))::

    python -m benchmarks.gpu.kernel_asm [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

SHAPES = {  # name: (kernel, pool element type, the DecodeConfig that ships, fields changed from it); the heads
    # of Llama-3.1-8B and Nemo (32 / 8 of 128)
    "bf16 (DEFAULT_CONFIG)": ("widened", "bf16", "DEFAULT_CONFIG", {}),
    "fp8 scores (FP8_CONFIG)": ("fp8_scores", "fp8e4nv", "FP8_CONFIG", {}),
    "fp8 widened (WIDENED_FP8_CONFIG)": ("widened", "fp8e4nv", "WIDENED_FP8_CONFIG", {}),
    # the shapes the GPU sweep times beside FP8_CONFIG with the table read a tile ahead
    "fp8 scores, table ahead": ("fp8_scores", "fp8e4nv", "FP8_CONFIG", {"table_ahead": True}),
    "fp8 scores, table ahead, 4 stages": ("fp8_scores", "fp8e4nv", "FP8_CONFIG", {"table_ahead": True, "num_stages": 4}),
}


def shipped_config(name: str) -> dict:
    """The fields of ``triton_paged_decode``'s config ``name``, as the kernel ships it."""
    from tensorrt_llm._torch.attention_backend import triton_paged_decode

    config = getattr(triton_paged_decode, name)
    return dict(block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
                table_ahead=config.table_ahead)


def compile_decode(kind: str, pool: str, config: dict, *, num_splits: int = 1) -> dict:
    """``kind``: ``widened`` (``_decode_kernel``, 16-bit dots) or ``fp8_scores`` (``_fp8_scores_kernel``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tensorrt_llm._torch.attention_backend import triton_paged_decode

    pointers = {"Q": "*bf16", "K": f"*{pool}", "V": f"*{pool}", "Out": "*bf16", "Acc": "*fp32", "ML": "*fp32",
                "rows": "*i64", "tables": "*i32", "seq_lens": "*i32"}
    constants = dict(GROUP=4, HEAD_DIM=128, TOKENS_PER_BLOCK=32, BLOCK_N=config["block_n"], NUM_SPLITS=num_splits,
                     NUM_Q_HEADS=32, TABLE_AHEAD=config["table_ahead"])
    if kind == "fp8_scores":
        fn = triton_paged_decode._fp8_scores_kernel
        constants.update(GROUP_PAD=8)
    else:
        fn = triton_paged_decode._decode_kernel
        constants.update(GROUP_PAD=16, IEEE=False, FP8=pool != "bf16")
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif "scale" in name:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    return {
        "shared_bytes": kernel.metadata.shared,
        "registers": _registers(kernel.asm["cubin"]),
        "ld_shared_b8": len(re.findall(r"ld\.shared\.b8", ptx)),
        "ldmatrix": len(re.findall(r"ldmatrix", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_sync": len(re.findall(r"mma\.sync", ptx)),
        "cvt_e4m3": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "barriers": len(re.findall(r"bar\.sync|barrier\.sync", ptx)),
        "async_wait_in_loop": re.findall(r"async_wait.*?\{num = (\d+)", ttgir),
        "k_buffers": sorted(set(re.findall(r"memdesc<(\d+)x\d+x128xf8E4M3FN|memdesc<(\d+)x\d+x128xbf16", ttgir))),
    }


def _registers(cubin: bytes) -> int | None:
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return None
    match = re.search(r"REG:(\d+)", text)
    return int(match.group(1)) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("not run: Triton is not installed here (pip install triton into your own environment)", file=sys.stderr)
        return 2
    configs = {name: {**shipped_config(config_name), **changed} for name, (_, _, config_name, changed) in SHAPES.items()}
    report = {name: {"kernel": kind, "pool": pool, **configs[name], **compile_decode(kind, pool, configs[name])}
              for name, (kind, pool, _, _) in SHAPES.items()}
    for name, r in report.items():
        print(f"{name:34s} {r['registers']} registers, {r['shared_bytes'] / 1024:.0f} KB shared, "
              f"{r['ld_shared_b8']} ld.shared.b8, {r['ldmatrix']} ldmatrix, {r['wgmma']} wgmma, {r['mma_sync']} mma.sync, "
              f"{r['cvt_e4m3']} cvt.e4m3, {r['barriers']} barriers, waits {r['async_wait_in_loop']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
