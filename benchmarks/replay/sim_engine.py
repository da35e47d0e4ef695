"""The replay's two engines, built the way production builds an executor.

``sim``: :class:`SimulatedModelEngine` with the KV manager in bookkeeping mode. Scheduling,
the token-budget policy, KV allocation with prefix reuse and the host tier, and
``_prepare_tp_inputs`` all run for real; only the forward's arithmetic is replaced by a
cost model (``benchmarks.replay.cost_model``) that advances a :class:`VirtualClock`. Tokens come
from :class:`SyntheticSampler`, which never stops early.

``torch``: a :class:`LlamaForCausalLM` on the local device (a random-weight preset, or any
checkpoint ``LLM(model=...)`` takes: a Hugging Face directory or hub id, a GGUF file), real K/V
tensors, and a wall clock that skips idle gaps (see :class:`SkippingWallClock`), for
scaled-down traces.

Both return an :class:`Engine`: the executor plus the clock the replay injects arrivals on.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Protocol

from benchmarks.replay.cost_model import CostModel, ForwardShape, ModelShape, RooflineCostModel
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine, VirtualClock
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler

ENGINES = ("sim", "torch")
_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT


class ReplayClock(Protocol):
    """A clock the replay reads and, when the executor is idle, moves to the next arrival."""

    def __call__(self) -> float: ...

    def advance_to(self, when: float) -> None: ...


class SkippingWallClock:
    """Real seconds since construction, plus every idle gap the replay skipped.

    Busy time is measured (a real forward on this machine); waiting for the next arrival
    is not slept through but jumped over, so a trace's hours of idle time cost nothing.
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._skipped = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._t0 + self._skipped

    def advance_to(self, when: float) -> None:
        now = self()
        if when > now:
            self._skipped += when - now

    def restart(self) -> None:
        """Read 0 again (after set-up that must not count as serving time, e.g. graph capture)."""
        self._t0 = time.perf_counter()
        self._skipped = 0.0


def forward_shape(inputs: ForwardInputs) -> ForwardShape:
    """The cost model's view of one flat forward.

    Request ``i`` is a context chunk while it is still in context state (the executor moves
    it to generation only after the forward): ``num_new_tokens[i]`` positions attending to
    ``num_cached_tokens[i]`` earlier ones (the reused and previously computed prefix). A
    generation request is a decode of ``num_new_tokens[i]`` positions (1, beams, or
    1 + drafts) over its ``num_cached_tokens[i]`` tokens of context.
    """
    contexts = []
    decodes = []
    for request, new, cached in zip(inputs.requests, inputs.num_new_tokens, inputs.num_cached_tokens):
        if request.state is _CONTEXT_INIT:  # is_context_init_state without a property call per request
            contexts.append((new, cached))
        else:
            decodes.append((new, cached))
    return ForwardShape(contexts=tuple(contexts), decodes=tuple(decodes))


class CostModelTimer:
    """``forward_time_s`` for :class:`SimulatedModelEngine`: the cost model's time for the batch."""

    __slots__ = ("cost_model",)

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def __call__(self, inputs: ForwardInputs) -> float:
        return self.cost_model.forward_time_s(forward_shape(inputs))


def describe_cost_model(cost_model: CostModel) -> dict:
    """What the JSON's config says about the forward-time model."""
    description: dict = {"type": type(cost_model).__name__}
    describe = getattr(cost_model, "describe", None)
    if callable(describe):
        description.update(describe())
    fallback = getattr(cost_model, "fallback", None)
    roofline = cost_model if isinstance(cost_model, RooflineCostModel) else fallback
    if isinstance(roofline, RooflineCostModel):
        gpu, model = roofline.gpu, roofline.model
        description["gpu"] = {
            "name": gpu.name,
            "peak_flops": gpu.peak_flops,
            "mem_bandwidth": gpu.mem_bandwidth,
            "overhead_s": gpu.overhead_s,
        }
        description["model_shape"] = {
            name: getattr(model, name)
            for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                         "intermediate_size", "vocab_size", "dtype_bytes")
        }
    return description


