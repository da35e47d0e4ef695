"""A Llama-style decoder run by the executor on a paged KV cache: Llama 2/3/3.1/3.2, Mistral,
Qwen2 and Qwen3 are one decoder with a few switches (``LlamaConfig``)::

    architecture        q/k/v bias  o bias  q/k norm  RoPE scaling
    LlamaForCausalLM    attention_bias      -         default, linear, dynamic, llama3
    MistralForCausalLM  -           -       -         default
    Qwen2ForCausalLM    yes         -       -         default
    Qwen3ForCausalLM    attention_bias      yes       default

plus, for all, tied embeddings, a ``head_dim`` of its own and any number of KV heads. The layers
live in ``_torch/modules`` (upstream's names: ``rms_norm``, ``rotary_embedding``, ``attention``,
``gated_mlp``, ``linear``); the metadata of a flat forward in ``attention_backend/interface.py``.
Their names stay importable from here.

Weights are either given (a checkpoint: ``checkpoints/``, Hugging Face safetensors or GGUF) or
drawn from a local ``torch.Generator`` seeded by ``LlamaConfig.seed``, so two engines built from
the same config compute the same tokens bit for bit, and greedy outputs can be compared across
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

from dataclasses import dataclass
from typing import Collection, Protocol
from typing import Mapping as WeightMapping

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionPlan, LayerKV, plan_builder
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.models.linear_formats import LinearFormats, install_linear_methods
from tensorrt_llm._torch.modules.attention import Attention, HeadShard
from tensorrt_llm._torch.modules.batch_invariant import make_batch_invariant
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode
from tensorrt_llm._torch.modules.linear_methods import BlockQuantizedWeight
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import RopeScaling, RotaryEmbedding, apply_rotary
from tensorrt_llm.mapping import Mapping

# Re-exported: these lived here before the layers moved to ``modules`` and ``attention_backend``.
MLP = GatedMLP
__all__ = [
    "FLOAT16_WEIGHTS", "MLP", "MODEL_PRESETS", "Attention", "AttentionMetadata", "DecoderLayer", "GatedMLP", "HeadShard",
    "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "RMSNorm", "RopeScaling", "RotaryEmbedding", "WeightSource",
    "apply_rotary",
]

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
    """Sizes of a Llama-style decoder, its per-architecture switches, and the seed of its weights
    when none are given.

    ``max_position_embeddings`` is the number of positions the engine serves (a Hugging Face
    checkpoint's own, or fewer where its attention would change past them: see
    ``checkpoints/hf_config.py``). ``rope_scaling``: the frequencies' scaling
    (:class:`RopeScaling`); a ``dynamic`` one serves at most its ``original_max_position_embeddings``.
    """

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
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2; Llama's and Qwen3's attention_bias)
    o_bias: bool = False  # a bias on o_proj (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3), with rms_norm_eps
    rope_scaling: RopeScaling = RopeScaling()
    # The batch-invariant kernels (modules/batch_invariant.py): a row's outputs do not depend on the
    # batch, the chunking or the thread count. CPU and one rank only. Not the architecture: how it computes.
    batch_invariant: bool = False

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
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        scaling = self.rope_scaling
        if scaling.rope_type == "dynamic" and self.max_position_embeddings > scaling.original_max_position_embeddings:
            raise ValueError(
                f"LlamaConfig.max_position_embeddings ({self.max_position_embeddings}) exceeds the dynamic RoPE's "
                f"original_max_position_embeddings ({scaling.original_max_position_embeddings}), past which its "
                "frequencies depend on each forward's length (see RopeScaling)"
            )

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
    # The shape of Llama-3.1-8B (what peers publish serving figures for): 8.0B parameters, 16.1 GB
    # in bf16, KV 128 KiB a token (64 KiB in FP8). Random weights, plain RoPE (Llama 3.1's frequency
    # scaling changes the angles, not the work); build it on a GPU.
    "llama-3.1-8b-random": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
}


# --------------------------------------------------------------------------- layers


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. The architectures
    differ only inside the attention (``LlamaConfig``'s switches)."""

    def __init__(self, config: LlamaConfig, mapping: Mapping) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, dtype=dtype,
            tp_size=mapping.attn_tp_size, tp_rank=mapping.attn_tp_rank, qkv_bias=config.qkv_bias,
            o_bias=config.o_bias, qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype, tp_size=mapping.mlp_tp_size,
                            tp_rank=mapping.mlp_tp_rank)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        paged: LayerKV | None,
    ) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.finish(x, self.attend(q, k, v, cos, sin, paged))

    # The layer in three parts: the piecewise CUDA graphs capture the two around the attention,
    # and run ``attend`` between them. (``fused_layers.FusedDecoderLayer``, the GPU's, splits
    # the same way, with RoPE in ``attend``, fused with the KV write.)
    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> the attention's q, k, v (RoPE applied)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               paged: LayerKV | None) -> torch.Tensor:
        """:meth:`attention_inputs`' q, k, v -> the attention's y (T, n_head, head_dim) (cos, sin:
        unused here, RoPE is applied already)."""
        return self.self_attn.attend(q, k, v, paged)

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
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.torch_dtype, config.rope_scaling)
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


