"""Single-process pieces of the multi-rank executor: the mapping, weight shards, head shards,
request specs and the decision digest's naming of what differs."""

import pytest
import torch

from tensorrt_llm._torch.distributed.digest import RecordKind, digest, first_difference
from tensorrt_llm._torch.distributed.request_spec import RequestSpec
from tensorrt_llm._torch.models.modeling_llama import HeadShard, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.modules.linear import Linear, TensorParallelMode, split_sizes
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm.mapping import Mapping


def test_mapping_checks_its_layout():
    assert Mapping(4, 3, 4).tp_rank == 3
    adp = Mapping(2, 1, 2, enable_attention_dp=True)
    assert (adp.attn_tp_size, adp.mlp_tp_size, adp.attn_tp_rank) == (1, 1, 0)
    with pytest.raises(ValueError, match="world_size"):
        Mapping(4, 0, 2)
    with pytest.raises(ValueError, match="rank"):
        Mapping(2, 2, 2)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_shards_of_every_rank_rebuild_the_full_weight(tp_size):
    full = torch.randn(10, 6, dtype=torch.float64)
    columns = [Linear(6, 10, dtype=torch.float64, tp_size=tp_size, tp_rank=r,
                      tensor_parallel_mode=TensorParallelMode.COLUMN) for r in range(tp_size)]
    rows = [Linear(10, 6, dtype=torch.float64, tp_size=tp_size, tp_rank=r,
                   tensor_parallel_mode=TensorParallelMode.ROW) for r in range(tp_size)]
    assert torch.equal(torch.cat([c.shard_weight(full) for c in columns]), full)
    assert torch.equal(torch.cat([r.shard_weight(full.T) for r in rows], dim=1), full.T)
    assert [c.weight.shape[0] for c in columns] == split_sizes(10, tp_size)


def test_head_shards_split_query_heads_and_replicate_kv_heads_past_their_count():
    config = LlamaConfig(num_heads=8, num_kv_heads=2)
    assert [HeadShard.of(config, 2, r) for r in range(2)] == [HeadShard((0, 4), (0, 1)), HeadShard((4, 8), (1, 2))]
    four = [HeadShard.of(config, 4, r).kv_heads for r in range(4)]
    assert four == [(0, 1), (0, 1), (1, 2), (1, 2)]  # query heads 0-3 share KV head 0
    with pytest.raises(ValueError, match="multiple of the tensor-parallel size"):
        HeadShard.of(config, 3, 0)


def test_a_sharded_model_holds_slices_of_the_single_rank_weights():
    config = LlamaConfig(dtype="float64")
    single = LlamaForCausalLM(config)
    shard = LlamaForCausalLM(config, Mapping(4, 3, 4))  # built without a process group: weights only
    assert torch.equal(shard.model.layers[0].self_attn.q_proj.weight, single.model.layers[0].self_attn.q_proj.weight[48:64])
    assert torch.equal(shard.model.layers[1].mlp.down_proj.weight, single.model.layers[1].mlp.down_proj.weight[:, 96:128])
    assert torch.equal(shard.model.embed_tokens.weight, single.model.embed_tokens.weight)
    assert shard.kv_cache_shape(5, 4) == (5, 4, 1, config.head_dim)


def test_a_request_spec_builds_the_same_request_on_every_rank():
    request = LlmRequest(input_token_ids=[3, 4, 5], max_new_tokens=7, request_id=41, end_id=2, stop_token_ids=(9,),
                         sampling_config=SamplingConfig(temperature=0.5, seed=3))
    spec = RequestSpec.of(request, arrival_time=12.5)
    built = spec.build()
    assert (built.request_id, built.tokens.tolist(), built.max_new_tokens, built.arrival_time) == (41, [3, 4, 5], 7, 12.5)
    assert built.sampling_config == request.sampling_config and built.stop_token_ids == (9,)


def _context(rid, position, chunk, table):
    return (RecordKind.CONTEXT, rid, 40, position, chunk, 0, tuple(table))


def test_first_difference_names_the_first_request_that_differs():
    pool = (RecordKind.POOL, -1, 10, 2, 0, 0)
    rank0 = [_context(7, 0, 16, [1, 2, 3, 4]), _context(8, 0, 8, [5, 6]), pool]
    rank1 = [_context(7, 0, 16, [1, 2, 3, 4]), (RecordKind.DEFERRED, 8, 1), pool]
    assert digest(rank0) != digest(rank1) and digest(rank0) == digest(list(rank0))
    request_id, detail = first_difference([rank0, rank1])
    assert request_id == 8
    assert "rank 0: context chunk [0, 8)" in detail and "rank 1: deferred (budget)" in detail
    # one more request on rank 1 where rank 0 has its pool record: still named by request
    request_id, _ = first_difference([rank0[:1] + [pool], rank0[:1] + [_context(9, 0, 4, [7]), pool]])
    assert request_id == 9
    assert first_difference([[pool], [(RecordKind.POOL, -1, 9, 3, 0, 0)]])[0] is None
