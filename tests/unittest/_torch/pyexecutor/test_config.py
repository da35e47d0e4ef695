"""ExecutorConfig / KvCacheConfig: every validation error is a ValueError naming its field."""

import pytest

from tensorrt_llm._torch.pyexecutor.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    ExecutorConfig,
    KvCacheConfig,
    TokenBudgetPolicyName,
)
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig


@pytest.mark.parametrize("field", ["max_batch_size", "max_num_tokens", "max_seq_len"])
@pytest.mark.parametrize("value", [0, -3, 2.5, "8", True, None])
def test_executor_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=field):
        ExecutorConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("context_chunking_policy", "ROUND_ROBIN"),
        ("capacity_scheduler_policy", "evict_everything"),
        ("token_budget_policy", "clamp"),
        ("token_budget_policy", None),
    ],
)
def test_unknown_policy_names_are_rejected(field, value):
    with pytest.raises(ValueError, match=field) as error:
        ExecutorConfig(**{field: value})
    assert repr(value) in str(error.value)  # the message says what was given


def test_policy_names_are_accepted_as_strings():
    config = ExecutorConfig(
        context_chunking_policy="EQUAL_PROGRESS",
        capacity_scheduler_policy="MAX_UTILIZATION",
        token_budget_policy="fit",
    )
    assert config.context_chunking_policy is ContextChunkingPolicy.EQUAL_PROGRESS
    assert config.capacity_scheduler_policy is CapacitySchedulerPolicy.MAX_UTILIZATION
    assert config.token_budget_policy is TokenBudgetPolicyName.FIT


@pytest.mark.parametrize("name", ["none", "trim", "fit", "recheck"])
def test_every_token_budget_policy_name(name):
    assert ExecutorConfig(token_budget_policy=name).token_budget_policy.value == name


def test_defaults():
    config = ExecutorConfig()
    assert config.token_budget_policy is TokenBudgetPolicyName.RECHECK
    assert config.capacity_scheduler_policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    assert config.context_chunking_policy is ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    assert config.chunk_unit_size == config.kv_cache_config.tokens_per_block


def test_kv_cache_config_must_be_a_kv_cache_config():
    with pytest.raises(ValueError, match="kv_cache_config"):
        ExecutorConfig(kv_cache_config={"tokens_per_block": 4})


@pytest.mark.parametrize("value", [0, -4])
def test_chunk_unit_size_must_be_positive(value):
    with pytest.raises(ValueError, match="chunk_unit_size"):
        ExecutorConfig(chunk_unit_size=value, kv_cache_config=KvCacheConfig(tokens_per_block=4))


def test_chunk_unit_size_must_be_whole_blocks():
    with pytest.raises(ValueError, match=r"chunk_unit_size \(6\).*tokens_per_block \(4\)"):
        ExecutorConfig(chunk_unit_size=6, kv_cache_config=KvCacheConfig(tokens_per_block=4))
    assert ExecutorConfig(chunk_unit_size=8, kv_cache_config=KvCacheConfig(tokens_per_block=4)).chunk_unit_size == 8


def test_chunked_prefill_budget_must_hold_one_chunk():
    kv = KvCacheConfig(tokens_per_block=16)
    with pytest.raises(ValueError, match=r"max_num_tokens \(8\).*chunk_unit_size \(16\)"):
        ExecutorConfig(max_num_tokens=8, enable_chunked_prefill=True, kv_cache_config=kv)
    # Without chunked prefill a small budget is only a limit on prompt length.
    assert ExecutorConfig(max_num_tokens=8, enable_chunked_prefill=False, kv_cache_config=kv).max_num_tokens == 8


@pytest.mark.parametrize("field", ["tokens_per_block", "max_tokens", "num_blocks"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_kv_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"KvCacheConfig.{field}"):
        KvCacheConfig(**{field: value})


def test_kv_pool_size_given_twice_is_rejected():
    with pytest.raises(ValueError, match="max_tokens.*num_blocks"):
        KvCacheConfig(max_tokens=64, num_blocks=4)


@pytest.mark.parametrize("value", [-1, 1.5, None])
def test_host_cache_size_must_be_non_negative_bytes(value):
    with pytest.raises(ValueError, match="host_cache_size"):
        KvCacheConfig(host_cache_size=value)


def test_pool_size_resolution():
    assert KvCacheConfig(tokens_per_block=8, max_tokens=17).resolve_num_blocks(99) == 3  # rounded up
    assert KvCacheConfig(tokens_per_block=8, num_blocks=5).resolve_num_blocks(99) == 5
    assert KvCacheConfig(tokens_per_block=8).resolve_num_blocks(99) == 99


@pytest.mark.parametrize(
    "field, value", [("temperature", -0.5), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5)]
)
def test_sampling_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})
