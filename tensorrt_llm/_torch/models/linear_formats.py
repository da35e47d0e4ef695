"""Which linear method each linear layer of a loaded model runs (``modules/linear_methods``), decided
once, at load, from the model's dtype and the weights it was given.

On the CPU, per decoder layer::

    q_proj, k_proj, v_proj   -> one method over their rows stacked (Attention.fuse_qkv)
    o_proj                   -> its own
    gate_proj, up_proj       -> one method over their rows stacked (GatedMLP.fuse_gate_up)
    down_proj                -> its own
    and the LM head          -> its own (a tied head: over the embedding's weight, or its GGUF blocks);
                                with GGUF blocks kept, fbgemm's float16, for float32 logits (logits_method)

Each method is the weight format's (``linear_method``): GGUF blocks -> int4 groups, a
``float16-weights`` model -> fbgemm's float16; float32, float64 and bfloat16 run ``F.linear`` on
the weights as loaded, unfused.
Fusing matters on the CPU because a decode step of a small model is hundreds of short kernel
calls: three projections in one call save two of them in every layer (``docs/cpu-decode.md``).
Layers whose sources cannot share a method (GGUF blocks of different widths: Q8_0 beside Q4_1)
get one each; ``float16-weights`` keeps its float32 weights beside the packed copy (shared with a
GGUF file's cache). Nothing changes on a GPU, where the CUDA graphs remove the calls' cost. A model
given CPU methods stays on the CPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.linear_methods import BlockQuantizedWeight, LinearMethod, linear_method, logits_method

__all__ = ["LinearFormats", "install_linear_methods"]


@dataclass(frozen=True, slots=True)
class LinearFormats:
    """What the model's linear layers store and run: ``(format, layers, bytes)`` per format (a fused
    group counts its layers), and the bytes a forward reads from them all."""

    formats: tuple[tuple[str, int, int], ...]
    held_bytes: int = 0  # bytes the methods hold in place of dropped (or never made) dense weights

    @property
    def weight_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.formats)

    def describe(self) -> str:
        """E.g. ``int4 groups of 32 (GGUF Q4_1) x 210, 66.4 MB; ...``."""
        return "; ".join(f"{fmt} x {count}, {nbytes / 1e6:.1f} MB" for fmt, count, nbytes in self.formats)


def install_linear_methods(model, quantized: Mapping[str, BlockQuantizedWeight]) -> LinearFormats:
    """Give ``model``'s linear layers their methods (module docstring) and say what they run.

    ``quantized``: parameter name -> the GGUF blocks of that weight, for layers whose dense weight
    was never made (their ``weight`` is None afterwards; a tied head's is the embedding's). They
    need the CPU and a bfloat16 model; raises ValueError otherwise, or where a block-quantized
    layer cannot run in the int4 kernel (its rows not a multiple of 16)."""
    config = model.config
    cpu = model.device.type == "cpu"
    if quantized and (not cpu or config.torch_dtype != torch.bfloat16):
        raise ValueError("GGUF block-quantized weights run on the CPU with bfloat16 activations, not on "
                         f"{model.device.type} in {config.dtype}")
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    served: set[int] = set()  # ids of the layers a method serves
    held = 0
    if cpu:
        dtype, float16 = config.torch_dtype, config.packs_linear_weights

        def install(named: Sequence[tuple[Linear, str]], fuse: Callable[[LinearMethod], None] | None = None,
                    *, tied: bool = False) -> None:
            nonlocal held
            for method, layers in _methods(named, quantized, dtype, float16, fuse, tied):
                counts[method.format] += len(layers)
                nbytes[method.format] += method.weight_bytes
                served.update(id(linear) for linear in layers)
                held += method.weight_bytes if any(linear.weight is None for linear in layers) else 0

        for i, layer in enumerate(model.model.layers):
            attn, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
            install([(getattr(attn, n), f"{p}self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")],
                    attn.fuse_qkv)
            install([(attn.o_proj, f"{p}self_attn.o_proj.weight")])
            install([(mlp.gate_proj, f"{p}mlp.gate_proj.weight"), (mlp.up_proj, f"{p}mlp.up_proj.weight")],
                    mlp.fuse_gate_up)
            install([(mlp.down_proj, f"{p}mlp.down_proj.weight")])
        tied = config.tie_word_embeddings
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        # a model that keeps GGUF blocks gets float32 logits (logits_method); a dense bfloat16 model's
        # head is one more bfloat16 layer (bfloat16 logits, as on a GPU, and no second copy of it)
        method = logits_method(quantized.get(head, model.lm_head.weight), dtype) if quantized else None
        if method is not None:
            model.lm_head.use_method(method, keep_weight=tied)  # a tied head's weight is the embedding
            held += 0 if tied else method.weight_bytes
            counts[method.format] += 1
            nbytes[method.format] += method.weight_bytes
            served.add(id(model.lm_head))
        else:
            install([(model.lm_head, head)], tied=tied)
    for linear in model.modules():  # whatever runs F.linear, as loaded
        if isinstance(linear, Linear) and id(linear) not in served:
            fmt = f"{str(linear.weight.dtype).removeprefix('torch.')} (F.linear)"
            counts[fmt] += 1
            nbytes[fmt] += linear.weight_bytes
    return LinearFormats(tuple((fmt, counts[fmt], nbytes[fmt]) for fmt in counts), held)


def _methods(named, quantized, dtype, float16, fuse, tied):
    """Install the methods of one group of layers; yields ``(method, the layers it serves)``."""
    sources = [quantized.get(name, linear.weight) for linear, name in named]
    biases = [linear.bias for linear, _ in named]
    same_bias = all(b is None for b in biases) or all(b is not None for b in biases)
    if fuse is not None and len(named) > 1 and same_bias and len({_stack_key(s) for s in sources}) == 1:
        bias = None if biases[0] is None else torch.cat(biases)
        method = linear_method(sources, dtype, float16_weights=float16, bias=bias)
        if method is not None:
            fuse(method)
            for linear, name in named:
                if name in quantized or method.replaces_weight:
                    linear.weight = None  # the stacked method holds it (or it was never made)
            yield method, [linear for linear, _ in named]
            return
    for (linear, name), source in zip(named, sources):
        method = linear_method([source], dtype, float16_weights=float16)
        if method is not None:
            linear.use_method(method, keep_weight=tied or (name not in quantized and not method.replaces_weight))
            yield method, [linear]


def _stack_key(source) -> tuple:
    """Sources with equal keys can share one method (module docstring)."""
    if isinstance(source, BlockQuantizedWeight):
        return ("int4", source.kind == "Q8_0", source.shape[1])
    return ("dense", source.dtype, source.shape[1])
