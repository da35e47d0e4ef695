"""Reading a Hugging Face checkpoint: config.json's key table, RoPE frequencies, windows, the
safetensors reader's errors, hub ids through huggingface_hub's cache, generation_config.json.

Checked against transformers wherever it has an opinion: its config classes' defaults, its
RoPE frequencies (bit for bit), its forward for a sliding window the engine serves below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil

import huggingface_hub
import pytest
import torch
import transformers
from tests.helpers.hf_reference import CASES, float64_reference, reference_logits, write_checkpoint
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tensorrt_llm import LLM
from tensorrt_llm._torch.models.checkpoints import CheckpointError, load_llama_from_hf, read_hf_config
from tensorrt_llm._torch.models.checkpoints.hf_config import ARCH_DEFAULTS, ARCHITECTURES, llama_config_from_hf
from tensorrt_llm._torch.modules.rotary_embedding import RopeScaling, rope_inv_freq
from tensorrt_llm.llmapi.llm_utils import ModelNotFound, default_checkpoint_dtype, read_generation_config, resolve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Llama-3.1-8B's config.json, as published (4.x spelling)
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def parse(raw, dtype="float32"):
    return llama_config_from_hf(raw, dtype=dtype, source="config.json")


# --------------------------------------------------------------------------- config.json


def test_llama_3_1_reads_as_published():
    hf = parse(LLAMA31)
    config = hf.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 32, 8, 128)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192) and config.rope_theta == 500000.0
    assert config.max_position_embeddings == 131072 and not config.tie_word_embeddings
    assert hf.checkpoint_dtype == "bfloat16" and hf.eos_token_ids == (128001, 128008, 128009) and hf.bos_token_id == 128000
    assert not (config.qkv_bias or config.o_bias or config.qk_norm)


def test_both_spellings_read_alike():
    """transformers 5 writes rope_parameters and dtype; 4.x wrote rope_theta + rope_scaling and torch_dtype."""
    new = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    new["dtype"] = "bfloat16"
    assert parse(new) == parse(LLAMA31)
    old_type = {**LLAMA31, "rope_scaling": {**{k: v for k, v in LLAMA31["rope_scaling"].items() if k != "rope_type"},
                                            "type": "llama3"}}
    assert parse(old_type) == parse(LLAMA31)


@pytest.mark.parametrize("model_type", sorted(ARCH_DEFAULTS))
def test_absent_keys_take_transformers_defaults(model_type):
    """A config.json with the sizes only reads as transformers' config class reads it."""
    architecture = next(a for a, t in ARCHITECTURES.items() if t == model_type)
    sizes = dict(vocab_size=64, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=32)
    ours = parse({"architectures": [architecture], "model_type": model_type, **sizes}).config
    theirs = transformers.AutoConfig.for_model(model_type, **sizes)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    window = getattr(theirs, "sliding_window", None)
    served = min(theirs.max_position_embeddings, window or theirs.max_position_embeddings)
    assert (ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps, ours.tie_word_embeddings) == (
        theirs.num_key_value_heads, head_dim, theirs.rms_norm_eps, theirs.tie_word_embeddings)
    assert ours.max_position_embeddings == served
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["GemmaForCausalLM"]}, "architecture 'GemmaForCausalLM' is not supported"),
    ({"architectures": None}, "architectures must name one architecture"),
    ({"model_type": "mistral"}, "model_type 'mistral' does not match architecture LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported \(the MLP's activation"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config=.* is not supported"),
    ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto_map=.* is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
     "rope_scaling.rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling of type 'linear' needs factor"),
    ({"rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters per layer type"),
    ({"torch_dtype": "int8"}, "torch_dtype='int8' is not supported"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"num_key_value_heads": 7}, "must be a multiple of num_kv_heads"),
])
def test_what_the_engine_does_not_run_is_refused_by_key(change, match):
    with pytest.raises(CheckpointError, match=match):
        parse({**LLAMA31, **change})


def test_unknown_keys_are_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        parse({**LLAMA31, "fancy_new_switch": 3, "sliding_window": 128})  # Llama has no window key either
    assert "fancy_new_switch, sliding_window" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse(LLAMA31)
    assert caplog.text == ""


def test_a_window_some_layer_uses_caps_the_positions_served(caplog):
    mistral = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "vocab_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
               "max_position_embeddings": 32768}
    with caplog.at_level(logging.WARNING):
        assert parse({**mistral, "sliding_window": 4096}).config.max_position_embeddings == 4096
    assert "sliding_window=4096 is used by some layers: positions served capped at 4096" in caplog.text
    assert parse({**mistral, "sliding_window": None}).config.max_position_embeddings == 32768
    assert parse(mistral).config.max_position_embeddings == 4096  # transformers' default window
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 1024}
    assert parse(qwen).config.max_position_embeddings == 32768  # use_sliding_window is off by default
    on = {**qwen, "use_sliding_window": True}
    assert parse({**on, "max_window_layers": 2}).config.max_position_embeddings == 32768  # no layer slides
    assert parse({**on, "max_window_layers": 1}).config.max_position_embeddings == 1024
    layers = {**on, "layer_types": ["full_attention", "sliding_attention"]}
    assert parse(layers).config.max_position_embeddings == 1024
    with pytest.raises(CheckpointError, match="layer_types must list one type per layer"):
        parse({**on, "layer_types": ["full_attention"]})


