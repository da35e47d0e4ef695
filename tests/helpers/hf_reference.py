"""Tiny random Hugging Face checkpoints written by transformers itself, and transformers' forward
held to float64 as the reference.

transformers computes two things in float32 whatever the model's dtype: RMSNorm (it upcasts a
half-precision input and so downcasts a float64 one) and the RoPE angles. A float64 comparison
at 1e-9 needs both in float64, so :func:`float64_reference` replaces exactly those two forwards
on the loaded model's modules by the same formulas in the input's dtype (the RoPE frequencies
stay the ones transformers computed; its dynamic-RoPE update stays around the forward).
Everything else -- the architecture, the weight names, biases, q/k norms, GQA, tying, masks --
is transformers' own code.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.modeling_rope_utils import dynamic_rope_update

SMALL = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class Case:
    """One row of the architecture table: a transformers config class and its keywords."""

    name: str
    config_class: str
    architecture: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    shard_size: str = "20KB"  # small: several shards and an index; large: one model.safetensors

    def config(self) -> transformers.PretrainedConfig:
        config = getattr(transformers, self.config_class)(**{**SMALL, **self.kwargs})
        config.architectures = [self.architecture]
        return config


CASES = (
    # Llama 3.1/3.2: llama3 RoPE, GQA, a head_dim that is not hidden/heads
    Case("llama3", "LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    # Llama 2 style with linear RoPE, tied embeddings, one KV head, attention_bias (q/k/v/o biases)
    Case("llama-linear", "LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # dynamic NTK RoPE (its frequencies are fixed up to max_position_embeddings)
    Case("llama-dynamic", "LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # Mistral: no window, full multi-head attention, one safetensors file
    Case("mistral", "MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=4, sliding_window=None, head_dim=8),
         shard_size="10MB"),
    # Qwen2: q/k/v biases, tied embeddings
    Case("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, head_dim 16 (hidden/heads is 8)
    Case("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
)
CASE_NAMES = [case.name for case in CASES]


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights that exercise everything: transformers initialises biases to 0 and norms to 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:
                param.copy_(noise * param.shape[1] ** -0.5)


def randomize_fan_in_(model: torch.nn.Module, seed: int) -> None:
    """Float64 weights of a small model that stays well conditioned over many layers and tokens:
    norms ``1 + 0.1 * noise``, other vectors (biases) ``0.1 * noise``, every matrix, embeddings
    included, ``noise / sqrt(fan-in)``. One generator, parameters in ``named_parameters`` order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            scale = 0.1 if param.dim() == 1 else param.shape[1] ** -0.5
            param.copy_((1.0 if "norm" in name else 0.0) + scale * noise)


def write_checkpoint(case: Case, directory: Path, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> Path:
    """``case``'s model with random weights, saved by transformers (``save_pretrained``, sharded)."""
    model = transformers.AutoModelForCausalLM.from_config(case.config(), dtype=dtype)
    randomize_(model, seed)
    model.save_pretrained(directory, max_shard_size=case.shard_size)
    return directory


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


@dynamic_rope_update
def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def float64_reference(directory: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint, in float64, with its float32 islands lifted (module docstring)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="sdpa")
    patched = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            patched += 1
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_forward, module)
            patched += 1
    assert patched >= 3, "the reference must lift transformers' float32 norms and RoPE"
    return model.eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab) float64 logits of one sequence."""
    return model(torch.tensor([tokens])).logits[0]


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


#: A padded vocabulary's rows past the tokenizer's, and the one padded id the model favours
PADDED_VOCAB_ROWS = 64


def write_padded_vocab_checkpoint(directory: Path, tokenizer_dir: Path, *, tokenizer_size: int,
                                  padded_id: int, text_id: int, seed: int = 0) -> Path:
    """A tiny Llama whose ``vocab_size`` is ``tokenizer_size + PADDED_VOCAB_ROWS`` (as checkpoints
    pad theirs), with ``tokenizer_dir``'s tokenizer files, written by transformers. Whatever the
    prompt, it writes ``padded_id`` (an id the tokenizer has no token for) after a real token and
    ``text_id`` after ``padded_id``, decisively enough (probability > 0.99) that sampling at
    temperature 1 does too:

    * residual channel 0 carries the input token's sign: every embedding has ``+C`` there,
      ``padded_id``'s ``-C``; no attention or MLP output writes to it (row 0 of every ``o_proj``
      and ``down_proj`` is zero), so after the final RMSNorm channel 0 is about ``+-sqrt(hidden)``
      (8) and the other channels are small;
    * the LM head's rows past the tokenizer are zero but ``padded_id``'s, which reads ``+2`` x
      channel 0, and ``text_id``'s reads ``-2`` x channel 0: the favoured one's logit is about
      16, every other token's below 1 (e^16 outweighs 49,000 tokens near e^0).
    """
    import shutil

    config = transformers.LlamaConfig(vocab_size=tokenizer_size + PADDED_VOCAB_ROWS, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sign = 8.0  # C: dominates the residual's RMS (the other 63 channels are ~0.02-0.1)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # (vocab, hidden)
        embed[:, 0] = sign
        embed[padded_id, 0] = -sign
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()  # (hidden, heads * head_dim): row 0 writes channel 0
            layer.mlp.down_proj.weight[0].zero_()  # (hidden, intermediate)
        head = model.lm_head.weight  # (vocab, hidden)
        head[tokenizer_size:].zero_()
        head[padded_id, 0] = 2.0
        head[text_id].zero_()
        head[text_id, 0] = -2.0
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory
