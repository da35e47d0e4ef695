"""Torch models the executor runs."""

from .modeling_llama import MODEL_PRESETS, AttentionMetadata, LlamaConfig, LlamaForCausalLM

__all__ = ["MODEL_PRESETS", "AttentionMetadata", "LlamaConfig", "LlamaForCausalLM"]
