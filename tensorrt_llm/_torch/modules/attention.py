"""``Attention``: grouped-query self-attention over a paged KV cache, and the heads one rank holds.

One module serves every architecture the engine runs; they differ in two switches::

    x -> q_proj, k_proj, v_proj  (+ bias: Qwen2's q/k/v, Llama's attention_bias)
      -> per-head RMSNorm of q and k (Qwen3's q_norm / k_norm)
      -> RoPE of q and k
      -> attention (paged backend, or plain causal without a cache)
      -> o_proj (+ bias: Llama's attention_bias)

``head_dim`` is its own size (it need not be ``hidden_size / num_heads``), and any number of KV
heads that divides the query heads works. The layer splits in two around the attention itself
(:meth:`Attention.project` and :meth:`Attention.output`), which the piecewise CUDA graphs
capture apart.

On the CPU, q, k and v may come from one linear method over their three weights stacked
(:meth:`Attention.fuse_qkv`, chosen at load: ``models/linear_formats``): one kernel call for
the three, and RoPE of q and k in one call over their adjacent columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.kernels import fused_rope_applies, rotate_qk_
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode
from tensorrt_llm._torch.modules.linear_methods import LinearMethod
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_rotary

if TYPE_CHECKING:
    from tensorrt_llm._torch.attention_backend.backend import LayerKV

__all__ = ["Attention", "CausalAttention", "HeadShard"]


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes: ``[start, stop)`` ranges of query and KV heads."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]

    @staticmethod
    def of(config, tp_size: int, tp_rank: int) -> HeadShard:
        """The shard of a config that has ``num_heads`` and ``num_kv_heads`` (see :meth:`split`)."""
        return HeadShard.split(config.num_heads, config.num_kv_heads, tp_size, tp_rank)

    @staticmethod
    def split(n_head: int, n_kv: int, tp_size: int, tp_rank: int) -> HeadShard:
        """Query heads split evenly; KV heads split with them, or replicated when ranks outnumber
        them (each rank then holds the one KV head its query heads share)."""
        if n_head % tp_size:
            raise ValueError(f"num_heads ({n_head}) must be a multiple of the tensor-parallel size ({tp_size})")
        if n_kv % tp_size and tp_size % n_kv:
            raise ValueError(
                f"num_kv_heads ({n_kv}) and the tensor-parallel size ({tp_size}) must divide one another"
            )
        per_rank = n_head // tp_size
        q_start = tp_rank * per_rank
        if tp_size <= n_kv:
            kv_per_rank = n_kv // tp_size
            kv_start = tp_rank * kv_per_rank
            return HeadShard((q_start, q_start + per_rank), (kv_start, kv_start + kv_per_rank))
        kv_head = q_start // (n_head // n_kv)  # all of this rank's query heads share it
        return HeadShard((q_start, q_start + per_rank), (kv_head, kv_head + 1))


class Attention(nn.Module):
    """Grouped-query attention: n_head query heads share n_kv_head K/V heads.

    Under tensor parallelism ``n_head`` and ``n_kv_head`` count this rank's heads only; q/k/v are
    column-parallel (their biases sliced with their rows), ``o_proj`` row-parallel (its bias added
    once, after the all-reduce). ``qk_norm_eps``: RMSNorm each head of q and k before RoPE
    (Qwen3), with that epsilon; None: no such norm.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        tp_size: int = 1,
        tp_rank: int = 0,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        shard = HeadShard.split(num_heads, num_kv_heads, tp_size, tp_rank)
        self.n_head = shard.q_heads[1] - shard.q_heads[0]
        self.n_kv_head = shard.kv_heads[1] - shard.kv_heads[0]
        self.head_dim = hd = head_dim
        self.scale = head_dim**-0.5
        column = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank, tensor_parallel_mode=TensorParallelMode.COLUMN,
                      bias=qkv_bias)
        q_rows = (shard.q_heads[0] * hd, shard.q_heads[1] * hd)
        kv_rows = (shard.kv_heads[0] * hd, shard.kv_heads[1] * hd)
        self.q_proj = Linear(hidden_size, num_heads * hd, shard=q_rows, **column)
        self.k_proj = Linear(hidden_size, num_kv_heads * hd, shard=kv_rows, **column)
        self.v_proj = Linear(hidden_size, num_kv_heads * hd, shard=kv_rows, **column)
        self.o_proj = Linear(
            num_heads * hd, hidden_size, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank,
            tensor_parallel_mode=TensorParallelMode.ROW, shard=q_rows, bias=o_bias,
        )
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.causal = CausalAttention()  # the attention without a cache
        self.qkv_method: LinearMethod | None = None  # q, k, v stacked (fuse_qkv); None: three calls

    def fuse_qkv(self, method: LinearMethod) -> None:
        """Compute q, k and v with ``method``, whose weight is q_proj's, k_proj's and v_proj's rows
        stacked in that order (biases included): :meth:`project` then makes one call for the three."""
        self.qkv_method = method

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        paged: LayerKV | None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(self.attend(q, k, v, paged))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> q (T, n_head, head_dim), k, v (T, n_kv_head, head_dim), RoPE applied."""
        T = x.shape[0]
        if self.qkv_method is not None:
            return self._project_fused(x, cos, sin)
        q = self.q_proj(x).view(T, self.n_head, self.head_dim)  # (T, n_head, head_dim)
        k = self.k_proj(x).view(T, self.n_kv_head, self.head_dim)  # (T, n_kv_head, head_dim)
        v = self.v_proj(x).view(T, self.n_kv_head, self.head_dim)  # (T, n_kv_head, head_dim)
        if self.q_norm is not None:  # per head, over head_dim, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if fused_rope_applies(q):
            rotate_qk_(q, k, cos, sin)  # one kernel for both, in place (attention_backend)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _project_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        T, hd, qk_heads = x.shape[0], self.head_dim, self.n_head + self.n_kv_head
        qkv = self.qkv_method.apply(x).view(T, qk_heads + self.n_kv_head, hd)  # (T, n_head + 2 n_kv_head, head_dim)
        v = qkv[:, qk_heads:]  # (T, n_kv_head, head_dim), a view
        if self.q_norm is not None:  # per head, each with its own weight, before RoPE (Qwen3)
            q, k = self.q_norm(qkv[:, : self.n_head]), self.k_norm(qkv[:, self.n_head : qk_heads])
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            return q, k, v
        qk = apply_rotary(qkv[:, :qk_heads], cos, sin)  # (T, n_head + n_kv_head, head_dim): one call for both
        return qk[:, : self.n_head], qk[:, self.n_head :], v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: LayerKV | None) -> torch.Tensor:
        """The attention itself -> (T, n_head, head_dim): through the paged backend, or, with no
        cache, one sequence where key j is visible to query i iff j <= i (``self.causal``)."""
        if paged is not None:  # the paged attention backend of the pools' device (attention_backend)
            return paged.attend(q, k, v, self.scale)
        return self.causal(q, k, v, self.scale)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """y (T, n_head, head_dim) -> (T, hidden), summed over the ranks' heads."""
        return self.o_proj(y.reshape(y.shape[0], self.n_head * self.head_dim))


class CausalAttention(nn.Module):
    """One sequence without a cache (``LlamaForCausalLM.forward_full``, the reference): key j is
    visible to query i iff j <= i. A module of its own so that a batch-invariant model swaps it
    (``batch_invariant``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, n_head, head_dim), k/v (T, n_kv_head, head_dim) -> (T, n_head, head_dim)."""
        T = q.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T) True = visible
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_head, T, head_dim)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_head, T, head_dim)
        q = q.transpose(0, 1)  # (n_head, T, head_dim)
        scores = (q @ k.transpose(1, 2)) * scale  # (n_head, T, T)
        scores = scores.masked_fill(~mask[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (n_head, T, T)
        return (probs @ v).transpose(0, 1)  # (T, n_head, head_dim)
