"""Linear methods: how a ``Linear`` multiplies by a weight it keeps in a format of its own (upstream's
``quant_method``), chosen once at load. A ``Linear`` without one runs ``F.linear`` on its ``weight``.

On the CPU every method is one call to a kernel torch ships, over a weight packed at load::

    method                stored (bytes a weight)             kernel                                      x and y
    Float16PackedMethod   float16 in fbgemm's layout (2)      quantized::linear_dynamic_fp16 (widens the  float32
                                                              weights to float32 in registers)
    Int4GroupMethod       4-bit codes, a bfloat16 scale and   aten::_weight_int4pack_mm_for_cpu, groups   bfloat16
                          zero per 32 weights of a row        of 32 (float32 accumulation)
                          (0.625; GGUF Q8_0 1.25, below)

The int4 kernel computes ``y = x @ W.T`` with, for the code ``c`` (0..15) of weight ``k`` of row ``n``
and the scale ``s`` and zero ``z`` of its group ``g = k // 32``::

    W[n, k] = (c - 8) * s[g, n] + z[g, n]        (qScaleAndZeros: (K / 32, N, 2), x's dtype)

GGUF's block formats (ggml: a block is 32 consecutive weights of a row, with float16 constants)
map onto it exactly, but for the constants rounded to bfloat16 (relative error <= 2**-9):

    Q4_0   W = d * (q - 8),  q in 0..15        codes q, scale d, zero 0
    Q4_1   W = d * q + m,    q in 0..15        codes q, scale d, zero m + 8d
    Q8_0   W = d * q,        q in -128..127    q = 16h + l, h in -8..7, l in 0..15: two int4 planes
                                               side by side along K, [h + 8 | l] with (16d, 0) and
                                               (d, 8d), multiplied by [x | x] (one call, K doubled)

Torch's own int8 kernel (``_weight_int8pack_mm``) takes one scale per row, which Q8_0's per-block
scales cannot become without rounding the weights again; on this project's CPU it is also slower
than the int4 kernel at batch 1 and falls far behind past it (``docs/cpu-decode.md``).

Methods are built from *sources*, a layer's rows in the file's form (a dense tensor, or a
:class:`BlockQuantizedWeight`), and several layers that read the same input (q/k/v, gate/up) can
share one method over their rows stacked (:func:`linear_method` with several sources): one
kernel call instead of three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = [
    "BLOCK_FORMATS", "BlockQuantizedWeight", "Float16PackedMethod", "Int4GroupMethod", "LinearMethod", "linear_method",
    "logits_method",
]

GROUP = 32  # weights per GGUF block, and the int4 kernel's group size here
BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF block formats a model keeps (BlockQuantizedWeight)
_INT4_ROWS = 16  # the int4 packing's row granularity (_convert_weight_to_int4pack_for_cpu)


class LinearMethod(Protocol):
    """``apply(x)``: ``x @ W.T (+ bias)`` for x (T, in_features) in :attr:`dtype` -> (T, out_features),
    from the weight as the method stores it."""

    dtype: torch.dtype  # what x must be, and what y is
    weight_bytes: int  # bytes a forward reads: every stored weight and constant once
    format: str  # what it stores, for logs and reports ("int4 groups of 32 (GGUF Q4_1)", ...)
    # the layer's dense weight is dropped once the method holds it (a second copy in the same
    # dtype would double the model's memory); False: kept (float16-weights keeps its float32 weights)
    replaces_weight: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class BlockQuantizedWeight:
    """A (rows, cols) weight in one of GGUF's block formats, unpacked: per block of 32 consecutive
    weights of a row, ``W = scales * codes + offsets`` (Q4_0: ``scales * (codes - 8)``). The
    constants are the file's float16 values, widened to float32 exactly.

    ``codes``: (rows, cols) uint8 0..15 (Q4_0, Q4_1) or int8 (Q8_0); ``scales``, ``offsets``:
    (rows, cols / 32) float32 (``offsets`` only for Q4_1)."""

    kind: str  # one of BLOCK_FORMATS
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_FORMATS:
            raise ValueError(f"block format {self.kind!r} is not one of {BLOCK_FORMATS}")
        rows, cols = self.codes.shape
        if cols % GROUP or tuple(self.scales.shape) != (rows, cols // GROUP):
            raise ValueError(f"{self.kind}: codes {tuple(self.codes.shape)} and scales {tuple(self.scales.shape)} "
                             f"do not make blocks of {GROUP}")
        if (self.offsets is not None) != (self.kind == "Q4_1"):
            raise ValueError(f"{self.kind}: offsets are Q4_1's alone")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight (rows, cols), float32, as ``gguf.quants.dequantize`` computes it."""
        rows, cols = self.codes.shape
        codes = self.codes.to(torch.float32).view(rows, cols // GROUP, GROUP)
        if self.kind == "Q4_0":
            codes = codes - 8
        w = codes * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(rows, cols)

    def rows_permuted(self, order: torch.Tensor) -> BlockQuantizedWeight:
        """The same weight with its rows in ``order`` (blocks lie within rows, so this is exact)."""
        offsets = None if self.offsets is None else self.offsets[order]
        return BlockQuantizedWeight(self.kind, self.codes[order], self.scales[order], offsets)

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The int4 kernel's form (module docstring): codes (rows, K') int32 0..15, scales and zeros
        (rows, K' / 32) float32, and how many times x is repeated along K (K' = that times cols)."""
        if self.kind == "Q4_0":
            return self.codes.to(torch.int32), self.scales, torch.zeros_like(self.scales), 1
        if self.kind == "Q4_1":
            return self.codes.to(torch.int32), self.scales, self.offsets + 8 * self.scales, 1
        q = self.codes.to(torch.int32)
        high = torch.div(q, 16, rounding_mode="floor")  # -8..7
        low = q - 16 * high  # 0..15
        codes = torch.cat((high + 8, low), dim=1)  # (rows, 2 * cols): [h + 8 | l]
        scales = torch.cat((16 * self.scales, self.scales), dim=1)
        zeros = torch.cat((torch.zeros_like(self.scales), 8 * self.scales), dim=1)
        return codes, scales, zeros, 2


Source = torch.Tensor | BlockQuantizedWeight


# --------------------------------------------------------------------------- the methods


class Float16PackedMethod:
    """float32 x times a weight rounded to float16, packed for fbgemm's fp16 GEMM (x86, AVX2 or better).
    ``input_dtype``: what x is (widened to float32 first); y is float32 whatever x is, which is
    what a bfloat16 model's LM head uses it for (float32 logits: see :func:`logits_method`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 input_dtype: torch.dtype = torch.float32) -> None:
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"float16 packing needs a float32 weight on the CPU, got {weight.dtype} "
                             f"on {weight.device.type}")
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), bias)
        self.dtype = input_dtype
        self._widen = input_dtype != torch.float32
        self.weight_bytes = weight.numel() * 2
        self.format = "float16 (fbgemm)"
        self.replaces_weight = False

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self._widen:
            x = x.float()
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)  # (T, out), float32


