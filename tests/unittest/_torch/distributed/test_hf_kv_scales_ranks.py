"""A checkpoint's FP8 KV scales on two tensor-parallel ranks: every rank reads every layer's scalars.

* each rank's executor (built as a serving rank builds it) holds the checkpoint's per-layer scales
  in its FP8 pool, and none under ``auto``;
* ``LLM(directory, tensor_parallel_size=2)`` with an FP8 cache generates the single rank's greedy
  tokens (float64), with scales that change them (they saturate): a rank that dropped its scales
  would generate the unscaled tokens instead.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.kv_quant import KvScales
from tensorrt_llm._torch.distributed.launcher import RankContext
from tensorrt_llm._torch.models.checkpoints import read_hf_config
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm.llmapi import KvCacheConfig

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

# small enough that a random layer's K and V values saturate FP8 (+-448 x scale): they change the tokens
SCALES = KvScales((0.002, 0.004), (0.003, 0.001))
PROMPTS = [[(11 * i + 5 * j) % 128 for j in range(9 + 7 * i)] for i in range(3)]


def kv_config(dtype: str) -> KvCacheConfig:
    return KvCacheConfig(dtype=dtype, tokens_per_block=4, num_blocks=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny Llama twice: plain, and with llm-compressor's KV scales and quantization_config."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_reference import randomize_fan_in_

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    randomize_fan_in_(model, seed=7)
    root = tmp_path_factory.mktemp("tp-kv-scales")
    plain, scaled = root / "plain", root / "scaled"
    model.save_pretrained(plain)
    model.save_pretrained(scaled)
    weights = load_file(scaled / "model.safetensors")
    for kv, values in (("k", SCALES.k), ("v", SCALES.v)):
        for layer, value in enumerate(values):
            weights[f"model.layers.{layer}.self_attn.{kv}_scale"] = torch.tensor([value], dtype=torch.float64)
    save_file(weights, scaled / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((scaled / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                  "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                      "dynamic": False, "symmetric": True}}
    (scaled / "config.json").write_text(json.dumps(raw))
    return plain, scaled


def rank_pool(ctx: RankContext, path: str, config: LlamaConfig, dtype: str) -> tuple[str, KvScales | None]:
    """Rank job: this rank's executor, built as a serving rank builds it; its pool's dtype and scales."""
    from tensorrt_llm._torch.distributed.worker import build_rank_executor, serve_config

    executor = build_rank_executor(serve_config(config, ExecutorConfig(kv_cache_config=kv_config(dtype)),
                                                checkpoint=path), ctx.mapping())
    storage = executor.kv_cache_manager.storage
    return str(storage.pools.dtype), storage.kv_scales


def test_every_rank_s_pool_holds_every_layer_s_scales(rank_group, checkpoints):
    _, scaled = checkpoints
    config = read_hf_config(scaled, dtype="float64").config
    group = rank_group(2)
    assert group.run_ok(rank_pool, str(scaled), config, "fp8", timeout_s=120) == [("torch.float8_e4m3fn", SCALES)] * 2
    assert group.run_ok(rank_pool, str(scaled), config, "auto", timeout_s=120) == [("torch.float64", None)] * 2


def test_two_fp8_ranks_generate_what_one_does_with_the_scales(checkpoints):
    plain, scaled = checkpoints
    options = dict(dtype="float64", device="cpu", max_num_tokens=24, enable_chunked_prefill=True, max_seq_len=96,
                   kv_cache_config=kv_config("fp8"))
    params = SamplingParams(max_tokens=10)
    with LLM(str(plain), **options) as llm:
        unscaled = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    with LLM(str(scaled), **options) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert expected != unscaled  # the scales matter here, so the comparison below can fail
    with LLM(str(scaled), tensor_parallel_size=2, **options) as llm:
        assert "KV scales from the checkpoint (k 0.002..0.004, v 0.001..0.003)" in llm.describe()
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)] == expected