@dataclass(slots=True)
class Engine:
    """An executor ready to replay on, the clock arrivals are injected on, and what it is."""

    executor: PyExecutor
    clock: ReplayClock
    vocab_size: int
    kv_bytes_per_token: int
    description: dict


def build_sim_engine(
    config: ExecutorConfig,
    *,
    cost_model: CostModel,
    model_shape: ModelShape = ModelShape(),
    vocab_size: int = 32000,
) -> Engine:
    """Simulated forward times on a virtual clock; the KV manager keeps books only.

    ``model_shape`` sizes a token's KV (the host tier's ``host_cache_size`` is in bytes);
    ``vocab_size`` is the synthetic sampler's (the trace's tokens must lie below it).
    """
    clock = VirtualClock()
    timer = CostModelTimer(cost_model)
    kv_bytes_per_token = model_shape.kv_bytes_per_token()

    def engine_factory(kv: KVCacheManager) -> SimulatedModelEngine:
        return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=vocab_size, clock=clock, forward_time_s=timer)

    executor = create_py_executor(
        config,
        engine_factory=engine_factory,
        sampler=SyntheticSampler(vocab_size),
        kv_bytes_per_token=kv_bytes_per_token,
        clock=clock,
    )
    description = {"engine": "sim", "clock": "virtual", "cost_model": describe_cost_model(cost_model)}
    return Engine(executor, clock, vocab_size, kv_bytes_per_token, description)


@functools.cache
def torch_model_config(model_name: str, device: str = "cpu") -> LlamaConfig:
    """The config of ``model_name`` on ``device``: a preset's, or a checkpoint's (read from its
    metadata, in the dtype ``LLM`` would run it in there). ValueError naming what was looked for."""
    if model_name in MODEL_PRESETS:
        return MODEL_PRESETS[model_name]
    from tensorrt_llm.llmapi.llm_utils import describe_checkpoint

    return describe_checkpoint(model_name, device=device).config


def torch_kv_bytes_per_token(model_name: str, device: str = "cpu") -> int:
    """Bytes of K and V one token occupies in ``model_name``'s paged cache, all layers."""
    config = torch_model_config(model_name, device)
    element = config.torch_dtype.itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def torch_vocab_size(model_name: str, device: str = "cpu") -> int:
    return torch_model_config(model_name, device).vocab_size


_MODELS: dict[tuple[str, str], LlamaForCausalLM] = {}


def torch_model(model_name: str, device: str = "cpu") -> LlamaForCausalLM:
    """``model_name``'s model on ``device``, built once per process: its weights are only read,
    and every policy of a replay runs the same model (on a GPU, 24.5 GB for Nemo). A preset's
    weights are drawn from its seed; a checkpoint's are loaded as ``LLM`` loads them."""
    key = (model_name, device)
    if key not in _MODELS:
        if model_name in MODEL_PRESETS:
            _MODELS[key] = LlamaForCausalLM(MODEL_PRESETS[model_name], device=None if device == "cpu" else device)
        else:
            from tensorrt_llm.llmapi.llm_utils import load_model

            _MODELS[key] = load_model(model_name, device=device).model
    return _MODELS[key]


def build_torch_engine(config: ExecutorConfig, *, model_name: str = "tiny-random", device: str = "cpu") -> Engine:
    """A real model on ``device`` (a preset or a checkpoint: :func:`torch_model`); forward times are
    measured (wall clock, the clock restarted after the engine's warm-up: CUDA-graph capture is not
    serving time)."""
    model_config = torch_model_config(model_name, device)
    clock = SkippingWallClock()
    executor = create_py_executor(config, model=torch_model(model_name, device), clock=clock)
    clock.restart()
    description = {
        "engine": "torch",
        "clock": "wall (idle gaps skipped)",
        "model": model_name,
        "model_config": {
            name: getattr(model_config, name)
            for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                         "intermediate_size", "dtype", "seed")
        },
        "device": device,
        "overlap": executor.overlap,
    }
    return Engine(executor, clock, model_config.vocab_size, torch_kv_bytes_per_token(model_name, device), description)

