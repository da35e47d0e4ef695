"""An FP8 KV cache's per-layer K and V scales, read from a Hugging Face checkpoint that has them.

A tiny Llama checkpoint is written by transformers (``save_pretrained``); the tests add scalar
``k_scale`` / ``v_scale`` tensors to its safetensors, in the names llm-compressor and ModelOpt
write, and a ``quantization_config`` (or ModelOpt's ``hf_quant_config.json``) that quantizes only
the KV cache. Then, through ``LLM(directory)``:

* under ``kv_cache_config.dtype: fp8`` the executor's KV storage holds exactly the checkpoint's
  scales, with or without a quantization config announcing them, and the start-up line says so;
* the scales reach the stored bytes: power-of-two scales shift layer 0's FP8 values by exactly
  that power (what a silently dropped scale could not do);
* calibrated scales keep the prompt's log-probabilities within FP8's error of the unquantized
  cache's, where absurd ones do not;
* under ``auto`` they are unused (an info line says so) and the dtype is not switched;
* a bad scale (0, negative, NaN, infinite, a vector, a layer too many, a second one for the same
  layer) fails at load naming the tensor; a quantization config that quantizes weights or
  activations, or a KV scheme the engine does not store, is refused naming the key.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.hf_reference import randomize_

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.kv_quant import FP8, KvScales
from tensorrt_llm._torch.models.checkpoints import (
    CheckpointError,
    KvCacheQuantization,
    load_hf_checkpoint,
    read_hf_config,
    read_kv_scales,
)
from tensorrt_llm._torch.models.checkpoints.hf_config import llama_config_from_hf
from tensorrt_llm.llmapi import KvCacheConfig

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

LAYERS, VOCAB, TPB = 2, 128, 4
PROMPT = [(13 * i + 5) % VOCAB for i in range(14)]
LLM_UTILS_LOG = "tensorrt_llm.llmapi.llm_utils"

#: llm-compressor's config.json for a recipe that quantizes only the KV cache (QuantizationModifier
#: with a kv_cache_scheme and no config_groups), as compressed-tensors writes it
COMPRESSED_TENSORS = {
    "config_groups": {}, "format": "dense", "global_compression_ratio": None, "ignore": [],
    "kv_cache_scheme": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                        "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "tensor",
                        "symmetric": True, "type": "float"},
    "quant_method": "compressed-tensors", "quantization_status": "frozen", "version": "0.9.4",
}
#: ModelOpt's hf_quant_config.json for an FP8 KV cache beside unquantized weights
MODELOPT_FILE = {"producer": {"name": "modelopt", "version": "0.29.0"},
                 "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
#: the flat shape ModelOpt writes into config.json's quantization_config
MODELOPT_FLAT = {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8",
                 "producer": {"name": "modelopt", "version": "0.29.0"}, "ignore": ["lm_head"]}


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama (GQA: 4 query heads, 2 KV heads) with random weights, saved by transformers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed=3)
    directory = tmp_path_factory.mktemp("kv-scales") / "tiny-llama"
    model.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return directory


def llm_compressor_names(scales: KvScales) -> dict[str, torch.Tensor]:
    """llm-compressor / vLLM: ``self_attn.{k,v}_scale``, shape (1,), in the weights' dtype."""
    return {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([s], dtype=torch.float32)
            for kv, values in (("k", scales.k), ("v", scales.v)) for i, s in enumerate(values)}


def modelopt_names(scales: KvScales) -> dict[str, torch.Tensor]:
    """ModelOpt: ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, 0-d float32."""
    return {f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale": torch.tensor(s, dtype=torch.float32)
            for kv, values in (("k", scales.k), ("v", scales.v)) for i, s in enumerate(values)}


