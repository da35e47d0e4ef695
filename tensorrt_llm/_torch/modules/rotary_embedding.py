"""Rotary position embedding (RoPE, rotate-half convention) and the frequency scalings Llama-style
checkpoints use.

Each channel pair ``(i, i + head_dim/2)`` of a head turns by ``position * inv_freq[i]``. The
frequencies are what define a checkpoint's positions, so they are computed exactly as
``transformers`` computes them (``modeling_rope_utils``: the same float32 expressions, in the
same order), for every type in :data:`ROPE_TYPES`:

=============  ==========================================================================
``default``    ``inv_freq[i] = 1 / theta ** (2i / head_dim)``
``linear``     ``default / factor`` (positions interpolated by ``factor``)
``llama3``     Llama 3.1's: wavelengths longer than ``original / low_freq_factor`` divided by
               ``factor``, shorter than ``original / high_freq_factor`` kept, a smooth blend
               between (``original``: ``original_max_position_embeddings``)
``dynamic``    dynamic NTK: the base grows with the sequence length once it passes
               ``original_max_position_embeddings`` (see :class:`RopeScaling`)
=============  ==========================================================================

The angles ``position * inv_freq`` are then taken in float64 and their cosines and sines
rounded once to the model's dtype, so the paged and the reference forwards, and models of
different dtypes, agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ROPE_TYPES", "RopeScaling", "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]

#: The rope types the engine computes (transformers' names).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How a checkpoint rescales RoPE's frequencies (``rope_scaling`` / ``rope_parameters`` in a
    Hugging Face ``config.json``; the type names are transformers').

    ``dynamic`` -- what the engine does, exactly. transformers recomputes the frequencies of a
    forward from its longest position ``L``: for ``L <= original_max_position_embeddings`` they
    are the fixed ones of :func:`rope_inv_freq` (NTK's base formula at ``L = original``, which is
    ``theta`` up to rounding); beyond, the base grows with ``L``, so one token's rotation would
    depend on how long the forward that computed it was, which no KV cache (paged or not) can
    keep consistent. The engine therefore serves positions below ``original_max_position_embeddings``
    only (``LlamaConfig`` refuses a ``max_position_embeddings`` above it; the Hugging Face loader
    sets it so and logs it), where its frequencies are fixed and equal transformers' bit for bit:
    the same logits for every sequence the engine accepts, and K/V that do not depend on the
    forward that wrote them, so prefix reuse stays exact.
    """

    rope_type: str = "default"
    factor: float = 1.0  # linear, dynamic, llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3 (its wavelength bounds), dynamic (where NTK starts)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be a positive number, got {self.factor!r}")
        if self.rope_type == "default" and self.factor != 1.0:
            raise ValueError(f"rope_type 'default' takes no factor, got {self.factor!r}")
        needs = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "dynamic": ("original_max_position_embeddings",)}.get(self.rope_type, ())
        for name in needs:
            if getattr(self, name) is None:
                raise ValueError(f"rope_type {self.rope_type!r} needs rope_scaling.{name}")
        original = self.original_max_position_embeddings
        if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original <= 0):
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be a positive int, got {original!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"rope_type 'llama3' needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor!r} and {self.low_freq_factor!r}")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> torch.Tensor:
    """The (head_dim/2,) float32 frequencies of ``scaling``'s type, equal bit for bit to the ones
    transformers computes for the same config (same float32 operations, same order)."""
    base = theta
    if scaling.rope_type == "dynamic":
        # transformers' _compute_dynamic_ntk_parameters at its initial length (seq_len =
        # max_position_embeddings), the only frequencies it uses at or below that length.
        length = original = scaling.original_max_position_embeddings
        base = base * ((scaling.factor * length / original) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim  # (head_dim/2,)
    inv_freq = 1.0 / (base**exponents)
    if scaling.rope_type == "linear":
        inv_freq /= scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are interpolated by factor; short ones kept
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # the blend in between
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (T, head_dim/2) for the given positions, in ``dtype``."""

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype, scaling: RopeScaling = RopeScaling()) -> None:
        super().__init__()
        self.dtype = dtype
        self.scaling = scaling
        # float32 values (the checkpoint's definition) held in float64: the angles are taken in float64.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(torch.float64), persistent=False)

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
