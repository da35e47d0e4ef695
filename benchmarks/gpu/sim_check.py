"""The simulator's cost model against the engine: every iteration of a real executor on the GPU.

The default replay scenario (scaled down to ``num_requests``) runs through the real
``PyExecutor`` with ``TorchModelEngine`` on the GPU, under the replay's default settings
(``max_num_tokens=4096``, chunked prefill, block and partial reuse, host tier, ``recheck``).
Each forward records its shape (``sim_engine.forward_shape``, what the simulator prices) and
its device time; each iteration its wall time. The cost models then price every recorded
shape: the fitted model the simulator uses by default and the plain roofline.

Relative error per iteration: ``|predicted - measured| / measured``; reported as median and
p90, against the device time of the forward (what the model claims to predict) and against the
wall time of the whole iteration (what a simulated replay advances its clock by).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from benchmarks.replay.cost_model import CostModel, FittedCostModel, ForwardShape, RooflineCostModel, default_cost_model
from benchmarks.gpu.common import model_shape, quantile
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.loop import replay_policy
from benchmarks.replay.scenario import ScenarioConfig, default_scenario
from benchmarks.replay.sim_engine import Engine, SkippingWallClock, forward_shape, torch_kv_bytes_per_token
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Recorder:
    forwards: list = field(default_factory=list)  # (ForwardShape, PendingForward)
    iteration_stats: list | None = None


@dataclass(frozen=True, slots=True)
class _GpuSettings(ReplaySettings):
    """Replay settings whose torch engine is an already-built model on its device, recorded."""

    gpu_model: LlamaForCausalLM | None = field(default=None, compare=False)
    recorder: _Recorder | None = field(default=None, compare=False)

    def build_engine(self, policy: str, max_seq_len: int) -> Engine:
        kv_bytes = torch_kv_bytes_per_token(self.model)
        config = self.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=kv_bytes)
        clock = SkippingWallClock()
        executor = create_py_executor(config, model=self.gpu_model, clock=clock)
        clock.restart()  # the engine's warm-up (graph capture) is not serving time
        engine = executor.model_engine
        engine.time_forwards = self.gpu_model.device.type == "cuda"
        recorder = self.recorder
        recorder.iteration_stats = executor.iteration_stats
        launch = engine.launch

        def recorded_launch(inputs):
            pending = launch(inputs)
            recorder.forwards.append((forward_shape(inputs), pending))
            return pending

        engine.launch = recorded_launch
        description = {"engine": "torch", "model": self.model, "device": str(self.gpu_model.device)}
        return Engine(executor, clock, self.gpu_model.config.vocab_size, kv_bytes, description)


def _errors(predicted: list[float], measured: list[float]) -> dict:
    rel = [abs(p - m) / m for p, m in zip(predicted, measured) if m > 0]
    if not rel:
        return {"n": 0}
    signed = [(p - m) / m for p, m in zip(predicted, measured) if m > 0]
    return {"median_rel_err": quantile(rel, 0.5), "p90_rel_err": quantile(rel, 0.9), "max_rel_err": max(rel),
            "median_signed_err": quantile(signed, 0.5), "n": len(rel)}


def sim_vs_engine(model: LlamaForCausalLM, model_name: str, *, num_requests: int, seed: int = 0,
                  policy: str = "recheck") -> dict:
    """Replay the scaled-down default scenario on the GPU engine and on the simulator."""
    # Token ids below both vocabularies (the simulator's synthetic one is 32000).
    vocab = min(32000, model.config.vocab_size)
    trace = default_scenario(ScenarioConfig(num_requests=num_requests, seed=seed, vocab_size=vocab))
    recorder = _Recorder()
    gpu = _GpuSettings(engine="torch", model=model_name, gpu_model=model, recorder=recorder)
    gpu_run = replay_policy(trace, gpu, policy, progress=True)
    sim_run = replay_policy(trace, ReplaySettings(engine="sim"), policy, progress=False)

    shapes = [shape for shape, _ in recorder.forwards]
    device_ms = [pending.device_time_ms() for _, pending in recorder.forwards]
    if any(t is None for t in device_ms):  # CPU dry run: no device events; use the iteration's wall time
        device_ms = None
    stats = [s for s in recorder.iteration_stats if s.forward_tokens > 0 and not s.error]
    wall_ms = [(s.end_time - s.start_time) * 1e3 for s in stats]

    shape_m = model_shape(model.config)
    models: dict[str, CostModel] = {"fitted": default_cost_model(), "roofline": RooflineCostModel(shape_m)}
    out = {
        "trace": {"requests": len(trace), "seed": seed, "prompt_tokens": sum(r.input_len for r in trace.requests),
                  "output_tokens": sum(r.output_len for r in trace.requests)},
        "settings": ReplaySettings().options(),
        "policy": policy,
        "gpu_metrics": gpu_run.metrics,
        "sim_metrics": sim_run.metrics,
        "iterations": len(shapes),
        "errors": {},
        "per_iteration": [],
    }
    for name, cost_model in models.items():
        predicted = [cost_model.forward_time_s(s) * 1e3 for s in shapes]
        entry = {}
        if device_ms is not None:
            entry["vs_device_time"] = _errors(predicted, device_ms)
        if len(wall_ms) == len(shapes):
            entry["vs_iteration_wall"] = _errors(predicted, wall_ms)
        if isinstance(cost_model, FittedCostModel):
            entry["in_range_fraction"] = sum(cost_model.in_range(s) for s in shapes) / max(1, len(shapes))
        out["errors"][name] = entry
    for i, shape in enumerate(shapes):
        out["per_iteration"].append({
            "tokens": shape.num_tokens,
            "contexts": [list(c) for c in shape.contexts],
            "decodes": [c for _, c in shape.decodes],
            "device_ms": device_ms[i] if device_ms else None,
            "wall_ms": wall_ms[i] if len(wall_ms) == len(shapes) else None,
            "fitted_ms": models["fitted"].forward_time_s(shape) * 1e3,
            "roofline_ms": models["roofline"].forward_time_s(shape) * 1e3,
        })
    return out


def calibration_errors(rows: list[dict]) -> dict:
    """Cost models and the shared table against the engine on the shared table's shapes."""
    from benchmarks.replay.cost_model import table_row_shape

    measured = [r for r in rows if "device_ms" in r]
    if not measured:
        return {}
    fitted, roof = default_cost_model(), RooflineCostModel()
    shapes = [table_row_shape(r) for r in measured]
    engine_ms = [r["device_ms"] for r in measured]
    return {
        "rows_measured": len(measured),
        "rows_skipped": len(rows) - len(measured),
        "fitted_vs_engine": _errors([fitted.forward_time_s(s) * 1e3 for s in shapes], engine_ms),
        "roofline_vs_engine": _errors([roof.forward_time_s(s) * 1e3 for s in shapes], engine_ms),
        "shared_table_vs_engine": _errors([r["shared_ms"] for r in measured], engine_ms),
        "engine_over_shared_median": quantile([e / r["shared_ms"] for e, r in zip(engine_ms, measured)], 0.5),
    }