class Int4GroupMethod:
    """x times a GGUF block-quantized weight kept in 4-bit codes (module docstring): torch's int4
    kernel, groups of 32, bfloat16 x."""

    dtype = torch.bfloat16

    def __init__(self, weights: Sequence[BlockQuantizedWeight], bias: torch.Tensor | None = None) -> None:
        """``weights``: one layer's, or several stacked by rows (one output column range each);
        all of one K' and repeat (:meth:`BlockQuantizedWeight.int4_groups`)."""
        parts = [w.int4_groups() for w in weights]
        repeats = {p[3] for p in parts}
        widths = {p[0].shape[1] for p in parts}
        if len(repeats) != 1 or len(widths) != 1:
            raise ValueError("stacked int4 weights must share their width and format")
        codes = torch.cat([p[0] for p in parts])  # (N, K')
        scales = torch.cat([p[1] for p in parts])  # (N, K' / 32)
        zeros = torch.cat([p[2] for p in parts])
        rows, width = codes.shape
        if rows % _INT4_ROWS:
            raise ValueError(f"the int4 kernel packs rows by {_INT4_ROWS}: {rows} rows do not divide")
        self.repeat = repeats.pop()
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # (N, K' / 2) uint8
        # (K' / 32, N, 2): each group's scale and zero, side by side
        self._scales_and_zeros = torch.stack((scales.T, zeros.T), dim=-1).to(torch.bfloat16).contiguous()
        self._bias = None if bias is None else bias.to(torch.bfloat16)
        self.weight_bytes = self._packed.numel() + self._scales_and_zeros.numel() * 2
        kinds = sorted({w.kind for w in weights})
        self.format = f"int4 groups of {GROUP} (GGUF {'/'.join(kinds)})"
        self.replaces_weight = True

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat == 2:
            x = torch.cat((x, x), dim=-1)  # (T, 2K): the Q8_0 planes' inputs
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, GROUP, self._scales_and_zeros)
        return y if self._bias is None else y + self._bias


