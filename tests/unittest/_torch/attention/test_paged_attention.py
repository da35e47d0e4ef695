"""The accelerator attention path (``attention_backend``) must compute what the CPU path computes.

Everything here runs on the CPU. The plan, the per-layer KV writes, the packing of context
chunks and the routing of one-token requests to the decode kernel run exactly as on a GPU; only
the kernels are the torch references (``kernels.reference_*``), which the GPU tests in
``test_cuda.py`` hold the fast kernels to. The Triton decode kernel itself runs here under
Triton's interpreter when Triton is installed.

The reference for the whole forward is the model's CPU paged path (``LlamaForCausalLM.forward``
on CPU pools), itself held to ``forward_full`` by ``test_modeling_llama``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tests.helpers.triton_interpreter import run_interpreted
from tensorrt_llm._torch.attention_backend import build_plan
from tensorrt_llm._torch.models import AttentionMetadata, LlamaConfig, LlamaForCausalLM

TOL = 1e-9  # float64: the two paths differ only by summation order


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(dtype="float64", seed=4))


def _batch(requests: list[tuple[int, int]], tokens_per_block: int, num_blocks: int, seed: int):
    """Block tables (shuffled, with spare blocks) and inputs for requests of (cached, new)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, ids, positions = [], [], []
    for cached, new in requests:
        blocks = -(-(cached + new) // tokens_per_block) + rng.randrange(2)
        tables.append([free.pop() for _ in range(blocks)])
        ids += [rng.randrange(512) for _ in range(new)]
        positions += range(cached, cached + new)
    meta = AttentionMetadata(
        num_new_tokens=[n for _, n in requests],
        num_cached_tokens=[c for c, _ in requests],
        block_tables=tables,
        tokens_per_block=tokens_per_block,
    )
    return meta, torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)


def _pools(model: LlamaForCausalLM, num_blocks: int, tokens_per_block: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = model.kv_cache_shape(num_blocks, tokens_per_block)
    layers = model.config.num_layers
    k = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(layers)]
    v = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(layers)]
    return k, v


def _run_both(model, requests, tokens_per_block, seed):
    num_blocks = sum(-(-(c + n) // tokens_per_block) + 1 for c, n in requests) + 2
    meta, ids, positions = _batch(requests, tokens_per_block, num_blocks, seed)
    k_cpu, v_cpu = _pools(model, num_blocks, tokens_per_block, seed)  # cached positions hold "earlier" KV
    k_acc, v_acc = [k.clone() for k in k_cpu], [v.clone() for v in v_cpu]
    expected = model(ids, positions, meta, k_cpu, v_cpu)
    plan = build_plan(
        meta.num_new_tokens, meta.num_cached_tokens, meta.block_tables,
        tokens_per_block=tokens_per_block, num_blocks=num_blocks, num_kv_heads=model.config.num_kv_heads,
        device="cpu",
    )
    got = model.forward_with_plan(ids, positions, plan, k_acc, v_acc)
    return plan, expected, got, (k_cpu, v_cpu), (k_acc, v_acc)


def test_mixed_batch_in_any_order_matches_cpu_path(model: LlamaForCausalLM) -> None:
    # A decode first, then a fresh chunk, a chunk over a cached prefix, a fresh one-token prompt,
    # a request with nothing this step, and a short chunk mid-block.
    requests = [(6, 1), (0, 5), (8, 3), (0, 1), (5, 0), (3, 2)]
    plan, expected, got, cpu_pools, acc_pools = _run_both(model, requests, tokens_per_block=4, seed=1)
    assert plan.decode is not None and plan.decode.rows.tolist() == [0, 9]
    assert plan.context is not None and plan.context.rows is not None  # chunks are not rows [0, Tc)
    assert plan.context.kv_slots is not None  # one chunk has a cached prefix
    assert (got - expected).abs().max().item() < TOL
    for a, b in zip(cpu_pools[0] + cpu_pools[1], acc_pools[0] + acc_pools[1]):
        assert (a - b).abs().max().item() < TOL  # the same slots written with the same K/V


def test_prefill_only_batch_uses_its_own_keys(model: LlamaForCausalLM) -> None:
    plan, expected, got, _, _ = _run_both(model, [(0, 7), (0, 3)], tokens_per_block=4, seed=2)
    assert plan.decode is None and plan.context.rows is None and plan.context.kv_slots is None
    assert (got - expected).abs().max().item() < TOL


def test_decode_only_batch(model: LlamaForCausalLM) -> None:
    plan, expected, got, _, _ = _run_both(model, [(9, 1), (1, 1), (30, 1)], tokens_per_block=4, seed=3)
    assert plan.context is None and plan.decode.seq_lens.tolist() == [10, 2, 31]
    assert (got - expected).abs().max().item() < TOL


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=6),
    tokens_per_block=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_property_any_batch_matches_cpu_path(model: LlamaForCausalLM, requests, tokens_per_block, seed) -> None:
    note(f"requests (cached, new): {requests}, {tokens_per_block} tokens/block")
    _, expected, got, _, _ = _run_both(model, requests, tokens_per_block, seed)
    assert got.shape == expected.shape
    if got.numel():
        assert (got - expected).abs().max().item() < TOL


@pytest.mark.parametrize(
    "new, cached, tables, match",
    [
        ([5], [0], [[0]], "block_tables\\[0\\] has 1 blocks"),
        ([1], [0], [[9]], "outside"),
        ([2, 2], [0, 0], [[3], [3]], "same KV slot"),
        ([1], [0, 0], [[0]], "one entry per request"),
    ],
)
def test_plan_refuses_tables_that_would_corrupt_the_pool(new, cached, tables, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_plan(new, cached, tables, tokens_per_block=4, num_blocks=8, num_kv_heads=2, device="cpu")


# --------------------------------------------------------------------------- Triton, interpreted


def test_triton_kernels_match_references_interpreted() -> None:
    """The Triton kernels (paged decode, context, RoPE; decode and context over FP8 K/V too, the
    FP8 scores kernel over query groups of 1, 2, 3 and 16 and with its block table read a tile
    ahead) under Triton's CPU interpreter, in a fresh process: TRITON_INTERPRET must be set before
    Triton is first imported (torch may import it early)."""
    results = run_interpreted(Path(__file__).parents[3] / "helpers" / "interpreted_kernels.py")
    assert len(results) == 38
    for case in results:
        assert case["untouched_rows_nan"], case
        assert case["max_abs_err"] < case.get("tolerance", 1e-5), case
