"""``FusedDecoderLayer``: the decoder layer as a GPU runs it, with fused projections and kernels.

A decode step of one sequence reads every weight once (16 GB for Llama-3.1-8B: ~3.3 ms on an
H200) and launches every kernel of every layer; at ~2-4 us a small kernel, even inside a CUDA
graph, 32 layers of 17 kernels cost about as much as the weights' bytes. The GPU engine therefore
swaps each :class:`~.modeling_llama.DecoderLayer` for this one when it is built
(:func:`fuse_decoder_layers`, called by ``CudaTorchModelEngine``): the same parameters, the same
math, fewer kernels::

    DecoderLayer (CPU, reference)          FusedDecoderLayer (GPU)                     kernels
    input norm                             rms_norm (Triton)                           1
    q_proj, k_proj, v_proj                 one QKV GEMM, weights concatenated at load  1  (3)
    RoPE; K, V writes                      RoPE + K/V write (+ FP8 quantize), Triton   1  (3; FP8 pool: 9)
    attention (+ split combine)            the same                                    1-2
    o_proj, residual add, post norm        o_proj GEMM; add + norm (Triton)            2  (3)
    gate_proj, up_proj, silu, mul          one gate/up GEMM; silu-and-mul (Triton)     2  (4)
    down_proj, residual add                down GEMM accumulated into the residual     1  (2)
                                           (``addmm_``, beta = 1)
    a layer                                9-10 kernels (17-18; over an FP8 pool 23-24)

The fused weights are single tensors whose row slices are the original parameters (views: the
bytes are held once, ``named_parameters`` and the checkpoint names are unchanged), so fuse a
model once it is on its device and do not move it afterwards. The CPU keeps ``DecoderLayer``: its
float64 parity with transformers is untouched; on a GPU the fused kernels agree with the torch
expressions to the dtype's precision (``modules/triton_fused.py``).

Not fused (:func:`fusion_refused` says why): tensor-parallel ranks (row-parallel layers
all-reduce between the pieces), float64 (Triton's kernels accumulate in float32) and float16
packed weights (CPU), and without Triton.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.attention_backend.kernels import has_triton
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.rotary_embedding import apply_rotary

__all__ = ["FusedDecoderLayer", "fuse_decoder_layers", "fusion_refused"]

logger = logging.getLogger(__name__)

_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fuse_rows(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum out, in) weight (and bias, if every layer has one) made of ``linears``' weights
    stacked by rows; each layer's parameter becomes a view of its rows (the bytes held once)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = all(linear.bias is not None for linear in linears)
    bias = torch.cat([linear.bias.detach() for linear in linears]) if has_bias else None
    start = 0
    for linear in linears:
        stop = start + linear.weight.shape[0]
        linear.weight.data = weight[start:stop]
        if bias is not None:
            linear.bias.data = bias[start:stop]
        start = stop
    return weight, bias


class FusedDecoderLayer(nn.Module):
    """A :class:`~.modeling_llama.DecoderLayer`'s modules run through fused weights and kernels
    (module docstring). Same interface: ``forward``, and ``attention_inputs`` / ``attend`` /
    ``finish`` for the piecewise graphs; ``attend`` needs a paged layer with ``attend_rotary``
    (``attention_backend.paged``), or none (no cache)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = mlp = layer.mlp
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise ValueError("FusedDecoderLayer: the gate/up projections carry no bias in any architecture it runs")
        qkv_weight, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_weight, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.register_buffer("qkv_weight", qkv_weight, persistent=False)  # (q + 2 kv rows, hidden)
        self.register_buffer("qkv_bias", qkv_bias, persistent=False)
        self.register_buffer("gate_up_weight", gate_up_weight, persistent=False)  # (2 * ffn, hidden)
        hd = attn.head_dim
        self._q_size, self._kv_size = attn.n_head * hd, attn.n_kv_head * hd
        # The Triton kernels, imported here: a layer is fused only where Triton is installed
        # (fusion_refused), and importing this module must not need it.
        from tensorrt_llm._torch.modules import triton_fused

        self._kernels = triton_fused

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged):
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.finish(x, self.attend(q, k, v, cos, sin, paged))

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> q (T, n_head, head_dim), k, v (T, n_kv_head, head_dim): views of one
        QKV projection, before RoPE (``attend`` rotates them with the KV write)."""
        attn, norm = self.self_attn, self.input_layernorm
        T, hd = x.shape[0], attn.head_dim
        qkv = F.linear(self._kernels.rms_norm(x, norm.weight, norm.eps), self.qkv_weight, self.qkv_bias)  # (T, q + 2 kv)
        q = qkv[:, : self._q_size].view(T, attn.n_head, hd)
        k = qkv[:, self._q_size : self._q_size + self._kv_size].view(T, attn.n_kv_head, hd)
        v = qkv[:, self._q_size + self._kv_size :].view(T, attn.n_kv_head, hd)
        if attn.q_norm is not None:  # per head, before RoPE (Qwen3)
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged):
        """q, k before RoPE -> y (T, n_head, head_dim): RoPE and the KV write in one kernel
        (``PagedLayerKV.attend_rotary``); without a cache, torch's RoPE and plain causal attention."""
        if paged is None:
            return self.self_attn.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, None)
        return paged.attend_rotary(q, k, v, cos, sin, self.self_attn.scale)

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The residual stream x (T, hidden) and the attention's y -> the layer's output."""
        norm, kernels = self.post_attention_layernorm, self._kernels
        x, h = kernels.add_rms_norm(x, self.self_attn.output(y), norm.weight, norm.eps)  # x + o_proj(y), its norm
        a = kernels.silu_and_mul(F.linear(h, self.gate_up_weight))  # (T, ffn)
        return x.addmm_(a, self.mlp.down_proj.weight.t())  # x + down_proj(a): x is this layer's own sum


def fusion_refused(model) -> str | None:
    """Why ``model`` (a ``LlamaForCausalLM``) keeps its plain layers, or None when it can be fused."""
    mapping, config = model.mapping, model.config
    if mapping.attn_tp_size > 1 or mapping.mlp_tp_size > 1:
        return "tensor-parallel ranks all-reduce inside the layer"
    if config.torch_dtype not in _FUSED_DTYPES or config.packs_linear_weights:
        return f"dtype {config.dtype} (the fused kernels run bfloat16, float16 and float32)"
    if not has_triton():
        return "Triton is not installed"
    if model.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the model is on {model.device.type} (Triton runs on a GPU, or interpreted)"
    return None


def fuse_decoder_layers(model) -> int:
    """Swap each of ``model``'s decoder layers for a :class:`FusedDecoderLayer` (once: fused
    layers stay). Returns how many layers are fused now; 0, with the reason logged, where
    :func:`fusion_refused`."""
    layers = model.model.layers
    if all(isinstance(layer, FusedDecoderLayer) for layer in layers):
        return len(layers)
    reason = fusion_refused(model)
    if reason is not None:
        logger.info("decoder layers not fused: %s", reason)
        return 0
    with torch.no_grad():
        for i, layer in enumerate(layers):
            if not isinstance(layer, FusedDecoderLayer):
                layers[i] = FusedDecoderLayer(layer)
    logger.info("fused %d decoder layers (QKV and gate/up GEMMs, RoPE with the KV write, add+RMSNorm, SiLU-mul)",
                len(layers))
    return len(layers)
