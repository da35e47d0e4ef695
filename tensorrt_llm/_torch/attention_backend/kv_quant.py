"""The KV cache's element type: the model's dtype (``"auto"``) or FP8 (``"fp8"``, ``float8_e4m3fn``).

``KvCacheConfig.dtype`` (upstream's key; vLLM's ``--kv-cache-dtype``) chooses it. An FP8 pool
takes one byte per element instead of two (bf16) or four (float32), so the same memory holds
twice (four times) the tokens: the pool's block count follows from its bytes. Each layer has a
K scale and a V scale (:class:`KvScales`, 1.0 unless a checkpoint gives them)::

    write   stored = saturate(k / k_scale) as float8_e4m3fn       |k / k_scale| > 448 -> +-448, never NaN
    read    k ~= stored * k_scale                                 (the model's dtype, or fp32 in a kernel)

Every read of K and V goes through the stored values, a forward's own new tokens included (the
backends attend to ``dequantize(quantize(k))`` for them too). So what a query attends to does not
depend on whether its prefix was computed in the same forward, in an earlier chunk or taken from
the prefix cache: greedy outputs stay equal with reuse on and off, chunked or not, as they do
with an unquantized cache. Where the pool is read (``cpu_paged``, ``paged``, the Triton kernels)
the stored values are widened before any arithmetic; moving blocks (copy, offload, onboard) moves
their bytes (``kv_storage``).

Scales from a checkpoint: :func:`kv_scales_from_checkpoint` reads the names vLLM, llm-compressor
and ModelOpt write (a per-tensor scale per layer; :func:`is_kv_scale_name`), the Hugging Face
loader returns them beside the model, and :func:`kv_scales_for_pool` says which an executor's
pool gets (the checkpoint's under ``fp8``; none under ``auto``, whose pool stores the model's
dtype) for ``create_py_executor(..., kv_scales=...)``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "FP8", "FP8_MAX", "KV_CACHE_DTYPES", "KvScales", "dequantize", "is_kv_scale_name", "is_quantized",
    "kv_cache_dtype", "kv_scales_for_pool", "kv_scales_from_checkpoint", "quantize",
]

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' element type for ``KvCacheConfig.dtype`` ``name`` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8
    raise ValueError(f"kv_cache_config.dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {name!r}")


def is_quantized(pool: torch.Tensor) -> bool:
    """Whether ``pool`` stores FP8 (reads dequantize, writes quantize)."""
    return pool.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as float8_e4m3fn, saturated to +-448 (a plain cast is not guaranteed to saturate)."""
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 values times ``scale``, in ``dtype`` (every e4m3 value is exact in bf16 and wider)."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale


@dataclass(frozen=True, slots=True)
class KvScales:
    """Per-layer K and V scales of an FP8 cache (``k[i]``, ``v[i]`` for layer ``i``)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KvScales needs one K and one V scale per layer, got {len(self.k)} and {len(self.v)}")
        for name, scales in (("k", self.k), ("v", self.v)):
            for i, s in enumerate(scales):
                if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0 < s < math.inf):
                    raise ValueError(f"KvScales.{name}[{i}] must be a finite number > 0, got {s!r}")

    @classmethod
    def unit(cls, num_layers: int) -> KvScales:
        """Every scale 1.0 (vLLM's and upstream's default without calibration)."""
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def is_unit(self) -> bool:
        return all(s == 1.0 for s in (*self.k, *self.v))

    def of(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of ``layer``."""
        return self.k[layer], self.v[layer]

    def describe(self) -> str:
        """The scales' ranges in a few words, for a log line: ``k 0.0156..0.5, v 0.0312..0.25``."""
        return ", ".join(f"{name} {min(s):.3g}" + (f"..{max(s):.3g}" if max(s) != min(s) else "")
                         for name, s in (("k", self.k), ("v", self.v)))


def kv_scales_for_pool(kv_cache_dtype_name: str, scales: KvScales | None) -> KvScales | None:
    """The scales a pool of ``KvCacheConfig.dtype`` ``kv_cache_dtype_name`` is built with: a
    checkpoint's ``scales`` under ``fp8``; None under ``auto``, whose pool stores the model's own
    dtype, where a scale would mean nothing (vLLM ignores them there too). Never a dtype switch."""
    kv_cache_dtype(kv_cache_dtype_name, torch.float32)  # a ValueError naming the field for anything else
    return scales if kv_cache_dtype_name == "fp8" else None


# Where a checkpoint keeps a layer's KV scales (one scalar each): vLLM / llm-compressor
# ``self_attn.{k,v}_scale``; ModelOpt ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` or
# ``.output_scale`` (older compressed-tensors too); older exports one ``self_attn.kv_scale`` for both.
_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.(?:\3_scale|output_scale)|(kv)_scale)$"
)


def is_kv_scale_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint tensor :func:`kv_scales_from_checkpoint` reads (a layer's K or V scale)."""
    return _SCALE_NAME.match(name) is not None


def kv_scales_from_checkpoint(tensors: Mapping[str, Any], num_layers: int) -> KvScales | None:
    """The per-layer KV scales ``tensors`` (a checkpoint's name -> tensor or number) carries, or
    None when it carries none. A layer without its own scale gets 1.0 (logged as a warning that
    names the layers); a name for a layer past ``num_layers``, a second scale for the same layer's
    K or V, or a scale that is not one positive finite number is a ValueError naming the tensor."""
    k, v = [1.0] * num_layers, [1.0] * num_layers
    given: dict[tuple[int, str], str] = {}  # (layer, "k" | "v") -> the tensor that gave it
    for name, value in tensors.items():
        match = _SCALE_NAME.match(name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"checkpoint tensor {name!r} names layer {layer}, the model has {num_layers}")
        scale = value
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r}: a per-tensor KV scale is one number, got shape "
                                 f"{tuple(value.shape)}")
            scale = float(value.reshape(-1)[0])
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
            raise ValueError(f"checkpoint tensor {name!r}: a KV scale must be a finite number > 0, got {scale!r}")
        which = match.group(2) or match.group(3) or match.group(4)
        for part, scales in (("k", k), ("v", v)):
            if part in which:
                if (other := given.get((layer, part))) is not None:
                    raise ValueError(f"checkpoint tensors {other!r} and {name!r} both give layer {layer}'s "
                                     f"{part.upper()} scale")
                given[layer, part] = name
                scales[layer] = float(scale)
    if not given:
        return None
    missing = [f"{part.upper()} of layer {layer}" for layer in range(num_layers) for part in "kv"
               if (layer, part) not in given]
    if missing:
        logger.warning("the checkpoint has no KV scale for %s%s: 1.0 there", ", ".join(missing[:8]),
                       " ..." if len(missing) > 8 else "")
    return KvScales(tuple(k), tuple(v))
