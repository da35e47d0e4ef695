"""The GGUF loader: exact on files we write ourselves, and measured on the real SmolLM2 file.

Small files are written with ``gguf.GGUFWriter`` from a random-weight model, the way llama.cpp's
converter writes a Hugging Face Llama (q/k rows permuted for interleaved RoPE, norms in F32,
matrices in the quantisation under test), so loading them must give back that model exactly
(F32) or exactly its dequantised weights. The real file is judged by perplexity: with the q/k
permutation undone it lands where a 135M model should; left as stored it is several-fold worse.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from benchmarks.model.perplexity import paragraph_ids, perplexity
from tensorrt_llm._torch.models.checkpoints import (
    CheckpointError,
    llama_config_from_gguf,
    load_llama_from_gguf,
    open_gguf,
)
from tensorrt_llm._torch.models.checkpoints.gguf_loader import unpermute_qk
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM

Q = gguf.GGMLQuantizationType
CONFIG = LlamaConfig(max_position_embeddings=256, rope_theta=500.0, rms_norm_eps=1e-5, seed=5)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to q/k rows (its published formula)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path,
    model: LlamaForCausalLM,
    *,
    qtype: Q = Q.F32,
    arch: str = "llama",
    metadata_overrides: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """``model`` as llama.cpp would store it; ``metadata_overrides`` maps a key suffix (after
    ``llama.``) to a value, or to None to leave the key out."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    metadata = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_heads,
        "attention.head_count_kv": c.num_kv_heads,
        "rope.dimension_count": c.head_dim,
        "rope.freq_base": float(c.rope_theta),
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        **(metadata_overrides or {}),
    }
    for key, value in metadata.items():
        if value is None:
            continue
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add(f"{arch}.{key}", value)

    def add_tensor(name: str, tensor: torch.Tensor, heads: int | None = None) -> None:
        array = tensor.detach().numpy().astype(np.float32)
        if heads is not None:
            array = llama_cpp_permute(array, heads)
        if array.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms in F32
            writer.add_tensor(name, array)
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)

    state = dict(model.named_parameters())
    add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    add_tensor("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        add_tensor("output.weight", state["lm_head.weight"])
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        add_tensor(f"blk.{i}.attn_q.weight", state[p + "self_attn.q_proj.weight"], heads=c.num_heads)
        add_tensor(f"blk.{i}.attn_k.weight", state[p + "self_attn.k_proj.weight"], heads=c.num_kv_heads)
        add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        add_tensor(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        add_tensor(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
        add_tensor(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def random_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG)


# --------------------------------------------------------------------------- files we write


@pytest.mark.parametrize("tied", [True, False], ids=["tied head", "own head"])
def test_f32_file_loads_back_the_exact_model(tmp_path, tied):
    original = LlamaForCausalLM(dataclasses.replace(CONFIG, tie_word_embeddings=tied))
    write_gguf(tmp_path / "m.gguf", original)

    loaded = load_llama_from_gguf(tmp_path / "m.gguf")

    assert loaded.config == dataclasses.replace(original.config, seed=0)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    want, got = original.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.tensor([3, 141, 59, 26, 5, 35, 89, 7, 93, 2], dtype=torch.long)
    assert torch.equal(loaded.forward_full(ids), original.forward_full(ids))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_matrices_load_as_their_dequantised_values(tmp_path, random_model, qtype):
    write_gguf(tmp_path / "m.gguf", random_model, qtype=qtype)

    loaded = load_llama_from_gguf(tmp_path / "m.gguf").state_dict()

    for name, param in random_model.state_dict().items():
        array = param.numpy()
        if array.ndim == 1:
            expected = array
        elif qtype == Q.F16:
            expected = array.astype(np.float16).astype(np.float32)
        else:  # quantisation blocks lie within rows, so permuting rows commutes with it
            expected = dequantize(quantize(array, qtype), qtype)
        assert torch.equal(loaded[name], torch.from_numpy(np.asarray(expected, dtype=np.float32))), name


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.randn(6 * 8, 5, generator=torch.Generator().manual_seed(0))  # 6 heads of width 8
    stored = torch.from_numpy(llama_cpp_permute(weight.numpy(), 6))
    assert not torch.equal(stored, weight)
    assert torch.equal(unpermute_qk(stored, 6), weight)


def test_keeping_the_stored_qk_order_changes_only_q_and_k(tmp_path, random_model):
    write_gguf(tmp_path / "m.gguf", random_model)
    right = load_llama_from_gguf(tmp_path / "m.gguf").state_dict()
    wrong = load_llama_from_gguf(tmp_path / "m.gguf", undo_qk_permutation=False).state_dict()
    changed = {name for name in right if not torch.equal(right[name], wrong[name])}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(CONFIG.num_layers) for p in "qk"}


@pytest.mark.parametrize(
    "arch, overrides, extra, problem",
    [
        ("qwen2", {}, {}, "architecture 'qwen2' is not supported"),
        ("llama", {"rope.dimension_count": 8}, {}, "partial rotary embeddings"),
        ("llama", {"rope.scaling.type": "yarn"}, {}, "RoPE scaling 'yarn'"),
        ("llama", {"expert_count": 8}, {}, "mixture-of-experts"),
        ("llama", {"block_count": None}, {}, "llama.block_count is missing"),
        ("llama", {"embedding_length": 32, "attention.key_length": 16}, {}, r"token_embd.weight has shape \(512, 64\)"),
        ("llama", {}, {"blk.0.attn_q.bias": np.zeros(64, np.float32)}, "no place for: blk.0.attn_q.bias"),
    ],
)
def test_models_we_cannot_run_are_refused_by_name(tmp_path, random_model, arch, overrides, extra, problem):
    write_gguf(tmp_path / "m.gguf", random_model, arch=arch, metadata_overrides=overrides, extra_tensors=extra)
    with pytest.raises(CheckpointError, match=problem):
        load_llama_from_gguf(tmp_path / "m.gguf")


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        load_llama_from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_llama_from_gguf(tmp_path / "junk.gguf")


def test_a_rewritten_file_is_read_again(tmp_path, random_model):
    path = tmp_path / "m.gguf"
    write_gguf(path, random_model)
    first = open_gguf(path)
    assert open_gguf(path) is first
    path.unlink()
    write_gguf(path, random_model, metadata_overrides={"context_length": 128})
    assert llama_config_from_gguf(open_gguf(path)).max_position_embeddings == 128


# --------------------------------------------------------------------------- the real file


def test_smollm2_config_from_metadata(smollm2_path):
    config = llama_config_from_gguf(open_gguf(smollm2_path))
    assert config == LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.usefixtures("one_torch_thread")
def test_smollm2_perplexity_is_a_small_models_and_wrong_qk_is_several_fold_worse(smollm2_path, smollm2_tokenizer):
    texts = paragraph_ids(smollm2_tokenizer)[:2]  # ~150 tokens: enough to separate the two by far
    right = perplexity(load_llama_from_gguf(smollm2_path), texts)
    wrong = perplexity(load_llama_from_gguf(smollm2_path, undo_qk_permutation=False), texts)
    assert 7 < right < 30, right
    assert wrong > 3 * right, (right, wrong)