# --------------------------------------------------------------------------- choosing one


def logits_method(source: Source, dtype: torch.dtype) -> LinearMethod | None:
    """The LM head's method in a bfloat16 model that keeps GGUF blocks, on the CPU: fbgemm's float16 GEMM, which returns
    float32 logits. A bfloat16 kernel's logits are rounded to 8 significant bits (a step of 0.125
    at 16 to 32, where SmolLM2's top logits lie), which ties greedy picks and coarsens every
    log-probability; the float16 copy of a Q8_0 head (d * q, rounded to 11 bits) is also faster
    here than its int4 planes, at batch 1 and at 16 (``docs/cpu-decode.md``). None elsewhere (the
    layer's own method, or ``F.linear``)."""
    if dtype != torch.bfloat16 or "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    dense = source.dequantize() if isinstance(source, BlockQuantizedWeight) else source.float()
    if dense.device.type != "cpu":
        return None
    return Float16PackedMethod(dense, input_dtype=dtype)



def linear_method(sources: Sequence[Source], dtype: torch.dtype, *, float16_weights: bool = False,
                  bias: torch.Tensor | None = None) -> LinearMethod | None:
    """The method for a layer (or several stacked by rows) whose weights are ``sources``, in a model
    whose activations are ``dtype``; None where ``F.linear`` on the dense weight is what runs.

    GGUF blocks -> :class:`Int4GroupMethod` (bfloat16 activations only: the int4 kernel's float32
    path is ~20x slower); dense weights of a ``float16-weights`` model -> :class:`Float16PackedMethod`.
    Dense bfloat16 weights keep ``F.linear``: oneDNN's packed bfloat16 runs a decode step's GEMMs
    in about 0.6x its time on an AVX512-BF16 CPU, but the packed copy could not be made without
    raising a checkpoint load's peak memory by a third (``docs/cpu-decode.md``).
    ``bias``: the stacked layers' biases (None: none, or the caller adds it)."""
    blocks = [s for s in sources if isinstance(s, BlockQuantizedWeight)]
    if blocks:
        if len(blocks) != len(sources):
            raise ValueError("a stacked method cannot mix GGUF blocks with dense weights")
        if dtype != torch.bfloat16:
            raise ValueError(f"GGUF block-quantized weights run with bfloat16 activations, not {dtype}")
        return Int4GroupMethod(blocks, bias)
    dense = torch.cat(list(sources)) if len(sources) > 1 else sources[0]
    if dense.device.type != "cpu":
        return None
    if float16_weights:
        return Float16PackedMethod(dense, bias)
    return None