class WeightSource(Protocol):
    """Full (unsharded) tensors by parameter name, read one at a time (a memory-mapped checkpoint:
    ``checkpoints/safetensors_reader.py``). The model reads each tensor once, copies its slice,
    then calls :meth:`release`."""

    def names(self) -> Collection[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor (its bytes may be read only where it is sliced)."""
        ...

    def release(self, name: str) -> None:
        """Done with ``name``: whatever was read for it may be dropped."""
        ...


class LlamaForCausalLM(nn.Module):
    """Llama-style decoder run on a paged KV cache.

    ``weights`` gives every parameter (``named_parameters()``: a tied LM head appears only as
    ``model.embed_tokens.weight``) a full tensor of its shape, either

    * a mapping of name to tensor: one already of the config's dtype (and contiguous) becomes
      the parameter itself, without a copy (a checkpoint's cached weights are not duplicated),
      others are converted; or
    * a :class:`WeightSource` (a checkpoint streamed from its files): each tensor is read once,
      this rank's slice copied into the parameter, converted to the config's dtype, then
      released, so the host holds one tensor beside the model at most.

    A missing, unexpected or misshapen tensor is a ValueError naming it (and both shapes).
    Without ``weights`` they are drawn from ``config.seed``.

    ``quantized``: parameter name -> a GGUF file's blocks of that weight (``BlockQuantizedWeight``),
    for linear layers that keep them and run torch's int4 kernel on the CPU (a bfloat16 model);
    their dense values are never made, and ``weights`` need not name them (a tied embedding is
    given both: its dense rows for the lookup, its blocks for the head). On the CPU each linear
    layer runs the method of the model's weight format (``linear_formats``; the attribute
    ``linear_formats`` says which).

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
        quantized: WeightMapping[str, BlockQuantizedWeight] | None = None,
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
        if config.packs_linear_weights and self.device.type != "cpu":
            raise ValueError(f"dtype {FLOAT16_WEIGHTS!r} runs on the CPU only (fbgemm), not on {self.device.type}")
        quantized = quantized or {}
        if weights is None:
            if quantized:
                raise ValueError("quantized weights come with the rest of a checkpoint's weights")
            self._init_weights()
        else:
            self._load_weights(weights, skip=quantized.keys())
        self.requires_grad_(False)
        if config.batch_invariant:
            if self.device.type != "cpu":
                raise ValueError(f"batch_invariant runs on the CPU only, not on {self.device.type} (docs/determinism.md)")
            if quantized:
                raise ValueError("batch_invariant needs dense weights: GGUF blocks kept quantized have no batch-invariant form")
        self.linear_formats: LinearFormats = install_linear_methods(self, quantized)
        if config.batch_invariant:
            # Every layer swapped for its batch-invariant form (float16-weights: by the float16-rounded
            # weights), the stacked projections undone. Unsharded layers only: a sharded one is refused
            # by name (InvariantLinear).
            make_batch_invariant(self, max_positions=config.max_position_embeddings,
                                 float16_weights=config.packs_linear_weights)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device  # the embedding is always dense

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The unsharded shape of parameter ``name`` (what a checkpoint holds)."""
        module_name, _, leaf = name.rpartition(".")
        owner = self.get_submodule(module_name)
        return owner.full_shape_of(leaf) if isinstance(owner, Linear) else tuple(getattr(owner, leaf).shape)

    @torch.no_grad()
    def _load_weights(self, weights: WeightMap | WeightSource, skip: Collection[str] = ()) -> None:
        """``skip``: parameters whose weights come in another form (``quantized``); loaded only if given."""
        source = weights if hasattr(weights, "release") else _MappingSource(weights)
        given = set(source.names())
        params = {name: p for name, p in self.named_parameters() if name not in skip or name in given}
        missing, unexpected = sorted(params.keys() - given), sorted(given - params.keys())
        if missing or unexpected:
            needs = ", ".join(f"{name} {self.full_shape(name)}" for name in missing[:8])
            raise ValueError(f"weights do not match the model: missing [{needs}{' ...' if len(missing) > 8 else ''}], "
                             f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        for name in params:  # every shape first: a misshapen tensor is found before anything is read
            if tuple(source.shape(name)) != (full := self.full_shape(name)):
                raise ValueError(f"weight {name} has shape {tuple(source.shape(name))}, the model needs {full}")
        borrow = isinstance(source, _MappingSource)
        for name, param in params.items():
            module_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(module_name)
            tensor = source.tensor(name)
            part = owner.shard_parameter(leaf, tensor) if isinstance(owner, Linear) else tensor  # a view
            if borrow and part.dtype == param.dtype and part.is_contiguous() and part.device == param.device:
                param.data = part
            else:
                param.copy_(part)
            del tensor, part
            source.release(name)

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
            leaf = name.rpartition(".")[2]
            shape = self.full_shape(name)
            noise = torch.randn(shape, generator=gen, dtype=noise_dtype, device=device)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise  # near 1, but not exactly, so the norms are exercised
            elif name == "model.embed_tokens.weight":
                value = noise
            elif leaf == "bias":
                value = 0.1 * noise
            else:
                value = noise * shape[1] ** -0.5  # keeps activations O(1) for any width
            param.copy_(owner.shard_parameter(leaf, value) if isinstance(owner, Linear) else value)

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
            batch_invariant=self.config.batch_invariant,
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
        paged = [plan.layer(k, v, i) for i, (k, v) in enumerate(zip(k_cache, v_cache))]  # i: the layer's KV scales
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
            if pool.dtype not in (self.config.torch_dtype, torch.float8_e4m3fn):  # or an FP8 cache (kv_quant)
                raise ValueError(
                    f"{which} has dtype {pool.dtype}, the model runs in {self.config.torch_dtype}"
                    " (a KV cache holds that or float8_e4m3fn)"
                )
            if not pool.is_contiguous():
                raise ValueError(f"{which} must be contiguous (slots are addressed flat)")


class _MappingSource:
    """A mapping of name to tensor, as a :class:`WeightSource` (its tensors may become parameters)."""

    def __init__(self, weights: WeightMap) -> None:
        self._weights = weights

    def names(self) -> Collection[str]:
        return self._weights.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._weights[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        return self._weights[name]

    def release(self, name: str) -> None:
        pass