def with_scales(base: Path, directory: Path, tensors: dict[str, torch.Tensor], *, quantization_config=None,
                hf_quant_config=None) -> Path:
    """A copy of ``base`` with ``tensors`` added to its safetensors and the configs given."""
    shutil.copytree(base, directory)
    weights = load_file(directory / "model.safetensors")
    save_file({**weights, **tensors}, directory / "model.safetensors", metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (directory / "config.json").write_text(json.dumps(config))
    if hf_quant_config is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    return directory


def serve(directory: Path, kv_dtype: str = "fp8", **options) -> LLM:
    options.setdefault("kv_cache_config", KvCacheConfig(dtype=kv_dtype, tokens_per_block=TPB, num_blocks=32))
    return LLM(str(directory), dtype="float32", device="cpu", max_num_tokens=32, **options)


def prompt_logprobs(llm: LLM) -> list[float]:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [entry.logprob for entry in out.prompt_logprobs[1:]]


SCALES = KvScales((0.0625, 0.125), (0.25, 0.03125))

LAYOUTS = {
    # name: (tensors, config.json quantization_config, hf_quant_config.json)
    "compressed-tensors": (llm_compressor_names, COMPRESSED_TENSORS, None),
    "modelopt-config": (modelopt_names, MODELOPT_FLAT, None),
    "modelopt-hf-quant-config": (modelopt_names, None, MODELOPT_FILE),
    "no-quantization-config": (llm_compressor_names, None, None),  # vLLM accepts bare scales too
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fp8_pool_holds_the_checkpoint_scales(base, tmp_path, layout, caplog):
    names, quantization_config, hf_quant_config = LAYOUTS[layout]
    directory = with_scales(base, tmp_path / layout, names(SCALES), quantization_config=quantization_config,
                            hf_quant_config=hf_quant_config)
    announced = quantization_config is not None or hf_quant_config is not None
    quantization = read_hf_config(directory, dtype="float32").kv_cache_quantization
    assert (quantization is not None) == announced
    if announced:
        assert quantization.kv_cache_quant_algo == "FP8" and quantization.kv_cache_dtype == "fp8"
        assert quantization.quant_method == ("compressed-tensors" if layout == "compressed-tensors" else "modelopt")
    assert read_kv_scales(directory, LAYERS) == SCALES
    caplog.set_level(logging.INFO, logger="tensorrt_llm.llmapi.llm")
    with serve(directory) as llm:
        storage = llm.executor.kv_cache_manager.storage
        assert storage.pools.dtype == FP8
        assert storage.kv_scales == SCALES  # exactly the checkpoint's, per layer
        assert llm.kv_scales == SCALES
        assert "KV scales from the checkpoint (k 0.0625..0.125, v 0.0312..0.25)" in llm.describe()
        assert len(llm.generate(PROMPT, SamplingParams(max_tokens=4)).outputs[0].token_ids) == 4
    assert any("KV scales from the checkpoint" in r.getMessage() for r in caplog.records)  # the start-up line


def test_the_loader_returns_the_scales_beside_the_model(base, tmp_path):
    directory = with_scales(base, tmp_path / "ckpt", modelopt_names(SCALES), hf_quant_config=MODELOPT_FILE)
    hf = read_hf_config(directory, dtype="float32")
    loaded = load_hf_checkpoint(directory, hf.config)
    assert loaded.kv_scales == SCALES
    assert not any("scale" in name for name, _ in loaded.model.named_parameters())
    plain = load_hf_checkpoint(base, read_hf_config(base, dtype="float32").config)
    assert plain.kv_scales is None
    for (name, ours), (_, theirs) in zip(loaded.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(ours, theirs), name


def test_scales_reach_the_stored_bytes(base, tmp_path):
    """Power-of-two scales divide layer 0's K and V exactly (FP8 keeps the mantissa): its stored
    values times the scale equal a 1.0-scale load's wherever both are normal FP8 numbers. A scale
    dropped anywhere between the file and the pool would leave the bytes equal instead."""
    scaled = KvScales((4.0, 2.0), (0.5, 8.0))
    unit = with_scales(base, tmp_path / "unit", llm_compressor_names(KvScales.unit(LAYERS)),
                       quantization_config=COMPRESSED_TENSORS)
    four = with_scales(base, tmp_path / "four", llm_compressor_names(scaled), quantization_config=COMPRESSED_TENSORS)
    pools = {}
    for name, directory in (("unit", unit), ("scaled", four)):
        with serve(directory) as llm:
            llm.generate(PROMPT, SamplingParams(max_tokens=3))
            pools[name] = llm.executor.kv_cache_manager.storage.pools.clone()
    assert pools["unit"].dtype == pools["scaled"].dtype == FP8
    assert not torch.equal(pools["unit"].view(torch.uint8), pools["scaled"].view(torch.uint8))
    for kv, scale in ((0, scaled.k[0]), (1, scaled.v[0])):  # layer 0: its input does not depend on the cache
        one, other = pools["unit"][kv, 0].float(), pools["scaled"][kv, 0].float() * scale
        written = one != 0
        assert written.sum() >= len(PROMPT) * 2 * 16 // 2  # most of the prompt's K (V) elements
        normal = one.abs() >= 2.0**-6 * max(scale, 1.0)  # normal FP8 numbers in both pools
        assert torch.equal(one[normal], other[normal])
        assert normal[written].float().mean() > 0.8  # most written values are compared


def test_calibrated_scales_keep_the_unquantized_cache_s_logprobs(base, tmp_path):
    """Scales calibrated as exporters do (amax / 448, per layer, from the unquantized cache) keep
    the prompt's log-probabilities within FP8's error of the unquantized cache's; scales far too
    small (everything saturates) do not, so the comparison can fail."""
    with serve(base, "auto") as llm:
        reference = prompt_logprobs(llm)
        pools = llm.executor.kv_cache_manager.storage.pools  # (K/V, layer, block, token, head, dim)
        amax = pools.abs().flatten(2).amax(dim=2)  # (K/V, layer)
    calibrated = KvScales(tuple((amax[0] / 448).tolist()), tuple((amax[1] / 448).tolist()))
    tiny = KvScales((1e-4,) * LAYERS, (1e-4,) * LAYERS)
    results = {}
    for name, scales in (("calibrated", calibrated), ("tiny", tiny)):
        directory = with_scales(base, tmp_path / name, llm_compressor_names(scales), quantization_config=COMPRESSED_TENSORS)
        with serve(directory) as llm:
            assert llm.executor.kv_cache_manager.storage.kv_scales == KvScales(
                *(tuple(torch.tensor(s, dtype=torch.float32).tolist()) for s in (scales.k, scales.v)))
            results[name] = max(abs(a - b) for a, b in zip(prompt_logprobs(llm), reference))
    print(f"max |logprob - unquantized|: calibrated {results['calibrated']:.4f}, saturating {results['tiny']:.4f}")
    assert results["calibrated"] < 0.1
    assert results["tiny"] > 10 * results["calibrated"]


def test_auto_leaves_the_scales_unused_and_says_so(base, tmp_path, caplog):
    directory = with_scales(base, tmp_path / "ckpt", llm_compressor_names(SCALES), quantization_config=COMPRESSED_TENSORS)
    caplog.set_level(logging.INFO, logger=LLM_UTILS_LOG)
    with serve(directory, "auto") as llm:
        storage = llm.executor.kv_cache_manager.storage
        assert storage.pools.dtype == torch.float32 and storage.kv_scales is None  # not switched to FP8
        assert llm.kv_scales is None and "KV scales" not in llm.describe()
        tokens = llm.generate(PROMPT, SamplingParams(max_tokens=6)).outputs[0].token_ids
    unused = [r for r in caplog.records if r.name == LLM_UTILS_LOG and "unused" in r.getMessage()]
    assert len(unused) == 1 and unused[0].levelno == logging.INFO
    message = unused[0].getMessage()
    assert "kv_cache_config.dtype is auto" in message and "kv_cache_config.dtype: fp8" in message
    assert "per-layer FP8 KV scales" in message and "compressed-tensors" in message and "float32" in message
    with serve(base, "auto") as llm:  # the same model without scales: the same tokens
        assert llm.generate(PROMPT, SamplingParams(max_tokens=6)).outputs[0].token_ids == tokens


def test_fp8_without_scale_tensors_derives_them_and_warns_where_the_config_promised_them(base, tmp_path, caplog):
    """No scale tensors: the scales are derived at start-up (``calculate_kv_scales``, the
    default; the start-up line says from what), or 1.0 when that is off."""
    directory = with_scales(base, tmp_path / "ckpt", {}, quantization_config=COMPRESSED_TENSORS)
    caplog.set_level(logging.INFO, logger=LLM_UTILS_LOG)
    with serve(directory) as llm:
        scales = llm.executor.kv_cache_manager.storage.kv_scales
        assert scales is not None and scales == llm.kv_scales and scales.num_layers == LAYERS
        assert "KV scales derived at start-up, per layer" in llm.describe()
    assert any(r.levelno == logging.WARNING and "no K/V scale tensors" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with serve(base, kv_cache_config=KvCacheConfig(dtype="fp8", tokens_per_block=TPB, num_blocks=32,
                                                   calculate_kv_scales=False)) as llm:
        assert llm.executor.kv_cache_manager.storage.kv_scales is None
        assert "KV scales 1.0" in llm.describe()  # a plain checkpoint, nothing derived: 1.0, nothing to warn about
    assert not any(r.levelno >= logging.WARNING and "K/V scale" in r.getMessage() for r in caplog.records)


def test_a_layer_without_its_scales_gets_one_and_is_named(base, tmp_path, caplog):
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25])}
    directory = with_scales(base, tmp_path / "ckpt", tensors)
    caplog.set_level(logging.WARNING)
    assert read_kv_scales(directory, LAYERS) == KvScales((0.5, 1.0), (0.25, 1.0))
    assert any("K of layer 1, V of layer 1" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize("name, value, match", [
    ("model.layers.1.self_attn.k_scale", torch.tensor([0.0]), "finite number > 0, got 0.0"),
    ("model.layers.0.self_attn.v_scale", torch.tensor([-0.5]), "finite number > 0, got -0.5"),
    ("model.layers.0.self_attn.k_scale", torch.tensor([math.nan]), "finite number > 0, got nan"),
    ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor(math.inf), "finite number > 0, got inf"),
    ("model.layers.0.self_attn.k_scale", torch.tensor([0.5, 0.25]), r"one number, got shape \(2,\)"),
    ("model.layers.2.self_attn.k_scale", torch.tensor([0.5]), "names layer 2, the model has 2"),
    ("model.layers.0.self_attn.k_proj.k_scale", torch.tensor(0.5), "both give layer 0's K scale"),
], ids=["zero", "negative", "nan", "inf", "vector", "layer-too-many", "twice"])
def test_a_bad_scale_fails_at_load_naming_the_tensor(base, tmp_path, name, value, match):
    tensors = {**llm_compressor_names(SCALES), name: value}
    directory = with_scales(base, tmp_path / "ckpt", tensors, quantization_config=COMPRESSED_TENSORS)
    with pytest.raises(CheckpointError, match=match) as error:
        serve(directory)
    assert name in str(error.value)
    with pytest.raises(CheckpointError, match=match):  # the loader itself, as every rank calls it
        load_hf_checkpoint(directory, read_hf_config(directory, dtype="float32").config)


def test_other_scales_stay_unexpected_tensors(base, tmp_path):
    """A weight's or an activation's scale means quantized weights: still an unexpected tensor."""
    directory = with_scales(base, tmp_path / "ckpt", {"model.layers.0.self_attn.k_proj.weight_scale": torch.tensor(0.5)})
    with pytest.raises(CheckpointError, match="unexpected.*k_proj.weight_scale"):
        serve(directory)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6}
