"""The batch-invariant arithmetic (``invariant_math``) and the CPU attention built on it
(``cpu_invariant``): a value's bits depend on its own inputs only.

Each property is checked where the default kernels measurably fail it: an ``F.linear`` row or an
``F.silu`` value computed in another shape, a query attended beside other sequences, after a
different chunking, with padding, or at another thread count.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.attention_backend.cpu_invariant import (
    KEY_BLOCK,
    CpuInvariantPlanBuilder,
    invariant_attention,
)
from tensorrt_llm._torch.attention_backend.invariant_math import (
    INT_GRID_BITS,
    dot_bits,
    exp,
    fixed_order_sum,
    int_matmul,
    pow2,
    silu,
    to_digits,
    to_grid,
    weight_digits,
)
from tests.helpers.strategies import examples

F64 = torch.float64


def _pieces(f, x: torch.Tensor, size: int) -> torch.Tensor:
    """``f`` applied to ``x`` in pieces of ``size`` values (another tensor shape, other vector tails)."""
    return torch.cat([f(x[i : i + size]) for i in range(0, x.numel(), size)])


# ---- the arithmetic ---------------------------------------------------------------------------


def test_pow2_is_exact_over_the_normal_range():
    exponents = torch.arange(-1022, 1024)
    assert torch.equal(pow2(exponents), torch.tensor([math.ldexp(1.0, e) for e in range(-1022, 1024)], dtype=F64))


def test_to_grid_rounds_each_slice_on_its_own_grid():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen, dtype=F64) * torch.logspace(-30, 30, 6, dtype=F64)[:, None]
    ints, scale = to_grid(x, 20)
    assert torch.equal(ints, ints.round()) and ints.abs().max() <= 2**20
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    assert ((ints * scale - x).abs() <= scale / 2).all()  # the nearest grid point
    assert ints.abs().amax(dim=-1).min() > 2**19  # the grid is the slice's own: its largest value uses the bits
    alone = to_grid(x[3:4], 20)
    assert torch.equal(alone[0], ints[3:4]) and torch.equal(alone[1], scale[3:4])
    zeros, _ = to_grid(torch.zeros(2, 5, dtype=F64), 20)
    assert torch.equal(zeros, torch.zeros(2, 5, dtype=F64))
    bad, _ = to_grid(torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], dtype=F64), 20)
    assert bad[0, 1].isnan() and bad[1, 0].isinf()


@pytest.mark.parametrize("terms", [1, 16, 576, 1536, 14336])
def test_dot_bits_leave_the_exact_sum_within_a_float64(terms):
    a, b = dot_bits(terms)
    assert a + b + math.ceil(math.log2(terms)) == 53 and abs(a - b) <= 1


def test_an_exact_dot_product_does_not_depend_on_the_summation_order():
    gen = torch.Generator().manual_seed(1)
    a_bits, b_bits = dot_bits(4096)
    a, _ = to_grid(torch.randn(4096, generator=gen, dtype=F64), a_bits)
    b, _ = to_grid(torch.randn(4096, generator=gen, dtype=F64), b_bits)
    products = a * b
    orders = [products.sum(), fixed_order_sum(products), products.flip(0).cumsum(0)[-1], a @ b,
              sum(products.tolist()), sum(products[torch.randperm(4096, generator=gen)].tolist())]
    assert len({float(o) for o in orders}) == 1


@pytest.mark.parametrize("rows, inner, cols", [(1, 7, 3), (3, 64, 512), (5, 576, 40), (2, 1536, 8)])
def test_int_matmul_is_the_exact_integer_product(rows, inner, cols):
    """Digits round-trip, and the int8 GEMMs' product is the exact one: for random integers and
    for the extremes (every digit at +-64, the bound that keeps every x86 int8 path exact)."""
    gen = torch.Generator().manual_seed(rows * inner)
    top = 2**INT_GRID_BITS
    cases = [(torch.randint(-top, top + 1, (rows, inner), generator=gen).double(),
              torch.randint(-top, top + 1, (inner, cols), generator=gen).double())]
    extreme = float(sum(64 * 128**i for i in range(3)))  # all three digits 64
    cases.append((torch.full((rows, inner), extreme, dtype=F64), torch.full((inner, cols), -extreme, dtype=F64)))
    for x, w in cases:
        digits = to_digits(x)
        assert digits.dtype == torch.int8 and digits.abs().max() <= 64
        assert torch.equal(sum(digits[i].double() * 128**i for i in range(3)), x)
        got = int_matmul(digits, weight_digits(w))
        assert torch.equal(got, x.long() @ w.long())


def test_fixed_order_sum_is_the_same_inside_any_zero_padding():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 37, generator=gen, dtype=F64)
    alone = fixed_order_sum(x)
    for width in (37, 40, 64, 100, 1000):
        assert torch.equal(fixed_order_sum(F.pad(x, (0, width - 37))), alone)
    assert fixed_order_sum(torch.full((3,), -0.0, dtype=F64)).signbit().item() is False  # +0 whatever the padding
    assert torch.allclose(alone, x.sum(-1), rtol=0, atol=1e-13)


def test_exp_and_silu_do_not_depend_on_where_a_value_sits():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1003, generator=gen, dtype=F64) * 20
    assert torch.equal(_pieces(exp, x, 3), exp(x))
    x32 = x.float()
    assert torch.equal(_pieces(silu, x32, 3), silu(x32))
    assert torch.allclose(exp(x), torch.exp(x), rtol=1e-11, atol=0)
    assert torch.allclose(silu(x32), F.silu(x32), rtol=2e-7, atol=1e-30)
    assert exp(torch.zeros(1, dtype=F64)).item() == 1.0 and exp(torch.tensor([float("nan")], dtype=F64)).isnan().all()


# ---- the attention ----------------------------------------------------------------------------


def _qkv(n: int, q_len: int, k_len: int, heads: int, kv_heads: int, dim: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, q_len, heads, dim, generator=gen).to(dtype)
    k = torch.randn(n, k_len, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(n, k_len, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


def test_attention_is_causal_softmax_attention():
    q, k, v = _qkv(2, 75, 75, 6, 2, 16, seed=4)
    pos = torch.arange(75).repeat(2, 1)
    got = invariant_attention(q, k, v, pos, 0.25)
    want = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                          v.transpose(1, 2).double(), is_causal=True, scale=0.25,
                                          enable_gqa=True).transpose(1, 2)
    assert (got.double() - want).abs().max() < 1e-6  # float32's rounding, not the default kernels' bits


@settings(max_examples=examples(1 / 10, 10), deadline=None)
@given(k_len=st.integers(1, 3 * KEY_BLOCK + 5), data=st.data())
def test_a_query_sees_only_its_own_prefix(k_len, data):
    """A query's output from the whole sequence equals its output with the keys cut after its
    position, padded with other keys (masked), beside another sequence, or as its own slice."""
    q, k, v = _qkv(1, k_len, k_len, 4, 2, 8, seed=k_len)
    pos = torch.arange(k_len)[None]
    whole = invariant_attention(q, k, v, pos, 0.3)
    p = data.draw(st.integers(0, k_len - 1), label="query position")
    extra = data.draw(st.integers(0, 2 * KEY_BLOCK), label="padding keys")
    note(f"k_len={k_len} p={p} extra={extra}")
    cut = invariant_attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos[:, p : p + 1], 0.3)
    assert torch.equal(cut[0, 0], whole[0, p])
    _, other_k, other_v = _qkv(1, 1, extra, 4, 2, 8, seed=k_len + 1000)
    padded = invariant_attention(q[:, p : p + 1], torch.cat([k[:, : p + 1], other_k], 1),
                                 torch.cat([v[:, : p + 1], other_v], 1), pos[:, p : p + 1], 0.3)
    assert torch.equal(padded[0, 0], whole[0, p])
    mate_q, mate_k, mate_v = _qkv(1, k_len, k_len + extra, 4, 2, 8, seed=7)
    pair_k = torch.cat([F.pad(k, (0, 0, 0, 0, 0, extra)), mate_k])
    pair_v = torch.cat([F.pad(v, (0, 0, 0, 0, 0, extra)), mate_v])
    pair = invariant_attention(torch.cat([q, mate_q]), pair_k, pair_v, torch.arange(k_len).repeat(2, 1), 0.3)
    assert torch.equal(pair[0], whole[0])


def test_attention_does_not_depend_on_the_thread_count():
    q, k, v = _qkv(3, 70, 140, 8, 2, 32, seed=5)
    pos = torch.arange(70, 140).repeat(3, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant_attention(q, k, v, pos, 0.2)
        torch.set_num_threads(max(2, before))
        many = invariant_attention(q, k, v, pos, 0.2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def _layer_outputs(builder, pools, requests, q, k, v):
    """Run one attention layer through a plan: requests (cached, new, table) over the given rows."""
    plan = builder.build([n for _, n, _ in requests], [c for c, _, _ in requests], [t for _, _, t in requests])
    return plan.layer(*pools).attend(q, k, v, 0.25)


def test_the_paged_plan_gives_a_chunked_prompt_the_bits_of_one_pass():
    """One 50-token prompt through the pool in one chunk, in chunks of 16, and as decodes, with
    other requests beside it: every position's output is the same bits."""
    tpb, heads, kv_heads, dim = 4, 4, 2, 8
    builder = CpuInvariantPlanBuilder(tokens_per_block=tpb, num_blocks=64)
    q, k, v = _qkv(1, 50, 50, heads, kv_heads, dim, seed=6)
    q, k, v = q[0], k[0], v[0]  # (50, H, D)
    table = list(range(40, 53))

    def pools():
        return (torch.full((64, tpb, kv_heads, dim), float("nan")), torch.full((64, tpb, kv_heads, dim), float("nan")))

    one = _layer_outputs(builder, pools(), [(0, 50, table)], q, k, v)
    chunked_pools = pools()
    pieces = []
    mate_q, mate_k, mate_v = _qkv(1, 7, 7, heads, kv_heads, dim, seed=8)
    for start, stop in [(0, 16), (16, 32), (32, 48), (48, 49), (49, 50)]:
        # a mate of 7 new tokens shares each forward, in its own blocks
        rows = slice(start, stop)
        out = _layer_outputs(builder, chunked_pools, [(0, 7, [0, 1]), (start, stop - start, table)],
                             torch.cat([mate_q[0], q[rows]]), torch.cat([mate_k[0], k[rows]]),
                             torch.cat([mate_v[0], v[rows]]))
        pieces.append(out[7:])
    assert torch.equal(torch.cat(pieces), one)
