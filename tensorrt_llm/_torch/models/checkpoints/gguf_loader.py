"""Llama checkpoints in GGUF files (llama.cpp's format) -> :class:`LlamaForCausalLM`.

A GGUF file holds key/value metadata (architecture sizes, tokenizer, chat template) and named
tensors, most of them block-quantised (Q4_1, Q8_0, ...). Reading it has two costs of a few
seconds each: the ``gguf`` package's reader parses the metadata (the tokenizer's ~100k strings
dominate), and ``gguf.quants.dequantize`` expands the tensors to float32. Both are paid once per
file and process: :func:`open_gguf` caches the parsed file, and its ``tensors`` are dequantised
on first use and kept (float32, about 4 bytes per parameter; :func:`open_gguf.cache_clear`
drops them).

Two layout facts differ from the Hugging Face checkpoints our model follows:

* llama.cpp's converter permutes the rows of every head of ``attn_q`` / ``attn_k`` so that
  RoPE rotates *adjacent* channel pairs (2i, 2i+1) (GPT-J style); our model rotates
  (i, i + head_dim/2) (rotate-half, Hugging Face style). :func:`unpermute_qk` undoes it::

      GGUF row of a head   2i + j       (i < head_dim/2, j in {0, 1})
      HF row of the head   j * head_dim/2 + i

  Left undone, the model still writes fluent short text, but its perplexity is several-fold
  worse: the tests and ``benchmarks/model/decode_speed.py`` measure exactly that.
* without an ``output.weight`` tensor the LM head is tied to the token embedding.

Quantized matrices are dequantised by default. With ``keep_quantized`` (``LLM(...,
quantization="gguf")``, the CPU default for such a file) the linear layers keep the file's Q4_0,
Q4_1 and Q8_0 blocks instead (``gguf_blocks``) and run torch's int4 kernel with bfloat16
activations (``modules/linear_methods``); only the embedding's rows are dequantised (to bfloat16,
for the lookup), and a tied LM head multiplies by the embedding's blocks. :func:`blocks_unsupported`
says why a file cannot be kept so (another block format, such as the K-quants, in a linear layer).

Tensor names map to our parameters as ``token_embd`` -> ``model.embed_tokens``, ``blk.N.attn_q``
-> ``model.layers.N.self_attn.q_proj`` and so on (:data:`_LAYER_TENSORS`). Anything else in the
file (biases, ``rope_freqs``, experts) is a feature our model lacks, so the file is refused with
a :class:`CheckpointError` that names it rather than served wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError
from tensorrt_llm._torch.models.checkpoints.gguf_blocks import read_blocks
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.modules.linear_methods import BLOCK_FORMATS, BlockQuantizedWeight

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
DENSE_TYPES = ("F32", "F16", "BF16")
KEPT_ACTIVATIONS = "bfloat16"  # the model's dtype when the blocks are kept (the int4 kernel's fast path)

# GGUF tensor name inside block N -> our parameter name inside model.layers.N
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFCheckpoint:
    """One GGUF file: its metadata (decoded to Python values) and, on first use, its tensors
    dequantised to float32 in PyTorch's (rows, columns) order. Treat them as read-only: they are
    shared by every model built from the file (each model copies them into its parameters)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader  # heavy import, only where a GGUF file is read

        self.path = path
        try:
            self._reader = GGUFReader(path)
        except (ValueError, OSError, KeyError) as error:
            raise CheckpointError(f"{path}: not a readable GGUF file ({error})") from error
        self.metadata: Mapping[str, Any] = {
            name: field.contents() for name, field in self._reader.fields.items() if not name.startswith("GGUF.")
        }
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self._dequantize_all()
        return self._tensors

    def _dequantize_all(self) -> dict[str, torch.Tensor]:
        from gguf.quants import dequantize

        tensors = {}
        for tensor in self._reader.tensors:
            try:
                array = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as error:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf"
                    f" package cannot dequantise ({error})"
                ) from error
            array = np.asarray(array, dtype=np.float32)
            if not (array.flags.writeable and array.flags.c_contiguous):  # F32 tensors are views of the file
                array = array.copy()
            tensors[tensor.name] = torch.from_numpy(array)
        logger.info("dequantised %d tensors of %s", len(tensors), self.path.name)
        return tensors


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """The parsed GGUF file at ``path``, cached per process (a changed file is read again)."""
    path = Path(path).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as error:
        raise CheckpointError(f"cannot read GGUF file {path}: {error.strerror}") from error
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file")
    return _open_gguf(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    logger.info("reading %s (%.0f MB)", path, size / 1e6)
    return GGUFCheckpoint(path)


open_gguf.cache_clear = _open_gguf.cache_clear  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- config


def llama_config_from_gguf(checkpoint: GGUFCheckpoint, *, dtype: str = "float32") -> LlamaConfig:
    """The model's sizes from the ``llama.*`` metadata; refuses other architectures and llama
    variants our model does not implement (partial rotary, RoPE scaling, mixture of experts)."""
    arch = checkpoint.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise CheckpointError(f"{checkpoint.path.name}: architecture {arch!r} is not supported (supported: {supported})")
    meta = checkpoint.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{checkpoint.path.name}: metadata {arch}.{key} is missing")
        if isinstance(value, list):
            raise CheckpointError(f"{checkpoint.path.name}: per-layer {arch}.{key} is not supported")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{checkpoint.path.name}: value heads of another width than key heads are not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{checkpoint.path.name}: partial rotary embeddings are not supported")
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(f"{checkpoint.path.name}: RoPE scaling {scaling!r} is not supported")
    if int(meta.get(f"{arch}.expert_count", 0) or 0):
        raise CheckpointError(f"{checkpoint.path.name}: mixture-of-experts models are not supported")
    embedding = _tensor_shape(checkpoint, "token_embd.weight")
    vocab = int(meta.get(f"{arch}.vocab_size") or embedding[0])
    if embedding != (vocab, hidden):
        raise CheckpointError(
            f"{checkpoint.path.name}: token_embd.weight has shape {embedding}, the metadata says ({vocab}, {hidden})"
        )
    try:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            rope_theta=_decimal(get("rope.freq_base", 10000.0)),
            rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            dtype=dtype,
            tie_word_embeddings="output.weight" not in _tensor_names(checkpoint),
        )
    except ValueError as error:
        raise CheckpointError(f"{checkpoint.path.name}: {error}") from error