FP8_W8A8 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}
KV_SCHEME = COMPRESSED_TENSORS["kv_cache_scheme"]


@pytest.mark.parametrize("quantization_config, match", [
    ({**COMPRESSED_TENSORS, "config_groups": FP8_W8A8},
     r"quantization_config.config_groups.group_0 quantizes weights \(8-bit float channel\) and input_activations"),
    ({**COMPRESSED_TENSORS, "sparsity_config": {"format": "sparse-24-bitmask"}},
     "quantization_config.sparsity_config describes sparse"),
    ({**COMPRESSED_TENSORS, "kv_cache_scheme": {**KV_SCHEME, "type": "int"}},
     "quantization_config.kv_cache_scheme: type='int', num_bits=8 is not supported"),
    ({**COMPRESSED_TENSORS, "kv_cache_scheme": {**KV_SCHEME, "strategy": "attn_head"}},
     "quantization_config.kv_cache_scheme.strategy='attn_head' is not supported"),
    ({**COMPRESSED_TENSORS, "kv_cache_scheme": {**KV_SCHEME, "dynamic": True}},
     "quantization_config.kv_cache_scheme.dynamic=True is not supported"),
    ({**MODELOPT_FLAT, "quant_algo": "FP8"}, r"quantization_config.quant_algo='FP8' is not supported \(it quantizes the weights"),
    ({**MODELOPT_FLAT, "kv_cache_quant_algo": "NVFP4"}, "quantization_config.kv_cache_quant_algo='NVFP4' is not supported"),
    ({"quant_method": "modelopt", **MODELOPT_FILE, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}},
     "quantization_config.quantization.quant_algo='NVFP4' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128},
     r"quantization_config=.* is not supported \(quant_method 'gptq' quantizes the weights\)"),
    ({"bits": 4}, r"quantization_config=.* is not supported \(it names no quant_method"),
], ids=["config-groups", "sparsity", "int8-kv", "per-head", "dynamic", "modelopt-fp8", "nvfp4-kv", "modelopt-nested",
        "gptq", "no-method"])
