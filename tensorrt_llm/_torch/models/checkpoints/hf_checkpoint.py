"""A Hugging Face checkpoint directory -> :class:`LlamaForCausalLM`, streamed from its safetensors.

A directory is a checkpoint when it holds a ``config.json``::

    config.json                          -> LlamaConfig (hf_config: every key used, inert or refused)
    model.safetensors                    \\
    model.safetensors.index.json + shards -> the weights, memory-mapped (safetensors_reader)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json
                                         -> read by llmapi (tokenizer, generation defaults)

Tensor names are the model's own (our parameters follow transformers' names). Two kinds of
tensors a checkpoint may hold are not parameters and are skipped, as transformers skips them:
``lm_head.weight`` when the embeddings are tied (the LM head *is* the embedding), and the
``rotary_emb.inv_freq`` buffers old checkpoints saved (the frequencies come from the config).
Anything else that does not match is a :class:`CheckpointError` naming the tensor.

Weights are never unpickled: ``.bin``/``.pt`` checkpoints are refused with a message saying why.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError
from tensorrt_llm._torch.models.checkpoints.hf_config import HFConfig, llama_config_from_hf
from tensorrt_llm._torch.models.checkpoints.safetensors_reader import SafetensorsCheckpoint
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_FILE", "is_hf_checkpoint", "load_llama_from_hf", "read_hf_config", "read_json"]

CONFIG_FILE = "config.json"


def is_hf_checkpoint(path: Path) -> bool:
    """A directory with a ``config.json``."""
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_json(path: Path) -> dict:
    """A JSON object file, or CheckpointError naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror}") from error
    except ValueError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def read_hf_config(directory: Path, *, dtype: str) -> HFConfig:
    """The checkpoint's ``config.json`` as the engine's config, in ``dtype``."""
    path = directory / CONFIG_FILE
    return llama_config_from_hf(read_json(path), dtype=dtype, source=str(path))


class _CheckpointWeights:
    """The checkpoint's tensors that are parameters (a ``WeightSource``), over its mapped files."""

    def __init__(self, files: SafetensorsCheckpoint, config: LlamaConfig) -> None:
        self.files = files
        skipped = [name for name in files.names() if name.endswith(".rotary_emb.inv_freq")
                   or (config.tie_word_embeddings and name == "lm_head.weight")]
        if skipped:
            logger.info("%s: skipping %s (tied LM head, saved RoPE buffers)", files.source,
                        ", ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
        skip = set(skipped)
        self._names = [name for name in files.names() if name not in skip]

    def names(self):
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.tensor(name)

    def release(self, name: str) -> None:
        self.files.release(name)


def load_llama_from_hf(
    directory: str | Path,
    config: LlamaConfig,
    *,
    mapping: Mapping | None = None,
    device: torch.device | str | None = None,
) -> LlamaForCausalLM:
    """The model ``config`` describes (read with :func:`read_hf_config`), its weights streamed from
    the directory's safetensors straight into this rank's parameters on ``device``: built empty
    (nothing drawn), then each tensor read once, sliced, converted to ``config.dtype``, and its
    mapped pages released. Raises CheckpointError naming a missing, unexpected or misshapen tensor."""
    directory = Path(directory)
    began = time.perf_counter()
    with SafetensorsCheckpoint.from_directory(directory) as files:
        weights = _CheckpointWeights(files, config)
        try:
            model = LlamaForCausalLM(config, mapping, weights=weights, device=device)
        except ValueError as error:  # a tensor missing, unexpected or of the wrong shape
            raise CheckpointError(f"{directory}: {error}") from error
        del weights
    logger.info("loaded %s (%d tensors, %.2f GB on disk) as %s on %s in %.1f s", directory.name, len(files.entries),
                files.nbytes / 1e9, config.dtype, model.device, time.perf_counter() - began)
    return model
