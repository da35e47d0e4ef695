"""What loading a checkpoint gives: this rank's model and the KV scales the checkpoint carries."""

from __future__ import annotations

from dataclasses import dataclass

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM

__all__ = ["LoadedCheckpoint"]


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    model: LlamaForCausalLM
    # the per-layer K/V scales of an FP8 KV cache the checkpoint carries (every layer, on every
    # tensor-parallel rank alike); None: it carries none. A pool gets them under fp8 only
    # (``kv_quant.kv_scales_for_pool``).
    kv_scales: KvScales | None = None
