"""The piecewise runner's pieces, on the CPU (eagerly, no graphs): cut around every layer's
attention and padded to the next size, they give the model's own forward over the same plan.
The CUDA graphs themselves are checked by ``tests/unittest/_torch/attention/test_cuda.py``."""

import random

import pytest
import torch

from tensorrt_llm._torch.attention_backend import plan_builder
from tensorrt_llm._torch.models import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.engine.piecewise_cuda_graph import PiecewiseGraphRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = LlamaConfig(dtype="float64", seed=3)
TPB = 4


def _batch(rng: random.Random, num_blocks: int):
    """Mixed requests (chunks over prefixes, fresh chunks, decodes) with their tables, and ids."""
    requests = [(rng.randrange(0, 40), rng.choice([1, 1, rng.randrange(2, 20)])) for _ in range(rng.randrange(1, 6))]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // TPB))] for c, n in requests]
    cached, new = [c for c, _ in requests], [n for _, n in requests]
    ids = torch.tensor([rng.randrange(CONFIG.vocab_size) for _ in range(sum(new))])
    positions = torch.tensor([c + j for c, n in requests for j in range(n)])
    return new, cached, tables, ids, positions


@pytest.mark.parametrize("seed", range(6))
def test_pieces_with_padding_give_the_model_forward(seed):
    model = LlamaForCausalLM(CONFIG)
    num_blocks = 80
    k_cache = [torch.randn(num_blocks, TPB, *model.kv_cache_shape(1, TPB)[2:], dtype=torch.float64) for _ in range(CONFIG.num_layers)]
    v_cache = [torch.randn_like(k) for k in k_cache]
    new, cached, tables, ids, positions = _batch(random.Random(seed), num_blocks)
    builder = plan_builder("cpu", tokens_per_block=TPB, num_blocks=num_blocks, num_kv_heads=model.num_local_kv_heads,
                           dtype=CONFIG.torch_dtype)
    runner = PiecewiseGraphRunner(model, num_tokens=[128])  # one size: both forwards share its buffers
    assert not runner.use_graphs
    assert runner.size_for(len(ids)) is not None

    # Another forward first, into the same static buffers: its rows must not leak into this one.
    other = _batch(random.Random(seed + 100), num_blocks)
    runner.forward(other[3], other[4], builder.build(*other[:3]), [k.clone() for k in k_cache],
                   [v.clone() for v in v_cache])
    expected_k = [k.clone() for k in k_cache]
    expected_v = [v.clone() for v in v_cache]
    expected = model.forward_with_plan(ids, positions, builder.build(new, cached, tables), expected_k, expected_v)
    for _ in range(2):
        got = runner.forward(ids, positions, builder.build(new, cached, tables), k_cache, v_cache)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        for mine, theirs in zip(k_cache + v_cache, expected_k + expected_v):
            # the same K/V (to rounding: the padded GEMMs may block differently), and nothing
            # written for the padding rows (random pool values there would differ by ~1)
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_sizes_serve_what_they_cover_and_refuse_the_rest():
    runner = PiecewiseGraphRunner(LlamaForCausalLM(CONFIG), num_tokens=[64, 16, 16])
    assert runner.num_tokens == [16, 64]
    assert [runner.size_for(t) for t in (1, 16, 17, 64, 65, 0)] == [16, 16, 64, 64, None, None]
    with pytest.raises(ValueError, match="no piecewise size serves a forward of 65 tokens"):
        runner.forward(torch.zeros(65, dtype=torch.int64), torch.zeros(65, dtype=torch.int64), None, [], [])


def test_capture_num_tokens_default_and_validation():
    assert CudaGraphConfig().resolve_capture_num_tokens(8192) == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    assert CudaGraphConfig().resolve_capture_num_tokens(300) == [16, 32, 64, 128, 256, 300]
    assert CudaGraphConfig(capture_num_tokens=[]).resolve_capture_num_tokens(8192) == []
    assert CudaGraphConfig(capture_num_tokens=[64, 8, 64]).capture_num_tokens == [8, 64]
    assert CudaGraphConfig(capture_num_tokens=[64, 8, 512]).resolve_capture_num_tokens(100) == [8, 64]
    for bad in ([0], 5):
        with pytest.raises(ValueError, match="capture_num_tokens"):
            CudaGraphConfig(capture_num_tokens=bad)
