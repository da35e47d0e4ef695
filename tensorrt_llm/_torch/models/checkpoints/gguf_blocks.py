"""GGUF's block-quantized tensors read as they are stored, without dequantising them.

ggml stores a quantized (rows, cols) matrix row by row, each row as ``cols / 32`` blocks of 32
consecutive weights; a block is its float16 constants followed by its codes::

    Q8_0   34 bytes   d (f16) | q[32] (int8)                     w[j] = d * q[j]
    Q4_0   18 bytes   d (f16) | qs[16]                           w[j] = d * (q[j] - 8)
    Q4_1   20 bytes   d (f16) | m (f16) | qs[16]                 w[j] = d * q[j] + m
                      q[j] = qs[j] & 0xF, q[j + 16] = qs[j] >> 4 (j < 16)

:func:`read_blocks` unpacks a tensor's bytes with whole-array numpy operations (no loop over
blocks) into a :class:`BlockQuantizedWeight` (``modules/linear_methods``): codes, scales and
offsets, whose :meth:`~BlockQuantizedWeight.dequantize` equals ``gguf.quants.dequantize`` (the
loader tests check it on every format).
"""

from __future__ import annotations

import numpy as np
import torch

from tensorrt_llm._torch.modules.linear_methods import BLOCK_FORMATS, GROUP, BlockQuantizedWeight

__all__ = ["BLOCK_BYTES", "read_blocks"]

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def read_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> BlockQuantizedWeight:
    """The (rows, cols) matrix whose GGUF bytes are ``data`` (as ``GGUFReader`` maps them: uint8,
    one row of blocks per row), in block format ``kind`` (one of ``BLOCK_FORMATS``)."""
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"block format {kind!r} is not one of {BLOCK_FORMATS}")
    if cols % GROUP:
        raise ValueError(f"a {kind} row of {cols} weights is not a whole number of blocks of {GROUP}")
    size = BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // GROUP, size)
    scales = _f16(blocks[..., 0:2])  # (rows, blocks)
    if kind == "Q8_0":
        codes = blocks[..., 2:].view(np.int8).reshape(rows, cols)
        return BlockQuantizedWeight(kind, torch.from_numpy(codes.copy()), scales)
    packed = blocks[..., size - GROUP // 2 :]  # (rows, blocks, 16)
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)  # low nibbles first
    offsets = _f16(blocks[..., 2:4]) if kind == "Q4_1" else None
    return BlockQuantizedWeight(kind, torch.from_numpy(codes), scales, offsets)


def _f16(pairs: np.ndarray) -> torch.Tensor:
    """(rows, blocks, 2) bytes of little-endian float16 -> (rows, blocks) float32, exactly."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view("<f2")[..., 0].astype(np.float32))
