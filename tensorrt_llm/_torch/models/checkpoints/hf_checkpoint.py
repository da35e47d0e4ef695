"""A Hugging Face checkpoint directory -> :class:`LlamaForCausalLM`, streamed from its safetensors.

A directory is a checkpoint when it holds a ``config.json``::

    config.json                          -> LlamaConfig (hf_config: every key used, inert or refused)
    hf_quant_config.json (ModelOpt)      -> checked beside config.json's quantization_config (quant_config)
    model.safetensors                    \\
    model.safetensors.index.json + shards -> the weights, memory-mapped (safetensors_reader),
                                            and the KV cache's per-layer scales, if any
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json
                                         -> read by llmapi (tokenizer, generation defaults)

Tensor names are the model's own (our parameters follow transformers' names). Two kinds of
tensors a checkpoint may hold are not parameters and are skipped, as transformers skips them:
``lm_head.weight`` when the embeddings are tied (the LM head *is* the embedding), and the
``rotary_emb.inv_freq`` buffers old checkpoints saved (the frequencies come from the config).
A third kind is read beside the parameters: a layer's KV scales (``self_attn.k_scale`` /
``v_scale`` as llm-compressor and vLLM write them, ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale``
or ``.output_scale``, an old ``kv_scale``), one scalar each, through
``kv_quant.kv_scales_from_checkpoint``; every rank reads all of them (a scale covers the whole
tensor, not a rank's heads). They are accepted with or without a ``quantization_config`` that
announces them, as vLLM accepts them, and returned beside the model (:class:`LoadedCheckpoint`);
a scale that is not one positive finite number is a :class:`CheckpointError` naming the tensor.
Anything else that does not match is a :class:`CheckpointError` naming the tensor.

Weights are never unpickled: ``.bin``/``.pt`` checkpoints are refused with a message saying why.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, is_kv_scale_name, kv_scales_from_checkpoint
from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError
from tensorrt_llm._torch.models.checkpoints.hf_config import HFConfig, llama_config_from_hf
from tensorrt_llm._torch.models.checkpoints.loaded import LoadedCheckpoint
from tensorrt_llm._torch.models.checkpoints.safetensors_reader import INDEX_FILE, SINGLE_FILE, SafetensorsCheckpoint
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FILE", "HF_QUANT_CONFIG_FILE", "is_hf_checkpoint", "load_hf_checkpoint", "load_llama_from_hf",
    "read_hf_config", "read_json", "read_kv_scales",
]

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's quantization config, beside config.json


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
    """The checkpoint's ``config.json`` as the engine's config, in ``dtype`` (with ModelOpt's
    ``hf_quant_config.json`` where there is one: the quantization it describes must be the KV
    cache's only)."""
    path, quant_path = directory / CONFIG_FILE, directory / HF_QUANT_CONFIG_FILE
    quant = read_json(quant_path) if quant_path.is_file() else None
    return llama_config_from_hf(read_json(path), dtype=dtype, source=str(path), hf_quant_config=quant,
                                hf_quant_source=str(quant_path))


class _CheckpointWeights:
    """The checkpoint's tensors that are parameters (a ``WeightSource``), over its mapped files."""

    def __init__(self, files: SafetensorsCheckpoint, config: LlamaConfig) -> None:
        self.files = files
        skipped = [name for name in files.names() if name.endswith(".rotary_emb.inv_freq")
                   or (config.tie_word_embeddings and name == "lm_head.weight")]
        if skipped:
            logger.info("%s: skipping %s (tied LM head, saved RoPE buffers)", files.source,
                        ", ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
        skip = set(skipped) | set(_kv_scale_names(files))  # read by _read_kv_scales, not parameters
        self._names = [name for name in files.names() if name not in skip]

    def names(self):
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.tensor(name)

    def release(self, name: str) -> None:
        self.files.release(name)


def _kv_scale_names(files: SafetensorsCheckpoint) -> list[str]:
    return [name for name in files.names() if is_kv_scale_name(name)]


def _read_kv_scales(files: SafetensorsCheckpoint, num_layers: int) -> KvScales | None:
    """The per-layer KV scales among ``files``' tensors (scalars read from the mapping), or None.
    CheckpointError naming the tensor for one that is not a positive finite number, a second one
    for the same layer, or a layer the model does not have."""
    names = _kv_scale_names(files)
    if not names:
        return None
    tensors = {name: files.tensor(name) for name in names}  # views of the mapped file
    try:
        scales = kv_scales_from_checkpoint(tensors, num_layers)
    except ValueError as error:
        raise CheckpointError(f"{files.source}: {error}") from error
    finally:
        del tensors
        for name in names:
            files.release(name)
    return scales


def read_kv_scales(directory: str | Path, num_layers: int) -> KvScales | None:
    """The KV scales a Hugging Face checkpoint carries (None: none, or no safetensors at all: a
    directory described for its sizes only), without loading anything else: the safetensors
    headers are parsed and the scalars read from the mapped files."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in (SINGLE_FILE, INDEX_FILE)):
        return None  # loading the weights says what is missing
    with SafetensorsCheckpoint.from_directory(directory) as files:
        return _read_kv_scales(files, num_layers)


def load_hf_checkpoint(
    directory: str | Path,
    config: LlamaConfig,
    *,
    mapping: Mapping | None = None,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """The model ``config`` describes (read with :func:`read_hf_config`), its weights streamed from
    the directory's safetensors straight into this rank's parameters on ``device``: built empty
    (nothing drawn), then each tensor read once, sliced, converted to ``config.dtype``, and its
    mapped pages released; beside it the checkpoint's KV scales (every layer's, whatever the
    rank). Raises CheckpointError naming a missing, unexpected or misshapen tensor, or a bad scale."""
    directory = Path(directory)
    began = time.perf_counter()
    with SafetensorsCheckpoint.from_directory(directory) as files:
        kv_scales = _read_kv_scales(files, config.num_layers)  # first: a bad scale fails before any weight is read
        weights = _CheckpointWeights(files, config)
        try:
            model = LlamaForCausalLM(config, mapping, weights=weights, device=device)
        except ValueError as error:  # a tensor missing, unexpected or of the wrong shape
            raise CheckpointError(f"{directory}: {error}") from error
        del weights
    logger.info("loaded %s (%d tensors, %.2f GB on disk) as %s on %s in %.1f s%s", directory.name, len(files.entries),
                files.nbytes / 1e9, config.dtype, model.device, time.perf_counter() - began,
                "" if kv_scales is None else f"; KV scales for {kv_scales.num_layers} layers ({kv_scales.describe()})")
    return LoadedCheckpoint(model, kv_scales)


def load_llama_from_hf(
    directory: str | Path,
    config: LlamaConfig,
    *,
    mapping: Mapping | None = None,
    device: torch.device | str | None = None,
) -> LlamaForCausalLM:
    """:func:`load_hf_checkpoint`'s model alone (its KV scales are still read and checked)."""
    return load_hf_checkpoint(directory, config, mapping=mapping, device=device).model
