"""FP8 KV scales derived from data at start-up, for a checkpoint that carries none.

An e4m3 value keeps 3 mantissa bits whatever its size, so a per-tensor scale changes the relative
error of normal values not at all; what it decides is which values fall out of the normal range:
below 2^-6 (subnormals, a fixed step of 2^-9: a V value of 0.01 keeps ~10% precision) and above
448 (saturated). With a scale of 1.0 a layer whose V values are all small stores most of them as
subnormals. So, as vLLM's ``calculate_kv_scales`` does, each layer's K and V scales come from the
largest magnitude the layer produces on data, rounded up to a power of two::

    k_scale[layer] = 2 ** ceil(log2(max |k| (after RoPE) * HEADROOM / 448))      v_scale[layer]: the same of |v|

A power of two moves only the exponent: every value that was in the normal range with 1.0 rounds
to the same mantissa (the same error), the ones that were subnormal or saturated gain, and the
division is exact. Any other scale rounds every value differently, which on SmolLM2 moved
perplexity by about a percent either way, as noise (``docs/gpu.md``).

over a calibration prefill run once, before the pool is written or a CUDA graph captured (the
scales are baked into both): the built-in paragraphs below through the model's tokenizer, or
seeded random token ids for a model without one. ``HEADROOM`` leaves room for tokens that exceed
what calibration saw before they saturate (vLLM divides by 200 for K and 100 for V, 2.2x and
4.5x). One scale per layer (the kernels take one per layer; a scale per head measured no better
on SmolLM2, ``docs/gpu.md``).

The paragraphs were written for this purpose; none appears in a benchmark or test text.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from tensorrt_llm._torch.attention_backend.kernels import reference_context_attention
from tensorrt_llm._torch.attention_backend.kv_quant import FP8_MAX, KvScales
from tensorrt_llm._torch.modules.rotary_embedding import apply_rotary

__all__ = ["CALIBRATION_TEXT", "HEADROOM", "KvCalibration", "calibrate_kv_scales", "calibration_token_ids",
           "power_of_two_scale"]

logger = logging.getLogger(__name__)

HEADROOM = 2.0

CALIBRATION_TEXT = (
    "Dear Ms. Okafor, thank you for your letter of 12 March. I have checked the invoice again and you are right: "
    "the delivery charge was added twice. A refund of 38.50 euros will reach your account within five working "
    "days. Please accept our apologies for the trouble, and do not hesitate to call me if anything else is unclear.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = sum(values[:window])\n    result = [total / window]\n    for old, new in zip(values, values[window:]):\n"
    "        total += new - old\n        result.append(total / window)\n    return result\n",
    "\"Are you coming with us tonight?\" asked Tom, leaning against the doorframe.\n\"I can't,\" said Lena. \"My "
    "brother's flight lands at eleven and someone has to pick him up.\"\n\"Then we'll save you a seat for Sunday.\"",
    "The experiment used three groups of twenty plants. Group A received no fertiliser, group B a standard dose, "
    "and group C twice the standard dose. After six weeks the average heights were 14.2 cm, 21.7 cm and 19.9 cm, "
    "which suggests that more fertiliser does not always mean faster growth.",
)


@dataclass(frozen=True, slots=True)
class KvCalibration:
    """What a calibration derived: the scales, and the data they came from (for the start-up line)."""

    scales: KvScales
    tokens: int
    source: str  # "built-in text" | "random token ids"

    def describe(self) -> str:
        return (f"derived at start-up, per layer: max |K|, |V| x {HEADROOM:g} / 448 rounded up to a power of two, "
                f"over {self.tokens} tokens of {self.source} ({self.scales.describe()})")


def calibration_token_ids(tokenizer, vocab_size: int, *, seed: int = 0) -> tuple[list[list[int]], str]:
    """The calibration sequences: :data:`CALIBRATION_TEXT` through ``tokenizer`` (ids past
    ``vocab_size`` dropped), or, without a tokenizer, four sequences of 96 seeded random ids."""
    if tokenizer is not None:
        sequences = [[i for i in tokenizer.encode(text) if i < vocab_size] for text in CALIBRATION_TEXT]
        return [s for s in sequences if len(s) > 1], "built-in text"
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(96)] for _ in range(4)], "random token ids"


class _Recorder:
    """A stand-in for a paged layer: records max |k| (after RoPE) and max |v| and attends without a
    cache (plain causal), for plain and fused decoder layers alike."""

    def __init__(self) -> None:
        self.k_max = 0.0
        self.v_max = 0.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.k_max = max(self.k_max, float(k.abs().max()))
        self.v_max = max(self.v_max, float(v.abs().max()))
        return reference_context_attention(q, k, v, (q.shape[0],), (k.shape[0],), scale)

    def attend_rotary(self, q, k, v, cos, sin, scale: float) -> torch.Tensor:
        return self.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, scale)


@torch.inference_mode()
def calibrate_kv_scales(model, sequences: Sequence[Sequence[int]], source: str = "data") -> KvCalibration:
    """Per-layer FP8 KV scales of ``model`` (a ``LlamaForCausalLM``) from one prefill of each of
    ``sequences`` (module docstring). A layer whose K or V is all zeros keeps 1.0."""
    recorders = [_Recorder() for _ in model.model.layers]
    tokens = 0
    for sequence in sequences:
        ids = torch.tensor(list(sequence), dtype=torch.int64, device=model.device)  # (L,)
        positions = torch.arange(len(sequence), dtype=torch.int64, device=model.device)
        model.model(ids, positions, recorders)
        tokens += len(sequence)
    k = tuple(power_of_two_scale(r.k_max) for r in recorders)
    v = tuple(power_of_two_scale(r.v_max) for r in recorders)
    return KvCalibration(KvScales(k, v), tokens, source)


def power_of_two_scale(largest: float) -> float:
    """The least power of two ``s`` with ``largest / s <= 448 / HEADROOM`` (1.0 for 0: an all-zero tensor)."""
    if largest <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(largest * HEADROOM / FP8_MAX))
