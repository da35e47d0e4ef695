"""A Hugging Face ``config.json`` -> :class:`LlamaConfig`, or a :class:`CheckpointError` naming the key.

Every key a checkpoint may carry has one entry in :data:`CONFIG_KEYS`, and so one of three fates:

* **used**: it sets the model (sizes, RoPE, biases, norms, tying, dtype, the window);
* **inert**: it cannot change what inference computes (training settings, bookkeeping, the
  generation defaults old versions of transformers wrote here; ``generation_config.json`` is
  read for those);
* **must keep its default**: the engine implements only the default, so any other value is
  refused (``hidden_act`` other than ``silu``, ``mlp_bias``, ``auto_map``, ...).

``quantization_config`` is used when it quantizes only the KV cache (FP8 K/V scales beside
unquantized weights, ``quant_config.py``) and refused, naming the key, when it quantizes weights
or activations. What it says is ``HFConfig.kv_cache_quantization``, a value; ModelOpt's
``hf_quant_config.json`` goes through the same rules (``hf_quant_config``).

A key in none of these is logged as a warning that names it, then ignored, as transformers
itself ignores it. Nothing else is ignored.

Absent keys take the value transformers' own config class gives them (:data:`ARCH_DEFAULTS`:
a Qwen3 without ``head_dim`` has 128, a Mistral without ``sliding_window`` a window of 4096),
and both spellings transformers writes are read: ``rope_theta`` + ``rope_scaling`` (4.x) and
``rope_parameters`` (5.x); ``torch_dtype`` and ``dtype``; ``layer_types``.

Two features change attention only past some length. The engine serves positions below it,
where they change nothing, and logs the limit (``HFConfig.notes``):

* a sliding window that some layer uses (Mistral's ``sliding_window``, Qwen's
  ``use_sliding_window`` with ``layer_types``): a query at ``i`` sees key ``j`` iff ``i - j <
  window``, which is every earlier key while a sequence holds at most ``window`` positions;
* ``dynamic`` RoPE scaling (see ``modules.rotary_embedding.RopeScaling``): fixed frequencies up to
  ``max_position_embeddings``, which the engine never passes anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError
from tensorrt_llm._torch.models.checkpoints.quant_config import KvCacheQuantization, kv_cache_quantization
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.modules.rotary_embedding import ROPE_TYPES, RopeScaling

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "ARCH_DEFAULTS", "CONFIG_KEYS", "HFConfig", "KeyRule", "llama_config_from_hf"]

#: The architectures the engine runs (``config.json`` ``architectures``) -> their ``model_type``.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

USED, INERT, DEFAULT = "used", "inert", "must keep its default"


@dataclass(frozen=True, slots=True)
class KeyRule:
    kind: str  # USED, INERT or DEFAULT
    why: str
    default: Any = None  # DEFAULT: the only value accepted (None: the key must be absent or null)
    model_types: tuple[str, ...] = ()  # USED only for these (others: not a key of theirs, warned); () all


def _used(why: str, *model_types: str) -> KeyRule:
    return KeyRule(USED, why, model_types=model_types)


def _inert(why: str) -> KeyRule:
    return KeyRule(INERT, why)


def _default(value: Any, why: str) -> KeyRule:
    return KeyRule(DEFAULT, why, default=value)


_GENERATION = "a generation default of transformers 4.x, read from generation_config.json instead"

#: Every config.json key the engine knows, and what it does with it.
CONFIG_KEYS: dict[str, KeyRule] = {
    # -- used
    "architectures": _used("which decoder (ARCHITECTURES)"),
    "model_type": _used("checked against the architecture"),
    "vocab_size": _used("embedding and LM head rows"),
    "hidden_size": _used("residual width"),
    "intermediate_size": _used("MLP width"),
    "num_hidden_layers": _used("decoder layers"),
    "num_attention_heads": _used("query heads"),
    "num_key_value_heads": _used("KV heads (grouped-query attention)"),
    "head_dim": _used("width of a head (may differ from hidden_size / num_attention_heads)"),
    "rms_norm_eps": _used("every RMSNorm's epsilon"),
    "max_position_embeddings": _used("positions served (lowered where a window or dynamic RoPE would act)"),
    "rope_theta": _used("RoPE base (4.x spelling)"),
    "rope_scaling": _used("RoPE scaling (4.x spelling)"),
    "rope_parameters": _used("RoPE base and scaling (5.x spelling)"),
    "tie_word_embeddings": _used("LM head = embedding"),
    "torch_dtype": _used("the weights' dtype: the default on a GPU (4.x spelling)"),
    "dtype": _used("the weights' dtype: the default on a GPU (5.x spelling)"),
    "bos_token_id": _used("BOS id when the tokenizer files name none"),
    "eos_token_id": _used("end-of-generation ids when generation_config.json names none"),
    "attention_bias": _used("biases on q/k/v/o", "llama", "qwen3"),
    "sliding_window": _used("attention window: served positions are capped at it where a layer uses it",
                            "mistral", "qwen2", "qwen3"),
    "use_sliding_window": _used("whether Qwen's layers may use sliding_window", "qwen2", "qwen3"),
    "max_window_layers": _used("Qwen's first layer that may slide (when layer_types is absent)", "qwen2", "qwen3"),
    "layer_types": _used("each layer's attention: full_attention or sliding_attention", "qwen2", "qwen3"),
    "quantization_config": _used("KV cache quantization only (FP8 K/V scales, quant_config.py); quantized weights"
                                 " or activations are refused"),
    # -- must keep their default
    "hidden_act": _default("silu", "the MLP's activation (SwiGLU)"),
    "mlp_bias": _default(False, "biases on the MLP's projections"),
    "partial_rotary_factor": _default(1.0, "RoPE on part of each head"),
    "auto_map": _default(None, "custom modeling code shipped with the checkpoint"),
    "attention_chunk_size": _default(None, "chunked local attention"),
    "final_logit_softcapping": _default(None, "logit soft-capping"),
    "attn_logit_softcapping": _default(None, "attention soft-capping"),
    # -- inert for inference
    "attention_dropout": _inert("dropout is a training setting"),
    "initializer_range": _inert("random initialisation"),
    "use_cache": _inert("transformers' own KV cache switch"),
    "pretraining_tp": _inert("how the weights were sliced in training; the product is the same"),
    "pad_token_id": _inert("padding (the engine packs sequences, never pads them)"),
    "transformers_version": _inert("bookkeeping"),
    "_name_or_path": _inert("bookkeeping"),
    "_attn_implementation_autoset": _inert("bookkeeping"),
    "output_attentions": _inert("transformers' outputs"),
    "output_hidden_states": _inert("transformers' outputs"),
    "return_dict": _inert("transformers' outputs"),
    "torchscript": _inert("transformers' export switch"),
    "id2label": _inert("classification heads"),
    "label2id": _inert("classification heads"),
    "problem_type": _inert("classification heads"),
    "finetuning_task": _inert("bookkeeping"),
    "chunk_size_feed_forward": _inert("a memory-saving split of the same product"),
    "is_encoder_decoder": _inert("False for every decoder the engine runs"),
    "is_decoder": _inert("bookkeeping"),
    "add_cross_attention": _inert("encoder-decoder models only"),
    "cross_attention_hidden_size": _inert("encoder-decoder models only"),
    "tie_encoder_decoder": _inert("encoder-decoder models only"),
    "decoder_start_token_id": _inert("encoder-decoder models only"),
    "sep_token_id": _inert("tokenizer bookkeeping"),
    "tokenizer_class": _inert("tokenizer bookkeeping (the tokenizer files are read)"),
    "prefix": _inert("bookkeeping"),
    "task_specific_params": _inert("bookkeeping"),
    "pruned_heads": _inert("empty for a served checkpoint"),
    **{key: _inert(_GENERATION) for key in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens",
    )},
}

#: transformers' own defaults (its config classes) for the keys a config.json may leave out.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_bias=False, sliding_window=None, rope_theta=10000.0),
    "mistral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=131072, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, sliding_window=4096, rope_theta=10000.0),
    "qwen2": dict(num_key_value_heads=32, head_dim=None, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  rope_theta=10000.0),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28, rope_theta=10000.0),
}

#: keys each rope type takes, beside rope_type/type and rope_theta (transformers' validation)
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
_CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True, slots=True)
class HFConfig:
    """What a config.json says: the engine's config and what else the loader needs."""

    architecture: str
    config: LlamaConfig
    checkpoint_dtype: str | None  # torch_dtype / dtype; None when absent
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())  # limits the engine set (logged at load)
    # the checkpoint quantizes its KV cache (FP8 scales beside unquantized weights); None: it does not say so
    kv_cache_quantization: KvCacheQuantization | None = None


