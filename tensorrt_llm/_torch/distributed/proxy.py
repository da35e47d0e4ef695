"""``MultiRankExecutor``: the executor ``LLM`` talks to when it runs on several ranks.

It offers what ``LLM`` uses of :class:`PyExecutor` (``validate``, ``enqueue_request``,
``cancel_request``, ``health``, ``iteration_stats``, ``shutdown``), and behind it starts
``tensor_parallel_size`` rank processes that run :func:`serve_rank`. Requests go to rank 0
as plain :class:`RequestSpec` data; a dispatcher thread routes the responses rank 0 posts
back to each request's callback.

Nothing hangs: if a rank process dies or the rank job fails (a divergence, an aborted
group), every request still in flight ends with that error, later submissions are refused
with :class:`ExecutorShutdown`, and :meth:`health` reports the group dead with the reason.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from tensorrt_llm._torch.distributed.launcher import LaunchOptions, RankGroup, RankResult
from tensorrt_llm._torch.distributed.requests import RequestSpec
from tensorrt_llm._torch.distributed.worker import ServeConfig, serve_rank
from tensorrt_llm._torch.models.modeling_llama import HeadShard, LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager
from tensorrt_llm._torch.pyexecutor.request_validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.stats import IterationStats
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

_MAX_STATS = 10_000  # iteration statistics kept per rank (the newest)


class MultiRankExecutor:
    def __init__(
        self,
        model: LlamaConfig,
        config: ExecutorConfig,
        *,
        tensor_parallel_size: int,
        enable_attention_dp: bool = False,
        check_decisions: bool = False,
        launch_options: LaunchOptions = LaunchOptions(),
        shutdown_timeout_s: float = 60.0,
    ) -> None:
        mapping = Mapping(tensor_parallel_size, 0, tensor_parallel_size, enable_attention_dp)
        HeadShard.of(model, mapping.attn_tp_size, 0)  # refuse an unshardable model before spawning
        self.config = config
        self.mapping = mapping
        self.shutdown_timeout_s = shutdown_timeout_s
        self._validator = _Validator(model, config, mapping)
        self._lock = threading.Lock()
        self._callbacks: dict[int, tuple[LlmRequest, ResponseCallback | None]] = {}
        self._stats: dict[int, collections.deque[IterationStats]] = collections.defaultdict(
            lambda: collections.deque(maxlen=_MAX_STATS)
        )
        self._failure: str | None = None
        self._stopping = False
        self._group = RankGroup(tensor_parallel_size, launch_options)
        serve = ServeConfig(model, config, enable_attention_dp, check_decisions)
        self._job = self._group.start(serve_rank, serve)
        self._dispatcher = threading.Thread(target=self._dispatch, name="MultiRankExecutor", daemon=True)
        self._dispatcher.start()

    # ---- what LLM calls -------------------------------------------------------------
    def start(self) -> None:
        """The ranks start serving at construction; kept for PyExecutor's interface."""

    def validate(self, request: LlmRequest) -> None:
        self._validator(request)

    def enqueue_request(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        with self._lock:
            if self._failure is not None or self._stopping:
                raise ExecutorShutdown(self._failure or "the executor is shut down")
            self._callbacks[request.request_id] = (request, on_response)
        self._group.send(0, ("submit", RequestSpec.of(request, arrival_time=time.monotonic())))
        return request.request_id

    def cancel_request(self, request_id: int) -> None:
        if self._failure is None and not self._stopping:
            self._group.send(0, ("cancel", request_id))

    @property
    def iteration_stats(self) -> list[IterationStats]:
        """Rank 0's statistics (under attention DP: every rank's, ordered by iteration then rank)."""
        with self._lock:
            if not self.mapping.enable_attention_dp:
                return list(self._stats[0])
            merged = [(s.iteration, rank, s) for rank, stats in self._stats.items() for s in stats]
        return [s for _, _, s in sorted(merged, key=lambda item: item[:2])]

    def health(self) -> dict:
        with self._lock:
            stats = [s for per_rank in self._stats.values() for s in per_rank]
            dead = self._group.dead_ranks()
            return {
                "alive": self._failure is None and not dead and not self._stopping,
                "ranks": self.mapping.world_size,
                "dead_ranks": dead,
                "iterations": max((s.iteration + 1 for s in self._stats[0]), default=0),
                "active_requests": len(self._callbacks),
                "failed_batches": sum(1 for s in stats if s.error),
                "budget_violations": sum(1 for s in stats if s.overshoot),
                # a dead rank is news before the dispatcher has noticed it and failed the group
                "last_error": self._failure or (f"rank {dead[0]} exited" if dead else None),
            }

    def shutdown(self) -> None:
        """Stop every rank; requests still in flight end with ExecutorShutdown."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self._failure is None:
            self._group.send(0, ("stop", None))
        self._dispatcher.join(self.shutdown_timeout_s)
        self._group.close(kill=self._dispatcher.is_alive())
        self._fail_all("the executor shut down before the request finished")

    # ---- the dispatcher -------------------------------------------------------------
    def _dispatch(self) -> None:
        group = self._group
        while True:
            try:
                rank, (kind, body) = group.posts.get(timeout=0.2)
            except queue.Empty:  # nothing posted: look after the ranks
                results = group.poll(self._job)
                if results is not None:
                    self._drain_posts()
                    self._ended(results)
                    return
                dead = group.dead_ranks()
                if dead:
                    self._ended(None, f"rank {dead[0]} exited with code {group.processes[dead[0]].exitcode}")
                    group.close(kill=True)
                    return
                continue
            self._route(rank, kind, body)

    def _drain_posts(self) -> None:
        while not self._group.posts.empty():
            rank, (kind, body) = self._group.posts.get_nowait()
            self._route(rank, kind, body)

    def _route(self, rank: int, kind: str, body) -> None:
        if kind == "stats":
            with self._lock:
                self._stats[rank].append(body)
        elif kind == "response":
            self._respond(body)

    def _respond(self, response: Response) -> None:
        with self._lock:
            entry = self._callbacks.get(response.request_id)
            if entry is not None and response.finished:
                del self._callbacks[response.request_id]
        if entry is not None and entry[1] is not None:
            entry[1](entry[0], response)

    def _ended(self, results: list[RankResult] | None, reason: str | None = None) -> None:
        failed = [r for r in results or () if not r.ok]
        if failed or reason:
            message = reason or "; ".join(f"rank {r.rank}: {r.error_type}: {r.error}" for r in failed)
            logger.error("the rank group failed: %s", message)
            with self._lock:
                self._failure = message
            self._fail_all(message)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending, self._callbacks = self._callbacks, {}
        for request, callback in pending.values():
            request.set_error(f"{ExecutorShutdown.__name__}: {message}")
            if callback is not None:
                callback(request, Response(request.request_id, [], finished=True, error=request.error))


class _Validator:
    """``PyExecutor.validate`` without an executor: the limits every rank enforces, computed here."""

    def __init__(self, model: LlamaConfig, config: ExecutorConfig, mapping: Mapping) -> None:
        shard = HeadShard.of(model, mapping.attn_tp_size, 0)
        kv_heads = shard.kv_heads[1] - shard.kv_heads[0]
        kv_bytes_per_token = 2 * model.num_layers * kv_heads * model.head_dim * model.torch_dtype.itemsize
        self.kv = create_kv_cache_manager(config, kv_bytes_per_token=kv_bytes_per_token)  # bookkeeping only
        self.limits = RequestLimits(
            max_seq_len=config.max_seq_len,
            max_num_tokens=config.max_num_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            vocab_size=model.vocab_size,
            max_beam_width=TorchModelEngine.max_beam_width,
            supports_draft_tokens=TorchModelEngine.supports_draft_tokens,
            num_kv_blocks=self.kv.num_blocks,
            chunk_unit_size=config.chunk_unit_size,
        )

    def __call__(self, request: LlmRequest) -> None:
        validate_request(request, self.limits, self.kv)