def _iteration_shape(it: dict) -> ForwardShape:
    return ForwardShape(contexts=tuple(tuple(c) for c in it["contexts"]), decodes=tuple((1, c) for c in it["decodes"]))


def refit_check(rows: list[dict], per_iteration: list[dict]) -> dict:
    """How far refitting the cost model's form to the engine closes the gap (the committed
    model stays as it is):

    * ``on_engine_table``: fitted to the engine's times on the shared table's shapes, checked on
      every executor iteration;
    * ``on_iterations``: fitted to the even executor iterations, checked on the odd ones.
    """
    its = [it for it in per_iteration if it["device_ms"]]
    if len(its) < 20:
        return {}
    fallback = RooflineCostModel()
    out = {}
    measured = [r for r in rows if "device_ms" in r]
    if len(measured) >= 10:
        from benchmarks.replay.cost_model import table_row_shape

        refit = FittedCostModel.from_shapes([table_row_shape(r) for r in measured],
                                            [r["device_ms"] * 1e-3 for r in measured], fallback)
        shapes = [_iteration_shape(it) for it in its]
        out["on_engine_table"] = {"model": refit.describe(), "vs_device_time": _errors(
            [refit.forward_time_s(s) * 1e3 for s in shapes], [it["device_ms"] for it in its])}
    train, test = its[::2], its[1::2]
    refit = FittedCostModel.from_shapes([_iteration_shape(it) for it in train],
                                        [it["device_ms"] * 1e-3 for it in train], fallback)
    out["on_iterations"] = {"model": refit.describe(), "vs_device_time": _errors(
        [refit.forward_time_s(_iteration_shape(it)) * 1e3 for it in test], [it["device_ms"] for it in test])}
    return out
