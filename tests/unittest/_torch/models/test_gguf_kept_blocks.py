"""GGUF files whose quantized blocks are kept (``quantization="gguf"``): read exactly as stored, run
through torch's int4 kernel, compute what the dequantised model computes (to bfloat16's precision),
and refused by name where they cannot be kept.

Files are written with ``gguf.GGUFWriter`` from a random-weight model (``test_gguf_loader.write_gguf``,
llama.cpp's layout); the tiny model's shapes pack for the int4 kernel (rows by 16, blocks of 32).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from test_gguf_loader import CONFIG, write_gguf

from tensorrt_llm import LLM
from tensorrt_llm._torch.models.checkpoints import (
    CheckpointError,
    blocks_unsupported,
    llama_config_from_gguf,
    load_llama_from_gguf,
    open_gguf,
)
from tensorrt_llm._torch.models.checkpoints.gguf_blocks import read_blocks
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.modules.linear_methods import Int4GroupMethod

Q = gguf.GGMLQuantizationType
KINDS = ("Q8_0", "Q4_0", "Q4_1")


@pytest.fixture(scope="module")
def random_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_read_as_stored_dequantize_as_gguf_does(kind):
    weight = np.random.default_rng(3).standard_normal((48, 96)).astype(np.float32) * 0.2
    weight[5, :32] = 0.0  # an all-zero block (scale 0)
    stored = quantize(weight, Q[kind])

    blocks = read_blocks(kind, stored, 48, 96)

    assert blocks.kind == kind and blocks.shape == (48, 96)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(dequantize(stored, Q[kind]), np.float32)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_int4_kernel_multiplies_by_the_dequantized_weight(kind):
    weight = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32) * 0.1
    blocks = read_blocks(kind, quantize(weight, Q[kind]), 64, 128)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).bfloat16()

    y = Int4GroupMethod([blocks]).apply(x)

    expected = x.float() @ blocks.dequantize().T  # float32 accumulation of the same products
    assert y.dtype == torch.bfloat16
    # bfloat16 output and scales (relative 2**-8 and 2**-9), nothing else
    assert torch.allclose(y.float(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_kept_blocks_compute_what_the_dequantized_model_computes(tmp_path, random_model, qtype):
    write_gguf(tmp_path / "m.gguf", random_model, qtype=qtype)

    kept = load_llama_from_gguf(tmp_path / "m.gguf", dtype="bfloat16", keep_quantized=True)
    dense = load_llama_from_gguf(tmp_path / "m.gguf", dtype="float32")

    attn, mlp = kept.model.layers[0].self_attn, kept.model.layers[0].mlp
    assert attn.q_proj.weight is None and mlp.gate_proj.weight is None and mlp.down_proj.weight is None
    assert attn.qkv_method is not None and mlp.gate_up_method is not None  # q/k/v and gate/up: one call each
    formats = dict((fmt, count) for fmt, count, _ in kept.linear_formats.formats)
    assert formats == {f"int4 groups of 32 (GGUF {qtype.name})": 7 * CONFIG.num_layers, "float16 (fbgemm)": 1}
    tokens = torch.tensor([3, 141, 59, 26, 5, 35, 89, 7, 93, 2])
    with torch.inference_mode():
        got, want = kept.forward_full(tokens), dense.forward_full(tokens)
    assert got.dtype == torch.float32  # the LM head's logits stay float32 (logits_method)
    # bfloat16 activations over two layers: the logits (spread ~1) move by 0.03-0.05 here
    assert float((got - want).abs().max()) < 0.15 * float(want.std())
    assert float(torch.corrcoef(torch.stack((got.flatten(), want.flatten())))[0, 1]) > 0.9995


def test_q_and_k_rows_are_unpermuted_in_blocks_too(tmp_path, random_model):
    write_gguf(tmp_path / "m.gguf", random_model, qtype=Q.Q8_0)
    kept = load_llama_from_gguf(tmp_path / "m.gguf", dtype="bfloat16", keep_quantized=True)
    wrong = load_llama_from_gguf(tmp_path / "m.gguf", dtype="bfloat16", keep_quantized=True, undo_qk_permutation=False)
    dense = load_llama_from_gguf(tmp_path / "m.gguf", dtype="float32")
    tokens = torch.tensor([3, 141, 59, 26, 5, 35, 89, 7])
    with torch.inference_mode():
        want = dense.forward_full(tokens)
        right_error = float((kept.forward_full(tokens) - want).abs().max())
        wrong_error = float((wrong.forward_full(tokens) - want).abs().max())
    assert wrong_error > 5 * right_error


def test_a_block_format_the_kernel_does_not_run_is_refused_by_name(tmp_path, random_model):
    write_gguf(tmp_path / "m.gguf", random_model, qtype=Q.Q5_0)
    checkpoint = open_gguf(tmp_path / "m.gguf")
    why = blocks_unsupported(checkpoint, llama_config_from_gguf(checkpoint))
    assert why is not None and "blk.0.attn_q.weight is Q5_0" in why
    with pytest.raises(CheckpointError, match="attn_q.weight is Q5_0"):
        load_llama_from_gguf(tmp_path / "m.gguf", dtype="bfloat16", keep_quantized=True)
    with pytest.raises(CheckpointError, match="run with bfloat16 activations, not float32"):
        load_llama_from_gguf(tmp_path / "m.gguf", dtype="float32", keep_quantized=True)
    # unset, the file is served dequantized; asked for, it is refused
    with LLM(str(tmp_path / "m.gguf"), max_seq_len=64) as llm:
        assert llm.model_config.dtype == "float16-weights"
    with pytest.raises(CheckpointError, match="quantization='gguf' cannot keep this file's weights: .*Q5_0"):
        LLM(str(tmp_path / "m.gguf"), quantization="gguf")


def test_the_cpu_default_keeps_a_quantized_file_and_a_dtype_dequantizes_it(tmp_path, random_model):
    path = str(tmp_path / "m.gguf")
    write_gguf(tmp_path / "m.gguf", random_model, qtype=Q.Q4_1)
    prompt = [3, 141, 59, 26, 5]
    with LLM(path, max_seq_len=64) as llm:
        assert llm.model_config.dtype == "bfloat16"
        assert "int4 groups of 32 (GGUF Q4_1)" in llm.describe()
        kept = llm.generate(prompt)
    with LLM(path, max_seq_len=64, dtype="float32") as llm:
        assert "float32 (F.linear)" in llm.describe()
    with LLM(path, max_seq_len=64, quantization="none") as llm:
        assert llm.model_config.dtype == "float16-weights"
    with LLM(path, max_seq_len=64, quantization="gguf", dtype="bfloat16") as llm:
        assert llm.generate(prompt).outputs[0].token_ids == kept.outputs[0].token_ids


def test_what_cannot_keep_the_blocks_is_refused_clearly(tmp_path, random_model):
    path = str(tmp_path / "m.gguf")
    write_gguf(tmp_path / "m.gguf", random_model, qtype=Q.Q8_0)
    with pytest.raises(ValueError, match="runs with bfloat16 activations, not dtype='float32'"):
        LLM(path, quantization="gguf", dtype="float32")
    with pytest.raises(ValueError, match="quantization='gguf' is for GGUF files; tiny-random is a random-weight model"):
        LLM("tiny-random", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' runs on one rank"):
        LLM(path, quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of 'gguf', 'none'"):
        from tensorrt_llm.serve.llm_options import llm_options

        llm_options({"quantization": "awq"})


def test_rows_the_int4_kernel_cannot_pack_are_refused(tmp_path):
    odd = LlamaForCausalLM(dataclasses.replace(CONFIG, num_kv_heads=1, num_heads=4, head_dim=8))  # k, v: 8 rows
    write_gguf(tmp_path / "m.gguf", odd, qtype=Q.Q8_0, metadata_overrides={"attention.key_length": 8})
    with pytest.raises(CheckpointError, match="attn_k.weight has 8 rows"):
        load_llama_from_gguf(tmp_path / "m.gguf", dtype="bfloat16", keep_quantized=True)
