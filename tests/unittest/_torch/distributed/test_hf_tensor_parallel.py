"""A Hugging Face checkpoint on two tensor-parallel ranks: each rank streams only its slices.

* ``LLM(directory, tensor_parallel_size=2)`` generates the single rank's greedy tokens (float64);
* each rank's resident weights are its shard: the replicated tensors (embedding, norms) plus
  half of every split one, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.distributed.launcher import RankContext
from tensorrt_llm._torch.models.checkpoints import read_hf_config
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm.llmapi import KvCacheConfig

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

OPTIONS = dict(dtype="float64", max_num_tokens=24, enable_chunked_prefill=True, max_seq_len=96,
               kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=64))
PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(10 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_reference import randomize_fan_in_

    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.architectures = ["Qwen2ForCausalLM"]  # q/k/v biases: sliced with their rows
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    randomize_fan_in_(model, seed=5)
    directory = tmp_path_factory.mktemp("tp") / "tiny-qwen2"
    model.save_pretrained(directory, max_shard_size="50KB")
    return directory


def rank_weight_bytes(ctx: RankContext, path: str, config: LlamaConfig) -> int:
    """Rank job: build this rank's model from the checkpoint as a serving rank does; its weights' bytes."""
    from tensorrt_llm._torch.distributed.worker import build_rank_model, serve_config

    model = build_rank_model(serve_config(config, ExecutorConfig(), checkpoint=path), ctx.mapping())
    storages = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(storages.values())


def test_two_ranks_generate_what_one_rank_does(checkpoint):
    with LLM(str(checkpoint), **OPTIONS) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=12))]
    with LLM(str(checkpoint), tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.model_id == "tiny-qwen2"
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=12))] == expected


def test_each_rank_holds_its_half_of_the_split_weights(rank_group, checkpoint):
    from tensorrt_llm._torch.models.checkpoints import load_llama_from_hf

    config = read_hf_config(checkpoint, dtype="float64").config
    whole = load_llama_from_hf(checkpoint, config)
    replicated = sum(p.numel() * 8 for name, p in whole.named_parameters() if "norm" in name or "embed" in name)
    total = sum(p.numel() * 8 for p in whole.parameters())
    per_rank = rank_group(2).run_ok(rank_weight_bytes, str(checkpoint), config, timeout_s=120)
    print(f"weight bytes: one rank {total}, two ranks {per_rank} (replicated {replicated})")
    assert per_rank == [replicated + (total - replicated) // 2] * 2
    assert all(b / total < 0.6 for b in per_rank)