def llama_config_from_hf(raw: Mapping[str, Any], *, dtype: str, source: str = "config.json",
                         hf_quant_config: Mapping[str, Any] | None = None,
                         hf_quant_source: str = "hf_quant_config.json") -> HFConfig:
    """The engine's config for a Hugging Face ``config.json`` (parsed), in ``dtype``. Raises
    :class:`CheckpointError` naming the key for anything the engine does not implement; logs a
    warning naming keys it does not know; logs the limits it sets (``notes``).
    ``hf_quant_config``: ModelOpt's ``hf_quant_config.json`` beside it (parsed), if any; it and
    ``quantization_config`` may quantize the KV cache only (``HFConfig.kv_cache_quantization``)."""
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{source}: not a JSON object")
    architecture = _architecture(raw, source)
    model_type = ARCHITECTURES[architecture]
    _check_keys(raw, model_type, source)
    # both are checked (either may refuse); the config.json's answer first, as transformers reads it
    inline = kv_cache_quantization(raw.get("quantization_config"), source=source, key="quantization_config")
    beside = kv_cache_quantization(hf_quant_config, source=hf_quant_source)
    kv_quantization = inline or beside
    defaults = ARCH_DEFAULTS[model_type]

    def get(key: str, *, required: bool = False) -> Any:
        value = raw.get(key, defaults.get(key))
        if value is None and required:
            raise CheckpointError(f"{source}: {key} is missing")
        return value

    sizes = {key: _positive_int(get(key, required=True), key, source)
             for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    heads = sizes["num_attention_heads"]
    kv_heads = _positive_int(get("num_key_value_heads") or heads, "num_key_value_heads", source)
    head_dim = _positive_int(get("head_dim") or sizes["hidden_size"] // heads, "head_dim", source)
    max_positions = _positive_int(get("max_position_embeddings", required=True), "max_position_embeddings", source)
    theta, scaling = _rope(raw, defaults, max_positions, source)
    served, notes = max_positions, []
    window = _window(raw, model_type, sizes["num_hidden_layers"], source)
    if window is not None and window < served:
        served = window
        notes.append(f"sliding_window={window} is used by some layers: positions served capped at {window}, where the "
                     f"window hides nothing (max_position_embeddings is {max_positions})")
    if scaling.rope_type == "dynamic":
        notes.append(f"rope_scaling dynamic: positions served up to {served} (max_position_embeddings), where "
                     "transformers' dynamic NTK frequencies are fixed; past it they would change with each forward's length")
    uses_attention_bias = model_type in CONFIG_KEYS["attention_bias"].model_types  # others ignore the key
    attention_bias = uses_attention_bias and _bool(get("attention_bias") or False, "attention_bias", source)
    try:
        config = LlamaConfig(
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=sizes["intermediate_size"],
            rope_theta=float(theta),
            rms_norm_eps=float(_positive_number(get("rms_norm_eps", required=True), "rms_norm_eps", source)),
            max_position_embeddings=served,
            dtype=dtype,
            tie_word_embeddings=_bool(get("tie_word_embeddings"), "tie_word_embeddings", source),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
        )
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error
    for note in notes:
        logger.warning("%s: %s", source, note)
    return HFConfig(architecture, config, _checkpoint_dtype(raw, source), _token_id(raw.get("bos_token_id"), "bos_token_id", source),
                    _token_ids(raw.get("eos_token_id"), "eos_token_id", source), tuple(notes), kv_quantization)


# --------------------------------------------------------------------------- keys


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise CheckpointError(f"{source}: architectures must name one architecture, got {architectures!r}"
                              f" (supported: {', '.join(ARCHITECTURES)})")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {architecture!r} is not supported"
                              f" (supported: {', '.join(ARCHITECTURES)})")
    model_type = raw.get("model_type", ARCHITECTURES[architecture])
    if model_type != ARCHITECTURES[architecture]:
        raise CheckpointError(f"{source}: model_type {model_type!r} does not match architecture {architecture}"
                              f" (model_type {ARCHITECTURES[architecture]!r})")
    return architecture


def _check_keys(raw: Mapping[str, Any], model_type: str, source: str) -> None:
    unknown = []
    for key, value in raw.items():
        rule = CONFIG_KEYS.get(key)
        if rule is None or (rule.model_types and model_type not in rule.model_types):
            unknown.append(key)
        elif rule.kind == DEFAULT and value is not None and value != rule.default:
            accepted = "absent" if rule.default is None else f"{rule.default!r}"
            raise CheckpointError(f"{source}: {key}={value!r} is not supported ({rule.why}); the engine runs {key}"
                                  f" {accepted} only")
    if unknown:
        logger.warning("%s: keys the engine does not know for %s, ignored as transformers ignores them: %s",
                       source, model_type, ", ".join(sorted(unknown)))


def _rope(raw: Mapping[str, Any], defaults: Mapping[str, Any], max_positions: int, source: str) -> tuple[float, RopeScaling]:
    """RoPE's base and scaling from either spelling, with transformers' precedence: ``rope_scaling``
    over ``rope_parameters``; the base from the parameters, else ``rope_theta``, else the default."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source}: {key} must be an object, got {params!r}")
    if any(isinstance(value, Mapping) for value in params.values()):
        raise CheckpointError(f"{source}: {key} per layer type ({', '.join(params)}) is not supported")
    theta = params.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"]))
    theta = _positive_number(theta, f"{key}.rope_theta" if "rope_theta" in params else "rope_theta", source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{source}: {key}.rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        raise CheckpointError(f"{source}: {key}.partial_rotary_factor={factor!r} is not supported (RoPE on part of "
                              "each head); the engine runs 1.0 only")
    known = _ROPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    ignored = sorted(set(params) - known)
    if ignored:
        logger.warning("%s: %s keys that rope type %r does not use, ignored as transformers ignores them: %s",
                       source, key, rope_type, ", ".join(ignored))
    missing = sorted(name for name in _ROPE_KEYS[rope_type] - {"original_max_position_embeddings"} if name not in params)
    if missing:
        raise CheckpointError(f"{source}: {key} of type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "default":
        return theta, RopeScaling()
    values = {name: _positive_number(params[name], f"{key}.{name}", source)
              for name in ("factor", "low_freq_factor", "high_freq_factor") if name in _ROPE_KEYS[rope_type]}
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", max_positions)  # transformers' default
        values["original_max_position_embeddings"] = _positive_int(original, f"{key}.original_max_position_embeddings", source)
    if rope_type == "dynamic":
        values["original_max_position_embeddings"] = max_positions  # transformers' dynamic NTK measures from it
    try:
        return theta, RopeScaling(rope_type=rope_type, **values)
    except ValueError as error:
        raise CheckpointError(f"{source}: {key}: {error}") from error


def _window(raw: Mapping[str, Any], model_type: str, num_layers: int, source: str) -> int | None:
    """The attention window some layer uses (transformers' semantics per architecture), or None."""
    defaults = ARCH_DEFAULTS[model_type]
    window = raw.get("sliding_window", defaults.get("sliding_window"))
    if model_type in ("llama",):
        return None  # not a key of Llama's: the warning above named it
    if model_type in ("qwen2", "qwen3"):
        if not _bool(raw.get("use_sliding_window", defaults["use_sliding_window"]), "use_sliding_window", source):
            return None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first = raw.get("max_window_layers", defaults["max_window_layers"])
            layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                           for i in range(num_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise CheckpointError(f"{source}: layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise CheckpointError(f"{source}: layer_types {unknown} are not supported (full_attention, sliding_attention)")
        if "sliding_attention" not in layer_types:
            return None
    elif "layer_types" in raw:  # mistral: transformers warns and ignores them, as do we (named above)
        pass
    if window is None:
        return None
    return _positive_int(window, "sliding_window", source)


# --------------------------------------------------------------------------- values


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{source}: {key} must be a positive number, got {value!r}")
    return value


def _bool(value: Any, key: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _checkpoint_dtype(raw: Mapping[str, Any], source: str) -> str | None:
    """``dtype`` (5.x) or ``torch_dtype`` (4.x); the newer spelling wins where both disagree."""
    values = {key: raw[key] for key in ("dtype", "torch_dtype") if raw.get(key) is not None}
    if len(set(values.values())) > 1:
        logger.warning("%s: dtype %r and torch_dtype %r disagree; dtype is used", source, values["dtype"],
                       values["torch_dtype"])
    key = next(iter(values), None)
    if key is None:
        return None
    value = values[key]
    if value not in _CHECKPOINT_DTYPES:
        raise CheckpointError(f"{source}: {key}={value!r} is not supported (supported: {', '.join(_CHECKPOINT_DTYPES)})")
    return value


def _token_id(value: Any, key: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{source}: {key} must be a token id, got {value!r}")
    return value


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    """A token id or a list of them (``eos_token_id``) -> a tuple, in order, without repeats."""
    values = value if isinstance(value, list) else [value]
    ids = [_token_id(v, key, source) for v in values]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
