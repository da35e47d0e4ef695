"""The FP8 KV variants harness (``benchmarks.model.kv_fp8_variants``) measures what it says: its
transforms are exact without quantization, and its simulated FP8 cache is the real FP8 pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.model import kv_fp8_variants
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


def test_the_layer_and_part_selection_does_what_it_says():
    """Every layer exact is the unquantized cache bit for bit (exact layers bypass the variant); only
    K quantized leaves V as computed, only V leaves K; quantizing only some layers stores the others
    exact; each restriction shares the calibration and changes the result."""
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32"))
    num_layers = len(model.model.layers)
    assert num_layers >= 2
    variant = Variant("rrot-kv", model.config.head_dim, torch.float32, seed=1)
    calibrate(model, variant, None, unit=False)
    plain = paged_log_probs(model, IDS, chunk_size=5)

    every_layer = variant.restricted(frozenset(range(num_layers)))
    assert torch.equal(variant_log_probs(model, every_layer, IDS, 5), plain)

    stored: dict[str, list] = {}
    original_quantize = kv_fp8_variants.quantize

    def record(name: str, restricted: Variant) -> torch.Tensor:
        """Log-probs, recording which layers stored which of K/V rounded (values off the FP8 grid
        of their scale would mean exact)."""
        seen = stored.setdefault(name, [])
        original_store = restricted.store

        def store(layer, k, v):
            kq, vq = original_store(layer, k, v)
            ks, vs = restricted.scales[layer]
            on_grid = [bool(torch.equal(x, kv_fp8_variants.dequantize(original_quantize(x, s), s, x.dtype)))
                       for x, s in ((kq, ks), (vq, vs))]
            changed = [not torch.equal(kq, k), not torch.equal(vq, v)]
            seen.append((layer, on_grid, changed))
            return kq, vq

        restricted.store = store
        return variant_log_probs(model, restricted, IDS, 5)

    full = record("kv", variant.restricted())
    k_only = record("k", variant.restricted(part="k"))
    v_only = record("v", variant.restricted(part="v"))
    last_only = record("last", variant.restricted(frozenset(range(num_layers - 1))))
    assert {layer for layer, _, _ in stored["last"]} == {num_layers - 1}  # the exact layers bypass store
    assert all(changed == [True, True] for _, _, changed in stored["kv"])
    assert all(changed == [True, False] and grid[0] for _, grid, changed in stored["k"])
    assert all(changed == [False, True] and grid[1] for _, grid, changed in stored["v"])
    assert variant.restricted(part="k").name == "rrot-kv+k-only"
    for one in (k_only, v_only, last_only):
        assert not torch.equal(one, full) and not torch.equal(one, plain)


def test_a_variant_refuses_a_selection_that_quantizes_nothing_or_a_negative_layer():
    with pytest.raises(ValueError, match="k-only and v-only"):
        Variant("none+k-only+v-only", 8, torch.float32)
    with pytest.raises(ValueError, match="layer indices"):
        Variant("none", 8, torch.float32, exact_layers=frozenset({-1}))
    with pytest.raises(ValueError, match="part"):
        Variant("none", 8, torch.float32).restricted(part="q")


def test_the_sink_is_each_quantized_layers_first_call_when_some_layers_are_exact():
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32"))
    variant = Variant("sink", model.config.head_dim, torch.float32)
    calibrate(model, variant, None, unit=False)
    last = len(model.model.layers) - 1
    restricted = variant.restricted(frozenset(range(last)))
    calls = []
    original_store = restricted.store

    def store(layer, k, v):
        calls.append((layer, restricted.first_position))
        return original_store(layer, k, v)

    restricted.store = store
    variant_log_probs(model, restricted, IDS, 5)
    assert calls == [(last, True)] + [(last, False)] * (-(-len(IDS) // 5) - 1)  # one call a chunk
