"""A Llama-style decoder run by the executor on a paged KV cache.

Weights are either given (a real checkpoint: ``checkpoints/gguf_loader.py``) or drawn from a
local ``torch.Generator`` seeded by ``LlamaConfig.seed``, so two engines built from the same
config compute the same tokens bit for bit, and greedy outputs can be compared across
scheduling policies.

Two forward paths share all weights:

* ``LlamaForCausalLM.forward`` -- what the executor runs. One flat batch of new tokens from
  several requests; each layer writes the new tokens' K/V into the paged pools, then every
  new token attends to its own request's cached prefix and new tokens.
* ``LlamaForCausalLM.forward_full`` -- the reference. One whole sequence, no cache, plain
  causal attention. The tests hold the paged path to it.

Tensor parallelism (``mapping.tp_size`` ranks, Megatron's split): each rank holds a slice
of the query heads and their KV heads (a KV head is replicated when there are more ranks
than KV heads), a slice of the MLP's columns, and a slice of the LM head's vocabulary.
``o_proj`` and ``down_proj`` are row-parallel, each followed by an all-reduce; the LM head
gathers its logits. The embedding and the norms are replicated. Every rank draws the full
weights from the same seed and keeps its slice, so a sharded model computes what the
single-rank model computes, up to the order of the all-reduce's additions.

Paged KV layout (one pool per layer for K, one for V; the KV manager owns them)::

    pool: (num_blocks, tokens_per_block, num_kv_heads, head_dim)

    request r, block_tables[r] = [7, 2, 5], tokens_per_block = 4,
    num_cached_tokens[r] = 6, num_new_tokens[r] = 3:

    position   0 1 2 3 | 4 5 6 7 | 8 . . .
    block      7       | 2       | 5
    state      c c c c | c c n n | n - - -     c: cached, read only
                                                n: written by this forward, then read
                                                -: never read nor written

A slot's flat index in the pool viewed as ``(num_blocks * tokens_per_block, ...)`` is
``block * tokens_per_block + offset``; the forward reads and writes exactly the slots of
positions ``[0, num_cached_tokens[r] + num_new_tokens[r])`` and no others.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping as WeightMapping

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.attention_backend.kernels import fused_rope_applies, rotate_qk_
from tensorrt_llm._torch.attention_backend.backend import AttentionPlan, LayerKV, plan_builder
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode
from tensorrt_llm.mapping import Mapping

WeightMap = WeightMapping[str, torch.Tensor]
FLOAT16_WEIGHTS = "float16-weights"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,  # the default on CUDA (DESIGN.md §7)
    "float16": torch.float16,
    # The linear layers' weights stored in float16 and multiplied in float32 (fbgemm, CPU only):
    # half the bytes a decode step reads; activations, norms, embedding and KV stay float32.
    # The CPU default for a GGUF checkpoint (llm_utils.default_checkpoint_dtype).
    FLOAT16_WEIGHTS: torch.float32,
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Sizes of a Llama decoder, and the seed of its weights when none are given."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # "float32" | "float64" | "bfloat16" | "float16" | "float16-weights"
    seed: int = 0
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (SmolLM2 and most small models)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of channels.
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"LlamaConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if not _is_int(self.seed):
            raise ValueError(f"LlamaConfig.seed must be an int, got {self.seed!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' and the KV cache's dtype (and the weights', unless packed)."""
        return _DTYPES[self.dtype]

    @property
    def packs_linear_weights(self) -> bool:
        """The linear layers keep their weights packed in float16 (``Linear.pack_float16``)."""
        return self.dtype == FLOAT16_WEIGHTS

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over every layer (unsharded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize


MODEL_PRESETS: dict[str, LlamaConfig] = {
    "tiny-random": LlamaConfig(),
    "small-random": LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=512,
    ),
    # The shape of Mistral-NeMo-12B (the shared H200 calibration tables): 12.2B parameters,
    # 24.5 GB in bf16, KV 160 KiB a token. Random weights; build it on a GPU (``device="cuda"``),
    # where they are drawn in milliseconds.
    "mistral-nemo-12b-random": LlamaConfig(
        vocab_size=131072,
        hidden_size=5120,
        num_layers=40,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
}


# --------------------------------------------------------------------------- attention metadata


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat forward over several requests.

    Requests appear in the flat token order. For request r:
      num_new_tokens[r]  tokens of this forward belong to r (contiguous in the flat input),
      num_cached_tokens[r] tokens of r already have K/V in the paged cache (the first new
                         token's position),
      block_tables[r]    block ids (ints) covering positions [0, num_cached_tokens[r] +
                         num_new_tokens[r]) of r, in order: position p of r lives in block
                         block_tables[r][p // tokens_per_block] at offset p % tokens_per_block.

    A block table may be longer than needed (blocks allocated ahead); the extra blocks are
    neither read nor written. Blocks may be shared between requests (reused prefixes), but
    the slots written by one forward must be distinct -- that is checked in the forward.
    """

    num_new_tokens: list[int]
    num_cached_tokens: list[int]
    block_tables: list[list[int]]
    tokens_per_block: int

    def __post_init__(self) -> None:
        if not _is_int(self.tokens_per_block) or self.tokens_per_block <= 0:
            raise ValueError(
                f"AttentionMetadata.tokens_per_block must be a positive int, "
                f"got {self.tokens_per_block!r}"
            )
        n = len(self.num_new_tokens)
        if len(self.num_cached_tokens) != n or len(self.block_tables) != n:
            raise ValueError(
                "AttentionMetadata.num_new_tokens, num_cached_tokens and block_tables must have "
                f"one entry per request, got lengths {n}, {len(self.num_cached_tokens)}, "
                f"{len(self.block_tables)}"
            )
        for r in range(n):
            new, cached = self.num_new_tokens[r], self.num_cached_tokens[r]
            if not _is_int(new) or new < 0:
                raise ValueError(
                    f"AttentionMetadata.num_new_tokens[{r}] must be an int >= 0, got {new!r}"
                )
            if not _is_int(cached) or cached < 0:
                raise ValueError(
                    f"AttentionMetadata.num_cached_tokens[{r}] must be an int >= 0, got {cached!r}"
                )
            needed = self.num_blocks_needed(r)
            table = self.block_tables[r]
            if len(table) < needed:
                raise ValueError(
                    f"AttentionMetadata.block_tables[{r}] has {len(table)} blocks, but "
                    f"{cached} cached + {new} new tokens need {needed} blocks of "
                    f"{self.tokens_per_block} tokens"
                )
            used = table[:needed]
            for block in used:
                index = _as_index(block)
                if index is None or index < 0:
                    raise ValueError(
                        f"AttentionMetadata.block_tables[{r}] holds {block!r}, "
                        "block ids must be ints >= 0"
                    )
            if len(set(used)) != len(used):
                raise ValueError(
                    f"AttentionMetadata.block_tables[{r}] uses a block twice: {list(used)}"
                )

    @property
    def num_requests(self) -> int:
        return len(self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        """Total new tokens of this forward: the length of the flat input."""
        return sum(self.num_new_tokens)

    def context_len(self, r: int) -> int:
        """Positions of request r that have K/V after this forward: cached + new."""
        return self.num_cached_tokens[r] + self.num_new_tokens[r]

    def num_blocks_needed(self, r: int) -> int:
        return -(-self.context_len(r) // self.tokens_per_block)


def _as_index(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            # Half precision: torch's fused kernel, which accumulates in float32 (one launch
            # instead of eight; what every Llama implementation computes).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (T, 1)
        return x * rms * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions (rotate-half convention, as in Llama)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.dtype = config.torch_dtype
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
        # Angles are computed in float64 and rounded once, so both paths and both dtypes agree.
        inv_freq = 1.0 / (config.rope_theta**exponents)  # (head_dim/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions are not checked here, on every forward: a check would read them back from
        # the device. The model's checked entry points and the engines check them first.
        angles = position_ids.to(torch.float64)[:, None] * self.inv_freq[None, :]  # (T, head_dim/2)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (T, n_head, head_dim) by each token's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (T, n_head, head_dim/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim/2)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (T, n_head, head_dim)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes: ``[start, stop)`` ranges of query and KV heads."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]

    @staticmethod
    def of(config: LlamaConfig, tp_size: int, tp_rank: int) -> HeadShard:
        """Query heads split evenly; KV heads split with them, or replicated when ranks outnumber
        them (each rank then holds the one KV head its query heads share)."""
        n_head, n_kv = config.num_heads, config.num_kv_heads
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

    Under tensor parallelism ``n_head`` and ``n_kv_head`` count this rank's heads only.
    """

    def __init__(self, config: LlamaConfig, mapping: Mapping) -> None:
        super().__init__()
        tp_size, tp_rank = mapping.attn_tp_size, mapping.attn_tp_rank
        shard = HeadShard.of(config, tp_size, tp_rank)
        self.n_head = shard.q_heads[1] - shard.q_heads[0]
        self.n_kv_head = shard.kv_heads[1] - shard.kv_heads[0]
        self.head_dim = hd = config.head_dim
        self.scale = config.head_dim**-0.5
        dtype, hidden = config.torch_dtype, config.hidden_size
        column = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank, tensor_parallel_mode=TensorParallelMode.COLUMN)
        q_rows = (shard.q_heads[0] * hd, shard.q_heads[1] * hd)
        kv_rows = (shard.kv_heads[0] * hd, shard.kv_heads[1] * hd)
        self.q_proj = Linear(hidden, config.num_heads * hd, shard=q_rows, **column)
        self.k_proj = Linear(hidden, config.num_kv_heads * hd, shard=kv_rows, **column)
        self.v_proj = Linear(hidden, config.num_kv_heads * hd, shard=kv_rows, **column)
        self.o_proj = Linear(
            config.num_heads * hd, hidden, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank,
            tensor_parallel_mode=TensorParallelMode.ROW, shard=q_rows,
        )

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
        q = self.q_proj(x).view(T, self.n_head, self.head_dim)  # (T, n_head, head_dim)
        k = self.k_proj(x).view(T, self.n_kv_head, self.head_dim)  # (T, n_kv_head, head_dim)
        v = self.v_proj(x).view(T, self.n_kv_head, self.head_dim)  # (T, n_kv_head, head_dim)
        if fused_rope_applies(q):
            rotate_qk_(q, k, cos, sin)  # one kernel for both, in place (attention_backend)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: LayerKV | None) -> torch.Tensor:
        """The attention itself -> (T, n_head, head_dim): through the paged backend, or, with no
        cache, one sequence where key j is visible to query i iff j <= i."""
        if paged is not None:  # the paged attention backend of the pools' device (attention_backend)
            return paged.attend(q, k, v, self.scale)
        T = q.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T)
        return self._attend(q, k, v, mask)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """y (T, n_head, head_dim) -> (T, hidden), summed over the ranks' heads."""
        return self.o_proj(y.reshape(y.shape[0], self.n_head * self.head_dim))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q (Tq, n_head, head_dim), k/v (Tk, n_kv_head, head_dim), mask (Tq, Tk) True = visible."""
        group = self.n_head // self.n_kv_head
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_head, Tk, head_dim)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_head, Tk, head_dim)
        q = q.transpose(0, 1)  # (n_head, Tq, head_dim)
        scores = (q @ k.transpose(1, 2)) * self.scale  # (n_head, Tq, Tk)
        scores = scores.masked_fill(~mask[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (n_head, Tq, Tk)
        return (probs @ v).transpose(0, 1)  # (Tq, n_head, head_dim)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, config: LlamaConfig, mapping: Mapping) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        tp = dict(dtype=config.torch_dtype, tp_size=mapping.mlp_tp_size, tp_rank=mapping.mlp_tp_rank)
        self.gate_proj = Linear(hidden, inner, tensor_parallel_mode=TensorParallelMode.COLUMN, **tp)
        self.up_proj = Linear(hidden, inner, tensor_parallel_mode=TensorParallelMode.COLUMN, **tp)
        self.down_proj = Linear(inner, hidden, tensor_parallel_mode=TensorParallelMode.ROW, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, mapping: Mapping) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, mapping)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, mapping)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        paged: LayerKV | None,
    ) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.finish(x, self.self_attn.attend(q, k, v, paged))

    # The layer in two halves around its attention (the piecewise CUDA graphs capture each half).
    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> the attention's q, k, v (RoPE applied)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The residual stream x (T, hidden) and the attention's y (T, n_head, head_dim) -> the layer's output."""
        x = x + self.self_attn.output(y)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: token ids -> normalised hidden states."""

    def __init__(self, config: LlamaConfig, mapping: Mapping) -> None:
        super().__init__()
        # An uninitialised weight: skip_init's meta-device init loads torch's reference
        # decompositions, several seconds in every process (each rank is one).
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=config.torch_dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, mapping) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """-> the residual stream x (T, hidden) and the RoPE tables cos, sin (T, head_dim/2)."""
        return self.embed_tokens(input_ids), *self.rotary_emb(position_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        paged: list[LayerKV] | None,
    ) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, position_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, position_ids, cos, sin, None if paged is None else paged[i])
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Llama decoder run on a paged KV cache.

    ``weights`` maps every parameter name (``named_parameters()``: a tied LM head appears only
    as ``model.embed_tokens.weight``) to a tensor of its shape; one already of the config's dtype
    (and contiguous) becomes the parameter itself, without a copy (a checkpoint's weights are not
    duplicated), others are converted. Without ``weights`` they are drawn from ``config.seed``.

    Weights never require grad: the model only serves. Both forwards work with or without
    ``torch.inference_mode()``; the KV pools must then be ordinary tensors, or inference
    tensors written under inference mode.

    With a ``mapping`` of several ranks this is one rank's shard: every rank must run the same
    forwards in the same order (their all-reduces pair up), and its KV pools hold only its
    own KV heads (:meth:`kv_cache_shape`). ``weights`` are always full (unsharded) tensors;
    each rank keeps its slice.

    ``device``: where the weights are drawn and live (default the CPU). The weights depend on
    the seed and on the device type: on the CPU they are drawn in float64, on an accelerator in
    float32 by that device's generator (a 12B model in milliseconds instead of minutes). To run
    CPU weights on a GPU, build on the CPU and move the model with ``.to(device)`` (not with a
    dtype: the RoPE frequencies stay float64).
    """

    def __init__(
        self,
        config: LlamaConfig,
        mapping: Mapping | None = None,
        *,
        weights: WeightMap | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.mapping = mapping = mapping or Mapping()
        self.model = LlamaModel(config, mapping)
        self.num_local_kv_heads = self.model.layers[0].self_attn.n_kv_head if config.num_layers else 0
        # A tied LM head is the embedding, which every rank holds whole: it stays unsharded and
        # every rank computes all the logits (no gather; the same values as one rank's).
        head_tp = (1, 0) if config.tie_word_embeddings else (mapping.mlp_tp_size, mapping.mlp_tp_rank)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, dtype=config.torch_dtype, tp_size=head_tp[0],
            tp_rank=head_tp[1], tensor_parallel_mode=TensorParallelMode.COLUMN, gather_output=True,
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device is not None and torch.device(device).type != "cpu":
            # The CPU tensors skip_init made are untouched (no page is written), so moving them
            # empty costs nothing; only the RoPE frequencies carry values.
            inv_freq = self.model.rotary_emb.inv_freq
            self.to_empty(device=device)
            self.model.rotary_emb.inv_freq = inv_freq.to(device)
        if weights is None:
            self._init_weights()
        else:
            self._load_weights(weights)
        self.requires_grad_(False)
        if config.packs_linear_weights:
            if self.device.type != "cpu":
                raise ValueError(f"dtype {FLOAT16_WEIGHTS!r} runs on the CPU only (fbgemm), not on {self.device.type}")
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack_float16()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def _load_weights(self, weights: WeightMap) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        missing, unexpected = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
        for name, param in params.items():
            owner = modules[name.rpartition(".")[0]]
            full = owner.full_shape if isinstance(owner, Linear) else tuple(param.shape)
            if tuple(weights[name].shape) != tuple(full):
                raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, the model needs {tuple(full)}")
            tensor = owner.shard_weight(weights[name]) if isinstance(owner, Linear) else weights[name]
            if tensor.dtype == param.dtype and tensor.is_contiguous():
                param.data = tensor
            else:
                param.copy_(tensor)

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Draw from a local generator, in registration order: the global RNG is untouched. On
        # the CPU in float64, so float32 and float64 models of one seed hold the same weights
        # rounded; on an accelerator in float32 (likewise for bf16 and fp32 models there).
        # Full shapes are drawn on every rank and each keeps its shard, so a sharded model
        # holds exactly the slices of the single-rank model's weights.
        device = self.device
        noise_dtype = torch.float64 if device.type == "cpu" else torch.float32
        gen = torch.Generator(device).manual_seed(self.config.seed)
        modules = dict(self.named_modules())
        for name, param in self.named_parameters():
            owner = modules[name.rpartition(".")[0]]
            shape = owner.full_shape if isinstance(owner, Linear) else tuple(param.shape)
            noise = torch.randn(shape, generator=gen, dtype=noise_dtype, device=device)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise  # near 1, but not exactly, so the norms are exercised
            elif name == "model.embed_tokens.weight":
                value = noise
            else:
                value = noise * shape[1] ** -0.5  # keeps activations O(1) for any width
            param.copy_(owner.shard_weight(value) if isinstance(owner, Linear) else value)

    def kv_cache_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, ...]:
        """Shape of ONE layer's K (or V) pool on this rank:
        (num_blocks, tokens_per_block, num_local_kv_heads, head_dim)."""
        return (num_blocks, tokens_per_block, self.num_local_kv_heads, self.config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_metadata: AttentionMetadata,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, position_ids: (T,) int64 flat over requests. k_cache[layer], v_cache[layer]:
        the paged pools (kv_cache_shape). Writes the new tokens' K/V into their slots, then each
        new token attends causally to all positions <= its own position of the same request
        (cached prefix + new tokens); request r's new tokens sit at positions num_cached_tokens[r],
        num_cached_tokens[r] + 1, ... (position_ids must say so: they drive RoPE, the masks follow
        the metadata). Returns hidden states (T, hidden) after the final norm. Never reads slots
        beyond a request's own length.

        The checked entry point: it validates every input, token ids and positions by value too
        (on an accelerator that reads them back, so it waits for the device), and picks the
        attention backend of the pools' device (``attention_backend.plan_builder``). The engines
        check their inputs on the host and call :meth:`forward_with_plan` with their own builder's plan."""
        T = attn_metadata.num_tokens
        self._check_ids(input_ids, "input_ids", T)
        self._check_ids(position_ids, "position_ids", T)
        self.check_kv_pools(k_cache, v_cache, attn_metadata.tokens_per_block)
        builder = plan_builder(
            k_cache[0].device,
            tokens_per_block=attn_metadata.tokens_per_block,
            num_blocks=k_cache[0].shape[0],
            num_kv_heads=self.num_local_kv_heads,
            dtype=self.config.torch_dtype,
        )
        plan = builder.build(attn_metadata.num_new_tokens, attn_metadata.num_cached_tokens, attn_metadata.block_tables)
        return self.forward_with_plan(input_ids, position_ids, plan, k_cache, v_cache)

    def forward_with_plan(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        plan: AttentionPlan,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """What the engines run: as :meth:`forward`, with the attention plan built beforehand by
        their device's builder (``attention_backend``), and nothing checked or read back. Nothing
        in it waits for the device, so an engine can enqueue it ahead of the GPU or capture it in
        a CUDA graph. Returns (T, hidden)."""
        paged = [plan.layer(k, v) for k, v in zip(k_cache, v_cache)]
        return self.model(input_ids, position_ids, paged)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab)."""
        return self.lm_head(hidden)

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference path with no cache: (L,) token ids of ONE sequence -> logits (L, vocab),
        plain causal attention."""
        L = input_ids.shape[0] if input_ids.dim() == 1 else -1
        self._check_ids(input_ids, "input_ids", L)
        if L > self.config.max_position_embeddings:
            raise ValueError(f"position_ids must lie in [0, {self.config.max_position_embeddings}), got [0, {L - 1}]")
        position_ids = torch.arange(L, dtype=torch.int64, device=input_ids.device)  # (L,)
        return self.compute_logits(self.model(input_ids, position_ids, None))  # (L, vocab)

    # ----------------------------------------------------------------------- checks

    def _check_ids(self, ids: torch.Tensor, name: str, length: int) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor")
        if ids.shape[0] != length:
            raise ValueError(
                f"{name} has {ids.shape[0]} tokens, attn_metadata.num_new_tokens sum to {length}"
            )
        if not ids.numel():
            return
        low, high = int(ids.min()), int(ids.max())  # reads them back: the checked entry points only
        if name == "input_ids" and (low < 0 or high >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size})")
        if name == "position_ids" and (low < 0 or high >= self.config.max_position_embeddings):
            raise ValueError(f"position_ids must lie in [0, {self.config.max_position_embeddings}), got [{low}, {high}]")

    def check_kv_pools(
        self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], tokens_per_block: int
    ) -> None:
        """Raise ValueError unless ``k_cache`` and ``v_cache`` are one contiguous pool per layer of
        :meth:`kv_cache_shape` (any number of blocks) and the model's dtype. :meth:`forward`
        checks every call; an engine checks its pools once, at construction."""
        n = self.config.num_layers
        if len(k_cache) != n or len(v_cache) != n:
            raise ValueError(
                f"k_cache and v_cache need one pool per layer ({n}), "
                f"got {len(k_cache)} and {len(v_cache)}"
            )
        expected = self.kv_cache_shape(k_cache[0].shape[0], tokens_per_block)
        for i, pool in enumerate([*k_cache, *v_cache]):
            which = f"{'k' if i < n else 'v'}_cache[{i % n}]"
            if tuple(pool.shape) != expected:
                raise ValueError(f"{which} has shape {tuple(pool.shape)}, expected {expected}")
            if pool.dtype != self.config.torch_dtype:
                raise ValueError(
                    f"{which} has dtype {pool.dtype}, the model runs in {self.config.torch_dtype}"
                )
            if not pool.is_contiguous():
                raise ValueError(f"{which} must be contiguous (slots are addressed flat)")