def test_quantization_beyond_the_kv_cache_is_refused_naming_the_key(quantization_config, match):
    with pytest.raises(CheckpointError, match=match) as error:
        llama_config_from_hf({**LLAMA, "quantization_config": quantization_config}, dtype="float32")
    assert str(error.value).startswith("config.json: quantization_config")


def test_kv_only_configs_are_recorded_on_the_config():
    read = lambda **extra: llama_config_from_hf({**LLAMA, **extra}, dtype="float32").kv_cache_quantization  # noqa: E731
    assert read() is None
    assert read(quantization_config=COMPRESSED_TENSORS) == KvCacheQuantization(
        "FP8", "compressed-tensors", "config.json: quantization_config.kv_cache_scheme")
    assert read(quantization_config=MODELOPT_FLAT) == KvCacheQuantization(
        "FP8", "modelopt", "config.json: quantization_config.kv_cache_quant_algo")
    modelopt_1x = {"quant_method": "modelopt", "quant_algo": None, "kv_cache_scheme": KV_SCHEME}
    assert read(quantization_config=modelopt_1x).source == "config.json: quantization_config.kv_cache_scheme"
    nested = {"quant_method": "modelopt", **MODELOPT_FILE}
    assert read(quantization_config=nested).source == "config.json: quantization_config.quantization.kv_cache_quant_algo"
    # a config that quantizes nothing is accepted and records nothing
    assert read(quantization_config={**COMPRESSED_TENSORS, "kv_cache_scheme": None}) is None
    assert read(quantization_config={**MODELOPT_FLAT, "kv_cache_quant_algo": "none"}) is None


def test_a_weight_quantizing_checkpoint_is_refused_through_llm(base, tmp_path):
    directory = with_scales(base, tmp_path / "ckpt", llm_compressor_names(SCALES),
                            quantization_config={**COMPRESSED_TENSORS, "config_groups": FP8_W8A8})
    with pytest.raises(CheckpointError, match="quantization_config.config_groups.group_0 quantizes weights"):
        serve(directory)
    modelopt = with_scales(base, tmp_path / "modelopt", modelopt_names(SCALES),
                           hf_quant_config={**MODELOPT_FILE, "quantization": {"quant_algo": "FP8",
                                                                              "kv_cache_quant_algo": "FP8"}})
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: quantization.quant_algo='FP8' is not supported"):
        serve(modelopt)


def test_describing_a_checkpoint_without_weights_reads_no_scales(base, tmp_path):
    """A directory described for its sizes only (config.json, no safetensors) still describes."""
    from tensorrt_llm.llmapi.llm_utils import describe_checkpoint

    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(base / "config.json", directory / "config.json")
    described = describe_checkpoint(str(directory), dtype="float32")
    assert described.kv_scales is None and described.config.num_layers == LAYERS
