"""The replay's settings: every executor and KV setting one replay uses, and the engines built from them.

Its own module so that the CLI (``replay``), one policy's loop (``replay_loop``) and the
report (``replay_report``) all depend on it and none of them on another's caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.cost_model import ModelShape, default_cost_model
from benchmarks.sim_engine import ENGINES, Engine, build_sim_engine, build_torch_engine, torch_kv_bytes_per_token, torch_vocab_size
from benchmarks.traces import DEFAULT_VOCAB_SIZE, Trace
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    ExecutorConfig,
    KvCacheConfig,
)


def max_seq_len_for(trace: Trace) -> int:
    """Room for the longest prompt plus its whole output."""
    return max((r.input_len + r.output_len for r in trace.requests), default=1)


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """Every executor and KV setting a replay uses; one executor per policy is built from it.

    The defaults are the default scenario's: upstream's reproduction setting
    (``max_num_tokens=4096``, chunked prefill, block reuse, partial reuse, a host tier) with
    a device pool of 1,280 blocks of 32 tokens (40,960 tokens, 6.25 GiB of KV at 160 KiB a
    token: about nine of the scenario's ~4.4k-token prompts) and a host tier of 512 blocks
    (2.5 GiB), small enough that the prefix counted at admission is regularly evicted (or
    dropped from the host) before it is claimed. See README.md, "Replay".
    """

    engine: str = "sim"
    model: str = "tiny-random"  # torch engine only
    max_num_tokens: int = 4096
    max_batch_size: int = 64
    tokens_per_block: int = 32
    kv_blocks: int = 1280
    host_cache_blocks: int = 512
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    enable_chunked_prefill: bool = True
    capacity_scheduler_policy: str = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT.value
    context_chunking_policy: str = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED.value
    device: str = "cpu"  # torch engine: where the model and the KV pool live ("cuda": the GPU engine)
    disable_overlap_scheduler: bool | None = None  # None: upstream's default (overlap on CUDA)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and self.engine != "torch":
            raise ValueError("device='cuda' runs the torch engine (--engine torch); the sim engine has no device")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}")
        for name in ("max_num_tokens", "max_batch_size", "tokens_per_block", "kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.host_cache_blocks, bool) or not isinstance(self.host_cache_blocks, int) or self.host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be an int >= 0, got {self.host_cache_blocks!r}")

    def executor_config(self, policy: str, *, max_seq_len: int, kv_bytes_per_token: int) -> ExecutorConfig:
        host_bytes = self.host_cache_blocks * self.tokens_per_block * kv_bytes_per_token
        kv = KvCacheConfig(
            tokens_per_block=self.tokens_per_block,
            num_blocks=self.kv_blocks,
            enable_block_reuse=self.enable_block_reuse,
            enable_partial_reuse=self.enable_partial_reuse,
            host_cache_size=host_bytes,
        )
        return ExecutorConfig(
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            max_seq_len=max_seq_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            context_chunking_policy=self.context_chunking_policy,
            capacity_scheduler_policy=self.capacity_scheduler_policy,
            token_budget_policy=policy,
            kv_cache_config=kv,
            disable_overlap_scheduler=self.disable_overlap_scheduler,
        )

    @property
    def vocab_size(self) -> int:
        """Token ids the engine accepts: the torch model's vocabulary, or the trace default."""
        return torch_vocab_size(self.model) if self.engine == "torch" else DEFAULT_VOCAB_SIZE

    def max_seq_len(self, trace: Trace) -> int:
        """Room for the trace's longest prompt plus its output, but never more positions than
        the torch model has: a longer request is then refused alone at submission, with the
        reason, instead of failing its whole batch inside the model."""
        longest = max_seq_len_for(trace)
        if self.engine == "torch":
            return min(longest, MODEL_PRESETS[self.model].max_position_embeddings)
        return longest

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        if self.engine == "torch":
            config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=torch_kv_bytes_per_token(self.model))
            return build_torch_engine(config, model_name=self.model, device=self.device)
        shape = ModelShape()
        config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=shape.kv_bytes_per_token())
        return build_sim_engine(config, cost_model=_cost_model(), model_shape=shape, vocab_size=self.vocab_size)


_COST_MODEL = None


def _cost_model():
    """The default cost model, built once per process (a fit to a table is not free)."""
    global _COST_MODEL
    if _COST_MODEL is None:
        _COST_MODEL = default_cost_model()
    return _COST_MODEL
