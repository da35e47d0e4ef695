"""A checkpoint's quantization config -> what it says about the KV cache, or a CheckpointError
naming the key.

The engine runs unquantized weights and activations. A checkpoint whose quantization config
quantizes **only the KV cache** (plain floating-point weights, beside a K and a V scale per
layer) is accepted, in the spellings the exporters write:

==========================  =================================================================
llm-compressor              ``config.json`` ``quantization_config``: ``quant_method:
(compressed-tensors)        compressed-tensors``; ``kv_cache_scheme: {type: float, num_bits: 8,
                            strategy: tensor, symmetric: true, dynamic: false}``; no weight or
                            activation ``config_groups`` (absent, null or ``{}``), no
                            ``sparsity_config``, no ``transform_config``
ModelOpt                    ``hf_quant_config.json``: ``{"producer": {"name": "modelopt"},
                            "quantization": {"quant_algo": null, "kv_cache_quant_algo": "FP8"}}``;
                            or ``config.json`` ``quantization_config`` with ``quant_method:
                            modelopt``, that nested shape or flat (``quant_algo: null`` beside
                            ``kv_cache_quant_algo: FP8``, or ModelOpt 1.x's ``kv_cache_scheme``)
==========================  =================================================================

Anything that quantizes weights or activations is refused with an error naming the key and
what it quantizes: a ``config_groups`` entry, a ``quant_algo``, ``quantized_layers``, sparsity or
transforms, and every other ``quant_method`` (``gptq``, ``awq``, ``fp8``, ``bitsandbytes``, ...).
So is a KV cache scheme the engine does not store: a scale per head (``strategy: attn_head``),
scales computed at run time (``dynamic``), asymmetric ones, NVFP4 or INT8.

The answer is a value, :class:`KvCacheQuantization` (None: the config quantizes nothing), which
``HFConfig`` carries. Which scales a pool gets is decided where the pool's dtype is known
(``attention_backend.kv_quant.kv_scales_for_pool``): the config recommends FP8, it never switches
``kv_cache_config.dtype``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["KvCacheQuantization", "kv_cache_quantization"]

COMPRESSED_TENSORS, MODELOPT = "compressed-tensors", "modelopt"

#: keys of a compressed-tensors config that change nothing once no weight is quantized
_COMPRESSED_TENSORS_INERT = {"quant_method", "format", "ignore", "quantization_status", "global_compression_ratio",
                             "version", "kv_cache_scheme", "config_groups", "sparsity_config", "transform_config"}
#: keys of a ModelOpt config (either shape) that change nothing once no weight is quantized
_MODELOPT_INERT = {"quant_method", "producer", "quantization", "quant_algo", "kv_cache_quant_algo", "kv_cache_scheme",
                   "exclude_modules", "ignore", "group_size", "has_zero_point", "pre_quant_scale", "quantized_layers",
                   "config_groups"}
_NONE_SPELLINGS = ("", "none", "null")  # ModelOpt writes "no KV quantization" as null or as one of these


@dataclass(frozen=True, slots=True)
class KvCacheQuantization:
    """A checkpoint quantizes its KV cache, and nothing else: per-layer K and V scales beside
    unquantized weights, meant for a KV cache of ``kv_cache_dtype``."""

    kv_cache_quant_algo: str  # upstream's name for it: "FP8" (float8_e4m3fn, one scale per tensor)
    quant_method: str  # who wrote it: "compressed-tensors" (llm-compressor) or "modelopt"
    source: str  # the file and the key that say so

    @property
    def kv_cache_dtype(self) -> str:
        """The ``kv_cache_config.dtype`` the scales were calibrated for."""
        return "fp8"

    def describe(self) -> str:
        return f"{self.kv_cache_quant_algo} KV cache ({self.quant_method}, {self.source})"


def kv_cache_quantization(raw: Any, *, source: str, key: str = "") -> KvCacheQuantization | None:
    """What the quantization config ``raw`` says about the KV cache: a :class:`KvCacheQuantization`,
    or None when it quantizes nothing. ``source`` is its file and ``key`` its key there
    (``quantization_config`` in config.json; empty for hf_quant_config.json, the config itself),
    for errors. Raises CheckpointError naming the key for anything that quantizes weights or
    activations, or a KV scheme the engine cannot store."""
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return None
    where = _Where(source, key)
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{where.name()} must be an object, got {raw!r:.80}")
    method = raw.get("quant_method")
    normalized = method.lower().replace("_", "-") if isinstance(method, str) else method
    if normalized == COMPRESSED_TENSORS:
        return _compressed_tensors(raw, where)
    if (isinstance(normalized, str) and normalized.startswith(MODELOPT)) or _producer(raw) == MODELOPT or (
            method is None and "quantization" in raw):
        return _modelopt(raw, where)
    what = (f"quant_method {method!r} quantizes the weights" if method is not None
            else "it names no quant_method, so what it quantizes is unknown")
    raise CheckpointError(f"{where.name()}={dict(raw)!r:.120} is not supported ({what});"
                          f" the engine runs unquantized weights. {_ACCEPTED}")


@dataclass(frozen=True, slots=True)
class _Where:
    """Names a key of the config in errors: ``config.json: quantization_config.kv_cache_scheme``."""

    source: str
    key: str

    def name(self, *keys: str) -> str:
        path = ".".join(k for k in (self.key, *keys) if k)
        return f"{self.source}: {path}" if path else self.source


_ACCEPTED = ("Accepted: a quantization config that quantizes only the KV cache to FP8 (compressed-tensors"
             " kv_cache_scheme without config_groups; ModelOpt quant_algo null with kv_cache_quant_algo FP8).")


# --------------------------------------------------------------------------- compressed-tensors


def _compressed_tensors(raw: Mapping[str, Any], where: _Where) -> KvCacheQuantization | None:
    _refuse_config_groups(raw.get("config_groups"), where.name("config_groups"))
    for key, what in (("sparsity_config", "sparse (pruned) weights"), ("transform_config", "rotated weights")):
        if raw.get(key):
            raise CheckpointError(f"{where.name(key)} describes {what}; the engine runs the weights as they are"
                                  f" stored only. {_ACCEPTED}")
    _warn_unknown(raw, _COMPRESSED_TENSORS_INERT, where.name())
    scheme = raw.get("kv_cache_scheme")
    if scheme is None:
        logger.info("%s: a compressed-tensors config that quantizes nothing (no config_groups, no kv_cache_scheme)",
                    where.name())
        return None
    _check_kv_scheme(scheme, where.name("kv_cache_scheme"))
    return KvCacheQuantization("FP8", COMPRESSED_TENSORS, where.name("kv_cache_scheme"))


def _refuse_config_groups(groups: Any, key: str) -> None:
    """``config_groups`` quantize weights and activations: only an empty one is accepted."""
    if not groups:
        return
    if not isinstance(groups, Mapping):
        raise CheckpointError(f"{key} must be an object of quantization groups, got {groups!r:.80}")
    name, group = next(iter(groups.items()))
    if not isinstance(group, Mapping):
        raise CheckpointError(f"{key}.{name} must be an object, got {group!r:.80}")
    parts = [f"{part} ({_describe_args(group[part])})" for part in ("weights", "input_activations",
                                                                   "output_activations") if group.get(part)]
    targets = group.get("targets")
    raise CheckpointError(f"{key}.{name} quantizes {' and '.join(parts) or 'modules'} of {targets!r:.80}; the engine"
                          f" runs unquantized weights and activations. {_ACCEPTED}")


def _describe_args(args: Any) -> str:
    if not isinstance(args, Mapping):
        return repr(args)[:40]
    words = [f"{args.get('num_bits', '?')}-bit {args.get('type', '?')}", str(args.get("strategy") or "")]
    return " ".join(w for w in words if w)


def _check_kv_scheme(scheme: Any, key: str) -> None:
    """A compressed-tensors ``QuantizationArgs`` for the KV cache: 8-bit float, one static symmetric
    scale per tensor (what vLLM accepts too); anything else is a CheckpointError naming the field."""
    if not isinstance(scheme, Mapping):
        raise CheckpointError(f"{key} must be an object, got {scheme!r:.80}")
    if (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
        raise CheckpointError(f"{key}: type={scheme.get('type')!r}, num_bits={scheme.get('num_bits')!r} is not"
                              " supported; the engine's quantized KV cache is FP8 (type float, num_bits 8)")
    if scheme.get("strategy") not in (None, "tensor"):
        raise CheckpointError(f"{key}.strategy={scheme['strategy']!r} is not supported; the engine keeps one K and"
                              " one V scale per layer (strategy tensor)")
    if scheme.get("dynamic") not in (None, False):
        raise CheckpointError(f"{key}.dynamic={scheme['dynamic']!r} is not supported (scales computed at run time);"
                              " the engine reads static scales from the checkpoint")
    if scheme.get("symmetric") not in (None, True):
        raise CheckpointError(f"{key}.symmetric={scheme['symmetric']!r} is not supported; FP8 scales are symmetric")


# --------------------------------------------------------------------------- ModelOpt


def _producer(raw: Mapping[str, Any]) -> str | None:
    producer = raw.get("producer")
    return producer.get("name") if isinstance(producer, Mapping) else None


def _modelopt(raw: Mapping[str, Any], where: _Where) -> KvCacheQuantization | None:
    """Either shape: the ``quantization`` object of hf_quant_config.json (also found inside a
    config.json), or the flat one ModelOpt writes into config.json."""
    _warn_unknown(raw, _MODELOPT_INERT, where.name())
    inner, nested = raw, ""
    if "quantization" in raw:
        inner, nested = raw["quantization"], "quantization"
        if not isinstance(inner, Mapping):
            raise CheckpointError(f"{where.name(nested)} must be an object, got {inner!r:.80}")
        _warn_unknown(inner, _MODELOPT_INERT, where.name(nested))
    algo = inner.get("quant_algo")
    if not _is_none(algo):
        raise CheckpointError(f"{where.name(nested, 'quant_algo')}={algo!r} is not supported (it quantizes the"
                              f" weights); the engine runs unquantized weights. {_ACCEPTED}")
    if inner.get("quantized_layers"):
        layers = inner["quantized_layers"]
        first = next(iter(layers)) if isinstance(layers, Mapping) and layers else layers
        raise CheckpointError(f"{where.name(nested, 'quantized_layers')} quantizes the weights of {first!r:.80} ...;"
                              f" the engine runs unquantized weights. {_ACCEPTED}")
    _refuse_config_groups(inner.get("config_groups"), where.name(nested, "config_groups"))
    kv_key, kv = where.name(nested, "kv_cache_quant_algo"), inner.get("kv_cache_quant_algo")
    if _is_none(kv) and inner.get("kv_cache_scheme") is not None:
        kv_key, kv = where.name(nested, "kv_cache_scheme"), inner["kv_cache_scheme"]
        if isinstance(kv, Mapping):
            _check_kv_scheme(kv, kv_key)
            kv = "FP8"
    if _is_none(kv):
        logger.info("%s: a ModelOpt config that quantizes nothing (quant_algo and kv_cache_quant_algo null)",
                    where.name())
        return None
    if not isinstance(kv, str) or kv.upper() != "FP8":
        raise CheckpointError(f"{kv_key}={kv!r} is not supported; the engine's quantized KV cache is FP8"
                              " (float8_e4m3fn with one K and one V scale per layer)")
    return KvCacheQuantization("FP8", MODELOPT, kv_key)


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_SPELLINGS)


def _warn_unknown(raw: Mapping[str, Any], known: set[str], source: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        logger.warning("%s: keys the engine does not know, ignored: %s", source, ", ".join(unknown))
