"""The serving loop of one rank behind ``LLM(tensor_parallel_size=N)``: a job on a :class:`RankGroup`.

Every rank builds its shard of the model (or, under attention DP, a replica) and its own
executor, then steps its :class:`RankExecutor` until rank 0 stops the group. Rank 0 also
talks to the ``LLM`` process: it takes ``("submit", RequestSpec)``, ``("cancel", id)`` and
``("stop", None)`` messages between iterations and posts every response and its iteration
statistics back. While no rank has work, rank 0 waits for a message for up to
``heartbeat_s`` before it steps again, so idle ranks sit in a collective that returns well
within the collective timeout.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from tensorrt_llm._torch.distributed.launcher import RankContext
from tensorrt_llm._torch.distributed.rank_executor import RankExecutor
from tensorrt_llm._torch.distributed.requests import RequestSpec
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import Response
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: LlamaConfig
    executor: ExecutorConfig
    enable_attention_dp: bool = False
    check_decisions: bool = False
    heartbeat_s: float = 1.0


def serve_rank(ctx: RankContext, config: ServeConfig) -> int:
    """Rank job: serve until rank 0 is told to stop; returns the number of group iterations."""
    mapping = ctx.mapping(enable_attention_dp=config.enable_attention_dp)
    executor = create_py_executor(config.executor, model=LlamaForCausalLM(config.model, mapping))
    rank_executor = RankExecutor(
        executor, ctx.comm, mapping, check_decisions=config.check_decisions, forward_responses=True
    )
    posts_stats = ctx.rank == 0 or config.enable_attention_dp  # under TP every rank's are rank 0's
    idle = True
    while True:
        if ctx.rank == 0:
            _take_messages(ctx, rank_executor, wait_s=config.heartbeat_s if idle else 0.0)
        step = rank_executor.step()
        if step.stopped:
            break
        if posts_stats and step.stats is not None:
            ctx.post(("stats", step.stats))
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
            spec: RequestSpec = body
            rank_executor.submit(spec.build(), respond)
        elif kind == "cancel":
            rank_executor.cancel(body)
        elif kind == "stop":
            rank_executor.request_stop()
        else:
            raise ValueError(f"rank 0 got an unknown message {kind!r}")