def test_the_window_cap_serves_what_transformers_computes(tmp_path):
    """Below the window, a windowed model is the full-attention one: same logits as transformers'
    (which applies its window) for a sequence of exactly ``sliding_window`` tokens."""
    case = next(c for c in CASES if c.name == "mistral")
    windowed = dataclasses.replace(case, name="mistral-window", kwargs={**case.kwargs, "sliding_window": 8})
    directory = write_checkpoint(windowed, tmp_path / "mistral-window")
    hf = read_hf_config(directory, dtype="float64")
    assert hf.config.max_position_embeddings == 8
    model = load_llama_from_hf(directory, hf.config)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    expected = reference_logits(float64_reference(directory), tokens)
    assert (model.forward_full(torch.tensor(tokens)) - expected).abs().max().item() <= 1e-9
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 8\)"):
        model.forward_full(torch.tensor(tokens + [1]))


# --------------------------------------------------------------------------- RoPE


def _their_inv_freq(config) -> torch.Tensor:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rope_type](config)[0]


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
], ids=["default", "linear", "dynamic", "llama3.1", "llama3.2"])
def test_rope_frequencies_are_transformers_bit_for_bit(rope):
    raw = {**LLAMA31, "rope_scaling": rope}
    ours = parse(raw).config
    theirs = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    expected = _their_inv_freq(theirs)
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected)