def _decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-5, not 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def _tensor_names(checkpoint: GGUFCheckpoint) -> set[str]:
    return {tensor.name for tensor in checkpoint._reader.tensors}


def _tensor_shape(checkpoint: GGUFCheckpoint, name: str) -> tuple[int, ...]:
    for tensor in checkpoint._reader.tensors:
        if tensor.name == name:
            return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    raise CheckpointError(f"{checkpoint.path.name}: tensor {name} is missing")


# --------------------------------------------------------------------------- weights


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a GGUF q/k projection (adjacent RoPE pairs) -> rotate-half order, per head."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, cols)  # (head, i, j, in): row 2i + j
    return pairs.transpose(1, 2).reshape(rows, cols)  # (head, j, i, in): row j * head_dim/2 + i


def llama_weights_from_gguf(
    checkpoint: GGUFCheckpoint, config: LlamaConfig, *, undo_qk_permutation: bool = True
) -> dict[str, torch.Tensor]:
    """Parameter name -> float32 tensor, ready for ``LlamaForCausalLM(config, weights=weights)``.

    ``undo_qk_permutation=False`` keeps llama.cpp's q/k row order: a deliberately wrong model,
    for measuring what the permutation is worth (perplexity), never for serving.
    """
    weights: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in checkpoint.tensors.items():
        target = _parameter_name(name, config.num_layers)
        if target is None:
            unknown.append(name)
            continue
        if undo_qk_permutation and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if name.endswith("attn_q.weight") else config.num_kv_heads
            tensor = unpermute_qk(tensor, heads)
        weights[target] = tensor
    if unknown:
        raise CheckpointError(
            f"{checkpoint.path.name}: tensors our Llama model has no place for: {', '.join(sorted(unknown)[:8])}"
            + (" ..." if len(unknown) > 8 else "")
        )
    return weights


def _parameter_name(gguf_name: str, num_layers: int) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    block, _, rest = gguf_name.partition(".")
    index, _, tail = rest.partition(".")
    if block == "blk" and index.isdigit() and int(index) < num_layers and tail in _LAYER_TENSORS:
        return f"model.layers.{int(index)}.{_LAYER_TENSORS[tail]}"
    return None


def blocks_unsupported(checkpoint: GGUFCheckpoint, config: LlamaConfig) -> str | None:
    """Why the file's decoder layers cannot keep its blocks (None: they can): a block format other
    than Q4_0, Q4_1, Q8_0 in a projection, or a quantized projection whose rows do not pack by 16
    (the int4 kernel's). The LM head is not asked: a bfloat16 model runs it in float16, for float32
    logits, whatever the file stores (``linear_methods.logits_method``)."""
    problems = []
    for tensor in checkpoint._reader.tensors:
        target = _parameter_name(tensor.name, config.num_layers)
        if target is None or not target.endswith("proj.weight"):
            continue
        kind = tensor.tensor_type.name
        rows = int(tensor.shape[-1])  # GGUF lists the fastest dimension first
        if kind not in BLOCK_FORMATS + DENSE_TYPES:
            problems.append(f"{tensor.name} is {kind}")
        elif kind in BLOCK_FORMATS and rows % 16:
            problems.append(f"{tensor.name} has {rows} rows (the int4 kernel packs rows by 16)")
    if not problems:
        return None
    return (f"{', '.join(problems[:4])}{' ...' if len(problems) > 4 else ''}: the linear layers keep "
            f"{', '.join(BLOCK_FORMATS)} blocks (and {', '.join(DENSE_TYPES)} matrices)")


