"""Batch-invariant arithmetic: reductions whose bits do not depend on how they are computed.

Float addition is not associative, so a reduction's bits depend on its order, and the kernels
choose the order: a BLAS GEMM blocks a row's dot products differently for 1, 2 or 64 rows
(measured: a row of a 576 x 1536 float32 ``F.linear`` differs in 1388 of its 1536 outputs between
a batch of 1 and of 4), by thread count and by instruction set; SDPA picks a kernel by shape and
mask. The batch-invariant mode (``docs/determinism.md``) uses two kinds of reduction instead:

* **Exact sums.** Integers whose sums cannot overflow are added exactly in every order: any
  kernel, blocking, thread count or instruction set gives the same bits. A vector becomes such
  integers on a grid of its own: ``x = ints * scale`` with ``scale`` a power of two set by the
  vector's largest magnitude (:func:`to_grid`), so the grid depends on that vector alone. Two
  ways to sum their products: in float64, exact while the magnitudes add up to at most ``2**53``
  (a dot product of ``K`` terms when ``bits_a + bits_b + ceil(log2 K) <= 53``, :func:`dot_bits`);
  or as 7-bit digits in int8 GEMMs with int32 sums (:func:`int_matmul`), recombined elementwise.
  The scales multiply back exactly (powers of two).
* **A fixed order.** A pairwise tree over positions, zero-padded to a power of two
  (:func:`fixed_order_sum`): the same additions for an entry whatever else the tensor holds, and
  the same for any padding (an exact zero added changes nothing).

Rounding to a grid changes a value by at most half its unit (``2**-bits`` of the vector's
largest magnitude, about float32's precision at the bits used here): the mode computes a
slightly different function from the default kernels, the same one for every batch.

Elementwise IEEE operations (``+ - * /``, ``sqrt``, ``round``, comparisons) are exactly rounded
wherever they run, in a vectorised body or a scalar tail. ``torch.exp`` and the functions built
on it are not: a vectorised (Sleef) and a scalar path may differ in the last bit, and which path
an element takes depends on the tensor's size and the thread count (``F.silu`` over the same
1000 values differs in 33 of them when computed in pieces of 3). :func:`exp` and :func:`silu`
are built from the exact operations.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DIGITS", "DIGIT_BITS", "FLOAT64_BITS", "INT_GRID_BITS", "dot_bits", "exp", "fixed_order_sum", "int_matmul",
           "pow2", "silu", "to_digits", "to_grid", "weight_digits"]

#: Significand bits of a float64: integers up to 2**53 are exact.
FLOAT64_BITS = 53
#: Balanced base-128 digits, each in [-64, 64], three to an integer of ``INT_GRID_BITS`` bits. The
#: bound keeps int8 GEMMs exact on every x86 path: without VNNI, ``vpmaddubsw`` adds two products
#: of an unsigned and a signed byte in int16 with saturation; 2 * 255 * 64 = 32640 stays below
#: 32767. A dot product's int32 sum of 64 * 64 * K stays exact for K below 2**19.
DIGIT_BITS = 7
DIGITS = 3
INT_GRID_BITS = DIGIT_BITS * DIGITS - 1  # |ints| <= 2**20: the top digit is at most 64

# ln 2 split so that k * _LN2_HI is exact for |k| < 2**20 (its low 32 bits are zero): Cody and Waite's.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_LOG2_E = 1.4426950408889634
# Taylor coefficients 1/n! of e**r on |r| <= ln(2)/2 (``exp``'s degree, highest first): degree 9
# leaves a relative error below 1e-11, degree 7 below 6e-9 (enough under a 2**-24 grid).
def _taylor(degree: int) -> tuple[float, ...]:
    return tuple(1.0 / math.factorial(n) for n in range(degree, -1, -1))
_EXP_LIMIT = 700.0  # e**700 and e**-700 are normal float64s: 2**k stays in range


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (float64) for integer exponents in [-1022, 1023], exactly: built from the
    bits (torch's ``ldexp`` multiplies by ``pow``, whose vectorised and scalar paths need not agree)."""
    return ((exponent + 1023).to(torch.int64) << 52).view(torch.float64)


def to_grid(x: torch.Tensor, bits: int, dim: int | tuple[int, ...] = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float64) as ``ints * scale``, rounded to the nearest point of a grid of its own per
    slice along ``dim``: ``scale`` (kept dims of size 1) is ``2**(e - bits)`` where ``2**e`` bounds
    the slice's largest magnitude, and ``ints`` are integers (float64) with ``|ints| <= 2**bits``.

    The grid of a slice depends on that slice alone. A slice of zeros has ints 0; a non-finite
    value keeps its slice's results non-finite."""
    top = x.abs().amax(dim=dim, keepdim=True)
    # top = m * 2**(biased - 1023) with m in [1, 2): top < 2**e for e = biased - 1022, and the
    # scale's own biased exponent is e - bits + 1023 (clamped to a normal float64: zeros and
    # non-finite slices get some scale, their ints are 0 or stay non-finite).
    biased = (top.view(torch.int64) >> 52) & 0x7FF
    scale = ((biased + (1 - bits)).clamp_(1, 2046) << 52).view(torch.float64)
    return torch.round(x * (1.0 / scale)), scale  # 1 / 2**k is exact


