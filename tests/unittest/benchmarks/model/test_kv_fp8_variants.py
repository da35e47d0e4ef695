"""The FP8 KV variants harness (``benchmarks.model.kv_fp8_variants``) measures what it says: its
transforms are exact without quantization, and its simulated FP8 cache is the real FP8 pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.model.kv_fp8_variants import Variant, calibrate, hadamard, variant_log_probs
from benchmarks.model.perplexity import paged_log_probs
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 31, 77, 120, 2, 9, 18, 200, 45, 6, 13, 88, 4, 150, 33]


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthonormal(n: int):
    h = hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64), rtol=1e-15)


def test_hadamard_refuses_a_size_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


@pytest.mark.parametrize("name", ["rot-k", "rrot-kv", "center-kv+rrot-kv"])
def test_the_transforms_change_nothing_without_quantization(name: str):
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64"))
    variant = Variant(name, model.config.head_dim, torch.float64, seed=1)
    calibrate(model, variant, None, unit=False)
    variant.store = lambda layer, k, v: (k, v)  # the transforms alone
    plain = paged_log_probs(model, IDS, chunk_size=5)
    assert torch.allclose(variant_log_probs(model, variant, IDS, 5), plain, atol=1e-10)


def test_the_simulated_fp8_cache_is_the_real_fp8_pool():
    from benchmarks.model.perplexity import paged_perplexity

    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32"))
    variant = Variant("none", model.config.head_dim, torch.float32)
    calibrate(model, variant, None, unit=False)
    scales = KvScales(tuple(s[0] for s in variant.scales), tuple(s[1] for s in variant.scales))
    assert not scales.is_unit
    log_probs = variant_log_probs(model, variant, IDS, 5)
    simulated = torch.exp(-log_probs.gather(1, torch.tensor(IDS[1:])[:, None]).mean()).item()
    real = paged_perplexity(model, [IDS], kv_cache_dtype_name="fp8", chunk_size=5, kv_scales=scales)
    assert simulated == pytest.approx(real, rel=1e-6)
