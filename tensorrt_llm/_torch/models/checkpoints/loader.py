"""One entry for every checkpoint format: a path and the config read from it -> this rank's model
(and the KV scales the checkpoint carries)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError
from tensorrt_llm._torch.models.checkpoints.gguf_loader import llama_weights_from_gguf, open_gguf
from tensorrt_llm._torch.models.checkpoints.hf_checkpoint import is_hf_checkpoint, load_hf_checkpoint
from tensorrt_llm._torch.models.checkpoints.loaded import LoadedCheckpoint
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm.mapping import Mapping

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str | os.PathLike[str], config: LlamaConfig, *, mapping: Mapping | None = None,
                    device: torch.device | str | None = None) -> LoadedCheckpoint:
    """The model ``config`` describes, with ``path``'s weights: a Hugging Face directory streams only
    this rank's slices from its safetensors (and gives its KV scales, if any: every rank reads
    them all); a GGUF file is dequantised whole (cached per process), each rank keeps its slices,
    and it carries no KV scales."""
    path = Path(path)
    if is_hf_checkpoint(path):
        return load_hf_checkpoint(path, config, mapping=mapping, device=device)
    weights = llama_weights_from_gguf(open_gguf(path), config)
    try:
        return LoadedCheckpoint(LlamaForCausalLM(config, mapping, weights=weights, device=device))
    except ValueError as error:
        raise CheckpointError(f"{path.name}: {error}") from error