def to_digits(ints: torch.Tensor) -> torch.Tensor:
    """Integers (float64, ``|ints| <= 2**INT_GRID_BITS``) as their :data:`DIGITS` balanced base-128
    digits, lowest first: int8 ``(DIGITS, *ints.shape)`` with ``ints = sum_i digits[i] * 128**i``
    and every digit in [-64, 64]."""
    digits, rest = [], ints
    for _ in range(DIGITS - 1):
        high = torch.round(rest * (1.0 / 2**DIGIT_BITS))  # exact: a power of two, then the nearest integer
        digits.append(rest - high * 2**DIGIT_BITS)  # in [-64, 64]
        rest = high
    digits.append(rest)
    return torch.stack(digits).to(torch.int8)


def weight_digits(ints: torch.Tensor) -> torch.Tensor:
    """A weight's integers ``(K, N)`` (float64, ``|ints| <= 2**INT_GRID_BITS``) as the int8 right
    operand of :func:`int_matmul`: its digits side by side, ``(K, DIGITS * N)``, digit ``j`` in
    columns ``[j * N, (j + 1) * N)``."""
    return torch.cat(list(to_digits(ints)), dim=1).contiguous()


def int_matmul(x_digits: torch.Tensor, w_digits: torch.Tensor) -> torch.Tensor:
    """The integer product ``X @ W`` as float64 ``(T, N)`` (exact while ``|X @ W|`` stays below
    ``2**53``, as it does for up to 8192 inputs on the 20-bit grids; rounded in a fixed order
    beyond), of integers given as digits: ``x_digits`` (DIGITS, T, K) from :func:`to_digits`,
    ``w_digits`` (K, DIGITS * N) from :func:`weight_digits`. One int8 GEMM of every input digit
    (stacked as rows) by every weight digit (side by side): each weight byte is read once and
    every int32 sum is exact, so in any order; the nine products are then scaled into place and
    added elementwise, in a fixed order."""
    _, T, K = x_digits.shape
    N = w_digits.shape[1] // DIGITS
    parts = torch._int_mm(x_digits.reshape(DIGITS * T, K), w_digits)  # (DIGITS * T, DIGITS * N) int32
    parts = parts.view(DIGITS, T, DIGITS, N).to(torch.float64)  # [i, t, j, n]: input digit i times weight digit j
    base = float(2**DIGIT_BITS)
    by_weight_digit = parts[0] + parts[1] * base + parts[2] * (base * base)  # (T, DIGITS, N)
    return by_weight_digit[:, 0] + by_weight_digit[:, 1] * base + by_weight_digit[:, 2] * (base * base)


def dot_bits(terms: int) -> tuple[int, int]:
    """Grid bits ``(a, b)`` for two vectors whose dot product of ``terms`` terms must be exact:
    ``a + b + ceil(log2 terms) == 53``, split as evenly as possible."""
    free = FLOAT64_BITS - max(0, math.ceil(math.log2(max(terms, 1))))
    if free < 16:
        raise ValueError(f"an exact dot product of {terms} terms leaves {free} bits for its factors (at least 16)")
    return free - free // 2, free // 2


def fixed_order_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over ``dim`` by a pairwise tree over positions: entry ``i`` is first added to entry
    ``i + w/2`` of the input zero-padded to a power-of-two width ``w``, and so on down. The order
    depends on the positions alone, and padding further with zeros changes no bit (a zero's sign
    aside, made +0 at the end), so a sum over a row's first ``n`` positions is the same inside
    any wider zero-padded tensor."""
    dim = dim % x.dim()
    width = x.shape[dim]
    if width == 0:
        return x.sum(dim) + 0.0
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        zeros = x.new_zeros(*x.shape[:dim], padded - width, *x.shape[dim + 1 :])
        x = torch.cat((x, zeros), dim=dim)
    while padded > 1:
        padded //= 2
        x = x.narrow(dim, 0, padded) + x.narrow(dim, padded, padded)
    return x.squeeze(dim) + 0.0  # -0.0 + 0.0 is +0.0: the sign of a zero sum does not depend on the padding


def exp(x: torch.Tensor, degree: int = 9) -> torch.Tensor:
    """``e**x`` of float64 ``x`` from exactly rounded operations only, so every element gets the
    same bits wherever it sits in the tensor: relative error below 1e-11 at ``degree`` 9, 6e-9 at
    7. Arguments are clamped to [-700, 700] (so ``exp(-inf)`` is about 1e-304, not 0: mask such
    entries yourself); NaN stays NaN."""
    coefficients = _taylor(degree)
    x = x.clamp(-_EXP_LIMIT, _EXP_LIMIT)
    k = torch.round(x * _LOG2_E)  # x = k ln2 + r, |r| <= ln(2)/2 (about)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, coefficients[0])
    for coefficient in coefficients[1:]:  # Horner, each step two separately rounded operations
        p.mul_(r).add_(coefficient)
    return p * pow2(k.nan_to_num(0.0))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed in float64 with :func:`exp`, returned in ``x``'s dtype."""
    x64 = x.to(torch.float64)
    return (x64 / (1.0 + exp(-x64))).to(x.dtype)
