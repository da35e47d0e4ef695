"""The serving loop of one rank behind ``LLM(tensor_parallel_size=N)``: a job on a :class:`RankGroup`.

Every rank builds its shard of the model (or, under attention DP, a replica): drawn from
the config's seed, or, with ``checkpoint``, read from that Hugging Face directory (each rank
reads only its slices of the safetensors) or GGUF file (each rank reads the whole file and
keeps its slices). A checkpoint's KV scales (every layer's, read by every rank) go to the
rank's pool under ``kv_cache_config.dtype: fp8``. Then it builds its own executor and steps its
:class:`RankExecutor` until rank 0 stops the group. Rank 0 also talks to the ``LLM``
process: it takes ``("submit", [RequestSpec, ...])`` (the requests of one ``enqueue_requests``), ``("cancel", id)`` and ``("stop", None)``
messages between iterations and posts back every response, its iteration statistics, its
load (running and waiting requests, KV usage) whenever that changed, and its pool's KV cache
events after each step (when on); under attention DP every rank posts its statistics, load and
events. While no rank has work, rank 0 waits for a
message for up to ``heartbeat_s`` before it steps again, so idle ranks sit in a collective
that returns well within the collective timeout.
"""

from __future__ import annotations

import dataclasses
import os
import queue
from dataclasses import dataclass

from tensorrt_llm._torch.attention_backend.kv_quant import kv_scales_for_pool
from tensorrt_llm._torch.distributed.launcher import RankContext
from tensorrt_llm._torch.distributed.rank_executor import RankExecutor
from tensorrt_llm._torch.distributed.request_spec import RequestSpec
from tensorrt_llm._torch.models.checkpoints import LoadedCheckpoint, load_checkpoint
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.mapping import Mapping


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: LlamaConfig
    executor: ExecutorConfig
    enable_attention_dp: bool = False
    check_decisions: bool = False
    heartbeat_s: float = 1.0
    checkpoint: str | None = None  # a Hugging Face directory or GGUF file ``model`` describes; None: seed-drawn


def serve_config(model: LlamaConfig, executor: ExecutorConfig, *, enable_attention_dp: bool = False,
                 check_decisions: bool = False, checkpoint: str | os.PathLike[str] | None = None) -> ServeConfig:
    """What every rank's serving job runs: built the same way by the process that spawns the
    ranks and by a ``torchrun`` follower, so that all ranks build the same model and executor."""
    return ServeConfig(model, executor, enable_attention_dp, check_decisions,
                       checkpoint=None if checkpoint is None else os.fspath(checkpoint))


def load_rank_checkpoint(config: ServeConfig, mapping: Mapping) -> LoadedCheckpoint:
    """This rank's shard: from the seed, or the checkpoint's full weights sliced on load (with the
    checkpoint's KV scales, if any)."""
    if config.checkpoint is None:
        return LoadedCheckpoint(LlamaForCausalLM(config.model, mapping))
    return load_checkpoint(config.checkpoint, config.model, mapping=mapping)


def build_rank_model(config: ServeConfig, mapping: Mapping) -> LlamaForCausalLM:
    """This rank's shard (:func:`load_rank_checkpoint`'s model)."""
    return load_rank_checkpoint(config, mapping).model


def build_rank_executor(config: ServeConfig, mapping: Mapping) -> PyExecutor:
    """This rank's executor over its shard; an FP8 pool gets the checkpoint's KV scales."""
    loaded = load_rank_checkpoint(config, mapping)
    kv_scales = kv_scales_for_pool(config.executor.kv_cache_config.dtype, loaded.kv_scales)
    return create_py_executor(config.executor, model=loaded.model, kv_scales=kv_scales)


def serve_rank(ctx: RankContext, config: ServeConfig) -> int:
    """Rank job: serve until rank 0 is told to stop; returns the number of group iterations."""
    mapping = ctx.mapping(enable_attention_dp=config.enable_attention_dp)
    posts_stats = ctx.rank == 0 or config.enable_attention_dp  # under TP every rank's are rank 0's
    if not posts_stats and config.executor.kv_cache_config.event_buffer_max_size:
        # under TP rank 0's pool's events are every rank's: the others' would go unread
        kv = dataclasses.replace(config.executor.kv_cache_config, event_buffer_max_size=0)
        config = dataclasses.replace(config, executor=dataclasses.replace(config.executor, kv_cache_config=kv))
    executor = build_rank_executor(config, mapping)
    events = executor.kv_cache_manager.events
    rank_executor = RankExecutor(
        executor, ctx.comm, mapping, check_decisions=config.check_decisions, forward_responses=True
    )
    if posts_stats:  # when they are made: under overlap an iteration completes in the next step
        executor.add_iteration_listener(lambda stats: ctx.post(("stats", stats)))
    idle, load = True, None
    while True:
        if ctx.rank == 0:
            _take_messages(ctx, rank_executor, wait_s=config.heartbeat_s if idle else 0.0)
        step = rank_executor.step()
        if events is not None and (records := events.take()):
            ctx.post(("kv_events", records))
        if step.stopped:
            break
        if posts_stats and (now := executor.load()) != load:
            load = now
            ctx.post(("load", load))
        idle = step.group_idle
    # Stopped: what is unfinished ends with ExecutorShutdown. Rank 0 posts its own; under
    # attention DP the LLM process ends what other ranks held (their group has stopped).
    executor.shutdown()
    return rank_executor.iteration


def _post_response(ctx: RankContext):
    def post(request: LlmRequest, response: Response) -> None:
        ctx.post(("response", response))

    return post


def _take_messages(ctx: RankContext, rank_executor: RankExecutor, wait_s: float) -> None:
    """Everything the LLM process sent since the last iteration (waiting up to ``wait_s`` for the first)."""
    respond = _post_response(ctx)
    timeout = wait_s
    while True:
        try:
            kind, body = ctx.receive(timeout)
        except queue.Empty:
            return
        timeout = 0.0
        if kind == "submit":
            specs: list[RequestSpec] = body
            for spec in specs:
                rank_executor.submit(spec.build(), respond)
        elif kind == "cancel":
            rank_executor.cancel(body)
        elif kind == "stop":
            rank_executor.request_stop()
        else:
            raise ValueError(f"rank 0 got an unknown message {kind!r}")