def llama_blocks_from_gguf(
    checkpoint: GGUFCheckpoint, config: LlamaConfig, *, undo_qk_permutation: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, BlockQuantizedWeight]]:
    """``(dense, quantized)`` for ``LlamaForCausalLM(config, weights=dense, quantized=quantized)``:
    every Q4_0 / Q4_1 / Q8_0 matrix as its blocks (q/k rows unpermuted, which blocks allow: they
    lie within rows), everything else dense in ``config``'s dtype; the embedding both ways when
    it is quantized (its rows for the lookup, its blocks for a tied head). Raises CheckpointError
    where :func:`blocks_unsupported` says why."""
    why = blocks_unsupported(checkpoint, config)
    if why is not None:
        raise CheckpointError(f"{checkpoint.path.name}: {why}")
    from gguf.quants import dequantize

    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, BlockQuantizedWeight] = {}
    unknown = []
    for tensor in checkpoint._reader.tensors:
        target = _parameter_name(tensor.name, config.num_layers)
        if target is None:
            unknown.append(tensor.name)
            continue
        kind = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))
        heads = _qk_heads(tensor.name, config) if undo_qk_permutation else None
        if kind in BLOCK_FORMATS and len(shape) == 2:
            blocks = read_blocks(kind, tensor.data, *shape)
            if heads is not None:
                blocks = blocks.rows_permuted(unpermute_qk(torch.arange(shape[0])[:, None], heads)[:, 0])
            quantized[target] = blocks
            if target == "model.embed_tokens.weight":  # the lookup reads dense rows
                dense[target] = blocks.dequantize().to(config.torch_dtype)
            continue
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        value = torch.from_numpy(array.copy()).to(config.torch_dtype)
        dense[target] = unpermute_qk(value, heads) if heads is not None else value
    if unknown:
        raise CheckpointError(f"{checkpoint.path.name}: tensors our Llama model has no place for: "
                              f"{', '.join(sorted(unknown)[:8])}" + (" ..." if len(unknown) > 8 else ""))
    return dense, quantized


def _qk_heads(name: str, config: LlamaConfig) -> int | None:
    if name.endswith("attn_q.weight"):
        return config.num_heads
    return config.num_kv_heads if name.endswith("attn_k.weight") else None


def load_llama_from_gguf(
    path: str | os.PathLike[str], *, dtype: str = "float32", undo_qk_permutation: bool = True,
    batch_invariant: bool = False, keep_quantized: bool = False, device: torch.device | str | None = None,
) -> LlamaForCausalLM:
    """A :class:`LlamaForCausalLM` holding the GGUF file's weights: dequantised, in ``dtype``; or,
    with ``keep_quantized``, its Q4_0 / Q4_1 / Q8_0 blocks as they are, in a bfloat16 model on the
    CPU (``dtype`` must then be bfloat16). ``device``: where the model is built (the default: the CPU).
    ``batch_invariant``: ``LlamaConfig.batch_invariant`` (dequantised weights only)."""
    checkpoint = open_gguf(path)
    if keep_quantized and dtype != KEPT_ACTIVATIONS:
        raise CheckpointError(f"{checkpoint.path.name}: kept GGUF blocks run with {KEPT_ACTIVATIONS} activations,"
                              f" not {dtype}")
    if keep_quantized and batch_invariant:
        raise CheckpointError(f"{checkpoint.path.name}: kept GGUF blocks have no batch-invariant form")
    config = dataclasses.replace(llama_config_from_gguf(checkpoint, dtype=dtype), batch_invariant=batch_invariant)
    if keep_quantized:
        weights, quantized = llama_blocks_from_gguf(checkpoint, config, undo_qk_permutation=undo_qk_permutation)
    else:
        weights, quantized = llama_weights_from_gguf(checkpoint, config, undo_qk_permutation=undo_qk_permutation), None
    try:
        return LlamaForCausalLM(config, weights=weights, device=device, quantized=quantized)
    except ValueError as error:  # a tensor of the wrong shape, or a missing one
        raise CheckpointError(f"{checkpoint.path.name}: {error}") from error