def test_dynamic_rope_serves_only_where_its_frequencies_are_fixed():
    scaling = RopeScaling("dynamic", 2.0, original_max_position_embeddings=4096)
    with pytest.raises(ValueError, match="exceeds the dynamic RoPE's original_max_position_embeddings"):
        type(parse(LLAMA31).config)(max_position_embeddings=8192, rope_scaling=scaling)
    config = parse({**LLAMA31, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert config.config.max_position_embeddings == 4096 and config.config.rope_scaling == scaling
    assert "rope_scaling dynamic" in config.notes[0]


# --------------------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_checkpoint(CASES[0], tmp_path_factory.mktemp("sharded") / "llama3")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_checkpoint(next(c for c in CASES if c.name == "mistral"), tmp_path_factory.mktemp("single") / "mistral")


def _copy(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / directory.name)


def _load(directory):
    return load_llama_from_hf(directory, read_hf_config(directory, dtype="float64").config)


def test_sharded_and_single_files_load_without_unpickling(sharded, single, monkeypatch):
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    assert (single / "model.safetensors").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load must never be called on a checkpoint")

    monkeypatch.setattr(torch, "load", refuse)
    for directory in (sharded, single):
        model = _load(directory)
        assert model.config.dtype == "float64"


def test_a_missing_tensor_is_named(single, sharded, tmp_path):
    directory = _copy(single, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \[model.layers.1.mlp.up_proj.weight \(48, 32\)\]"):
        _load(directory)
    directory = _copy(sharded, tmp_path / "s")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name, file = next(iter(index["weight_map"].items()))
    tensors = load_file(directory / file)
    del tensors[name]
    save_file(tensors, directory / file)
    with pytest.raises(CheckpointError, match=f"tensor {name} is in no shard"):
        _load(directory)


def test_a_misshapen_or_unexpected_tensor_is_named_with_both_shapes(single, tmp_path):
    directory = _copy(single, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:, :31].clone()
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight has shape \(32, 31\), "
                                              r"the model needs \(32, 32\)"):
        _load(directory)
    tensors = load_file(single / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32, dtype=torch.float64)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected \['model.layers.0.self_attn.q_proj.bias'\]"):
        _load(directory)


def test_pickles_and_broken_files_are_refused(single, tmp_path):
    directory = _copy(single, tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"PyTorch pickles \(pytorch_model.bin\), which this engine refuses"):
        _load(directory)
    (directory / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        _load(directory)
    data = (single / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="ends past the end of the file"):
        _load(directory)
    (directory / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        _load(directory)


def test_a_tied_checkpoint_that_also_saved_its_lm_head_loads(tmp_path):
    case = next(c for c in CASES if c.name == "qwen2")  # tied
    directory = write_checkpoint(dataclasses.replace(case, shard_size="10MB"), tmp_path / "tied")
    tensors = load_file(directory / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4, dtype=torch.float64)  # old checkpoints' buffer
    save_file(tensors, directory / "model.safetensors")
    model = _load(directory)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_bfloat16_checkpoint_streams_into_the_engines_dtype(tmp_path):
    directory = write_checkpoint(CASES[0], tmp_path / "bf16", dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model = load_llama_from_hf(directory, read_hf_config(directory, dtype="float32").config)
    ours = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(ours[name], param.float()), name


# --------------------------------------------------------------------------- hub ids


def _cache_repo(cache, repo_id, source, commit="0123456789abcdef0123456789abcdef01234567"):
    """``source``'s files in huggingface_hub's cache layout: blobs named by content hash, a
    snapshot of symlinks to them, and refs/main naming the commit."""
    repo = cache / huggingface_hub.file_download.repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return snapshot


def test_a_hub_id_resolves_through_the_hugging_face_cache(sharded, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = _cache_repo(cache, "tiny-org/tiny-llama", sharded)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    # huggingface_hub itself finds the layout
    assert huggingface_hub.snapshot_download("tiny-org/tiny-llama", local_files_only=True) == str(snapshot.resolve())
    assert huggingface_hub.try_to_load_from_cache("tiny-org/tiny-llama", "config.json", cache_dir=cache) == str(
        snapshot / "config.json")
    assert [r.repo_id for r in huggingface_hub.scan_cache_dir(cache).repos] == ["tiny-org/tiny-llama"]
    assert resolve_model("tiny-org/tiny-llama").path == snapshot.resolve()
    with LLM("tiny-org/tiny-llama", dtype="float64", max_num_tokens=32) as llm:
        assert llm.model_id == "tiny-org/tiny-llama"
        assert len(llm.generate([1, 2, 3], None).outputs[0].token_ids) > 0
    with pytest.raises(ModelNotFound, match=rf"unknown model 'tiny-org/absent'; .*a Hugging Face hub id: not in the "
                                            rf"Hugging Face cache {cache} \(HF_HUB_OFFLINE is set"):
        LLM("tiny-org/absent")


def test_a_directory_serves_under_its_name_and_a_bare_directory_is_refused(sharded, tmp_path):
    assert resolve_model(sharded).model_id == "llama3" and resolve_model(str(sharded)).kind == "hf"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"without a config.json, so not a Hugging Face checkpoint \(it holds: notes.txt\)"):
        resolve_model(tmp_path / "empty")


# --------------------------------------------------------------------------- generation_config.json


def test_generation_config_supplies_eos_ids_and_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
        "max_new_tokens": 64, "eos_token_id": [128001, 128009], "bos_token_id": 128000, "transformers_version": "4.45"}))
    defaults, eos = read_generation_config(tmp_path)
    assert eos == (128001, 128009)
    assert defaults.sampling_kwargs() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                          "repetition_penalty": 1.05, "max_tokens": 64}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot", "eos_token_id": 2}))
    defaults, eos = read_generation_config(tmp_path)  # refuses nothing: the bad value is logged and left out
    assert defaults.sampling_kwargs() == {} and eos == (2,)


def test_loading_holds_about_one_tensor_beside_the_model(tmp_path):
    """Peak RSS of a load (a fresh process, benchmarks.model.hf_load_memory's measurement) stays within
    1.3x the bytes on disk: the mapped pages of each tensor are released once it is copied."""
    import subprocess
    import sys

    from benchmarks.model.hf_load_memory import LLAMA_3_2_1B, write_checkpoint as write_streamed

    shape = {**LLAMA_3_2_1B, "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False}
    disk = write_streamed(tmp_path / "ckpt", shape)
    out = subprocess.run([sys.executable, "-m", "benchmarks.model.hf_load_memory", "--measure", str(tmp_path / "ckpt"),
                          "bfloat16"], capture_output=True, text=True, check=True, timeout=240)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["disk_bytes"] == disk > 50e6 and result["model_bytes"] == disk
    assert result["peak_over_disk"] <= 1.3, result


def test_the_replays_torch_engine_runs_a_checkpoint_directory(sharded):
    """``python -m benchmarks.replay --engine torch --model DIR``: the flag takes the directory and
    every policy replays a small trace on it."""
    from benchmarks.replay import build_parser, replay_trace, settings_from_args
    from benchmarks.replay.traces import SyntheticRequest, Trace, segment_key

    args = build_parser().parse_args(["--engine", "torch", "--device", "cpu", "--model", str(sharded), "--max-num-tokens",
                                      "32", "--kv-blocks", "64", "--tokens-per-block", "4", "--host-cache-blocks", "8",
                                      "--max-batch-size", "4"])
    _, settings, _ = settings_from_args(args)
    assert settings.model == str(sharded) and settings.vocab_size == 160
    trace = Trace("tiny", "scenario", tuple(
        SyntheticRequest(i, 0.05 * i, 24 + 8 * (i % 3), 4,
                         ((segment_key(0xB0, i % 2), 16), (segment_key(0xB1, i), 8 + 8 * (i % 3))), 160)
        for i in range(6)))
    document = replay_trace(trace, settings, ("none", "recheck"), progress=False).to_json()
    assert document["config"]["engine"]["model"] == str(sharded)
    assert document["config"]["engine"]["model_config"]["dtype"] == default_checkpoint_dtype()  # as LLM on the CPU
    for result in document["results"].values():
        assert result["completed"] == 6 and result["overshoots"] == 0
