"""The replay's settings: the executor every policy runs plus the replay's own, and the engines built from them.

Its own module so that the CLI (``replay``), one policy's loop (``replay_loop``) and the
report (``replay_report``) all depend on it and none of them on another's caller.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.replay.cost_model import CostModel, FittedCostModel, ModelShape, default_cost_model
from benchmarks.replay.sim_engine import (
    ENGINES,
    Engine,
    build_sim_engine,
    build_torch_engine,
    torch_kv_bytes_per_token,
    torch_model_config,
    torch_vocab_size,
)
from benchmarks.replay.traces import DEFAULT_VOCAB_SIZE, Trace
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm.llmapi.config_fields import from_mapping, nested, to_mapping

# ExecutorConfig keys the replay sets itself: neither flags nor options of a replay.
SET_BY_THE_REPLAY = frozenset({
    "max_seq_len",  # the trace's longest request (ReplaySettings.max_seq_len)
    "token_budget_policy",  # one executor per policy replayed (--policies)
    "kv_cache_config.host_cache_size",  # host_cache_blocks, in bytes of the engine's KV
    "kv_cache_config.max_tokens",  # the pool is sized in blocks (kv_cache_config.num_blocks)
    "kv_cache_config.free_gpu_memory_fraction",  # likewise, on a GPU too
    "iter_stats_max_iterations",  # the replay reads every iteration's statistics
    "health_check_timeout_s",  # serving: nothing asks the replay's executor for its health
    "fault_injection",  # the replay measures the budget policies, not failure handling
})


def max_seq_len_for(trace: Trace) -> int:
    """Room for the longest prompt plus its whole output."""
    return max((r.input_len + r.output_len for r in trace.requests), default=1)


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """The executor every policy of a replay runs, and the replay's own settings; one executor
    per policy is built from it.

    The defaults are the default scenario's: upstream's reproduction setting
    (``max_num_tokens=4096``, chunked prefill, block reuse, partial reuse, a host tier) with
    a device pool of 1,280 blocks of 32 tokens (40,960 tokens, 6.25 GiB of KV at 160 KiB a
    token: about nine of the scenario's ~4.4k-token prompts) and a host tier of 512 blocks
    (2.5 GiB), small enough that the prefix counted at admission is regularly evicted (or
    dropped from the host) before it is claimed. See README.md, "Replay".

    The keys (``from_options``, the replay's flags, ``options()``) are generated from the
    fields: ``ExecutorConfig``'s at the top level (but ``SET_BY_THE_REPLAY``), then the
    replay's own.
    """

    # The executor's settings; max_seq_len, token_budget_policy and the host tier's bytes are set per replay.
    executor: ExecutorConfig = nested(ExecutorConfig, inline=True, max_num_tokens=4096, enable_chunked_prefill=True,
                                      kv_cache_config={"num_blocks": 1280})
    engine: str = field(default="sim", metadata={"choices": ENGINES})  # sim: the cost model's clock; torch: a real model
    # The torch engine's model: a preset, or any checkpoint LLM(model=...) takes (HF directory or hub id, GGUF file).
    model: str = field(default="tiny-random", metadata={"metavar": "|".join(sorted(MODEL_PRESETS)) + "|DIR|HUB_ID|FILE.gguf"})
    host_cache_blocks: int = 512  # the host (offload) tier, in blocks; 0 disables it
    # The torch engine's device, as LLM(device=...): auto is the GPU when torch sees one, else the CPU.
    device: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda")})
    # Sim engine: a cost model saved by `python -m benchmarks.replay.cost_model refit` (default: the fit to benchmarks/calibration/).
    cost_model: str | None = field(default=None, metadata={"metavar": "MODEL.json"})
    # Beam search in the trace: every beam_every-th request (by trace position, the first included;
    # 0: none) searches with beam_width beams. The sim engine charges and allocates them as beams.
    beam_every: int = 0
    beam_width: int = 4  # the beams of the requests beam_every picks

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and self.engine != "torch":
            raise ValueError("device='cuda' runs the torch engine (--engine torch); the sim engine has no device")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.cost_model is not None and self.engine != "sim":
            raise ValueError("cost_model prices the sim engine's forwards; the torch engine runs them")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset ({', '.join(sorted(MODEL_PRESETS))}) or a checkpoint, got {self.model!r}")
        if self.engine == "torch":
            torch_model_config(self.model, self.torch_device)  # resolves it now: ValueError naming what was looked for
        if not isinstance(self.executor, ExecutorConfig):
            raise ValueError(f"executor must be an ExecutorConfig, got {type(self.executor).__name__}")
        if self.executor.kv_cache_config.num_blocks is None:
            raise ValueError("the replay sizes the KV pool in blocks: kv_cache_config.num_blocks is required")
        if isinstance(self.host_cache_blocks, bool) or not isinstance(self.host_cache_blocks, int) or self.host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be an int >= 0, got {self.host_cache_blocks!r}")
        for name, minimum in (("beam_every", 0), ("beam_width", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    def beam_width_of(self, slot: int) -> int:
        """The beam width of the trace's request at position ``slot`` (``beam_every``)."""
        return self.beam_width if self.beam_every and slot % self.beam_every == 0 else 1

    @classmethod
    def from_options(cls, **options: Any) -> ReplaySettings:
        """Settings from the replay's option names over the defaults: ``ExecutorConfig``'s keys
        (``max_num_tokens=2048``, ``kv_cache_config={"num_blocks": 640}``) and the replay's own
        (``host_cache_blocks=0``, ``engine="torch"``), checked as the flags are. A subclass's own
        fields pass through as they are."""
        extra_fields = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(ReplaySettings)}
        extra = {name: options.pop(name) for name in extra_fields if name in options}
        base = from_mapping(ReplaySettings, options, exclude=SET_BY_THE_REPLAY)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ReplaySettings)}, **extra)

    def options(self) -> dict[str, Any]:
        """The settings as option names and plain values: what ``from_options`` takes back."""
        return to_mapping(self, exclude=SET_BY_THE_REPLAY)

    def executor_config(self, policy: str, *, max_seq_len: int, kv_bytes_per_token: int) -> ExecutorConfig:
        """The executor of one policy's replay: a fresh copy of ``executor`` with the values the
        replay sets (``SET_BY_THE_REPLAY``)."""
        kv = self.executor.kv_cache_config
        host_bytes = self.host_cache_blocks * kv.tokens_per_block * kv_bytes_per_token
        return dataclasses.replace(
            copy.deepcopy(self.executor),
            max_seq_len=max_seq_len,
            token_budget_policy=policy,
            kv_cache_config=dataclasses.replace(kv, host_cache_size=host_bytes),
        )

    @property
    def torch_device(self) -> str:
        """The device the torch engine runs on: ``device`` with ``auto`` resolved."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def vocab_size(self) -> int:
        """Token ids the engine accepts: the torch model's vocabulary, or the trace default."""
        return torch_vocab_size(self.model, self.torch_device) if self.engine == "torch" else DEFAULT_VOCAB_SIZE

    def max_seq_len(self, trace: Trace) -> int:
        """Room for the trace's longest prompt plus its output, but never more positions than
        the torch model has: a longer request is then refused alone at submission, with the
        reason, instead of failing its whole batch inside the model."""
        longest = max_seq_len_for(trace)
        if self.engine == "torch":
            return min(longest, torch_model_config(self.model, self.torch_device).max_position_embeddings)
        return longest

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        if self.engine == "torch":
            kv_bytes = torch_kv_bytes_per_token(self.model, self.torch_device)
            config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=kv_bytes)
            return build_torch_engine(config, model_name=self.model, device=self.torch_device)
        shape = ModelShape()
        config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=shape.kv_bytes_per_token())
        return build_sim_engine(config, cost_model=_cost_model(self.cost_model), model_shape=shape, vocab_size=self.vocab_size)


@functools.cache
def _cost_model(path: str | None) -> CostModel:
    """The cost model, built once per process (a fit to a table is not free): a saved
    ``FittedCostModel`` (``python -m benchmarks.replay.cost_model refit``), or the default fit."""
    return FittedCostModel.load(path) if path is not None else default_cost_model()
