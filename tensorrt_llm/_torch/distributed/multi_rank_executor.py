"""``MultiRankExecutor``: the executor ``LLM`` talks to when it runs on several ranks.

It implements :class:`~pyexecutor.executor_client.ExecutorClient`, as :class:`PyExecutor`
does, and behind it starts ``tensor_parallel_size`` rank processes that run :func:`serve_rank`. Requests go to rank 0
as plain :class:`RequestSpec` data; a dispatcher thread routes the responses rank 0 posts
back to each request's callback.

Nothing hangs: if a rank process dies or the rank job fails (a divergence, an aborted
group), every request still in flight ends with that error, later submissions are refused
with :class:`ExecutorShutdown`, and :meth:`health` reports the group dead with the reason
(a dead rank is named as soon as its process has exited).

Statistics: under TP the ranks make one decision, so rank 0's iteration statistics are the
group's (every rank's would count each iteration N times); under attention DP each rank's
are its own batch's, and all of them count (counters sum over ranks). They are kept in a
ring of ``iter_stats_max_iterations`` entries per rank (default ``DEFAULT_MAX_STATS``);
the failed-batch and overshoot totals of :meth:`health` are running counts, not the ring's.

KV cache events (``kv_cache_config.event_buffer_max_size``): the ranks post their pools' events
after each step and they wait here, in a buffer of that size, for :meth:`get_kv_cache_events`.
Under TP rank 0's pool speaks for all (every rank decides the same; the others emit none);
under attention DP every rank's pool is its own, and each record names its rank.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Mapping, Sequence

from tensorrt_llm._torch.distributed.launcher import LaunchOptions, RankGroup, RankResult
from tensorrt_llm._torch.distributed.request_spec import RequestSpec
from tensorrt_llm._torch.distributed.torchrun import TorchrunGroup
from tensorrt_llm._torch.distributed.worker import serve_config, serve_rank
from tensorrt_llm._torch.models.modeling_llama import HeadShard, LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVCacheEventBuffer, KVEventCounts, KVEventRecord
from tensorrt_llm._torch.pyexecutor.kv_cache.values import KvCacheStats
from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown, InvalidRequestError, KVCacheEventsDisabled
from tensorrt_llm._torch.pyexecutor.executor.client import Health, IterationListener, Load
from tensorrt_llm._torch.pyexecutor.response import Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager
from tensorrt_llm._torch.pyexecutor.executor.validation import RequestLimits, validate_request
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATS = 1000  # iteration statistics kept per rank (the newest) without iter_stats_max_iterations


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
        checkpoint: str | os.PathLike[str] | None = None,
        group: RankGroup | TorchrunGroup | None = None,
    ) -> None:
        """``checkpoint``: a Hugging Face directory or GGUF file whose weights ``model`` describes;
        every rank reads its slices. Without it the ranks draw ``model``'s weights from its seed.

        ``group``: the ranks. None spawns them here (:class:`RankGroup`); a
        :class:`TorchrunGroup` is rank 0 of ranks ``torchrun`` started, whose followers run
        :func:`serve_config`'s job on their own (``torchrun.follow``)."""
        mapping = Mapping(tensor_parallel_size, 0, tensor_parallel_size, enable_attention_dp)
        HeadShard.of(model, mapping.attn_tp_size, 0)  # refuse an unshardable model before spawning
        self.config = config
        self.mapping = mapping
        self.shutdown_timeout_s = shutdown_timeout_s
        self._validator = _Validator(model, config, mapping)
        self._lock = threading.Lock()
        self._callbacks: dict[int, tuple[LlmRequest, ResponseCallback | None]] = {}
        ring = config.iter_stats_max_iterations or DEFAULT_MAX_STATS
        self._stats: dict[int, collections.deque[IterationStats]] = {
            rank: collections.deque(maxlen=ring) for rank in range(tensor_parallel_size)
        }
        self._loads: dict[int, Load] = {}
        events = config.kv_cache_config.event_buffer_max_size
        self._kv_events = KVCacheEventBuffer(events) if events else None
        self._listeners: list[IterationListener] = []
        self._iterations = 0  # group iterations rank 0 reported
        self._failed_batches = 0
        self._budget_violations = 0
        self._heartbeat = time.monotonic()  # the last time a rank posted anything
        self._failure: str | None = None
        self._stopping = False
        if group is not None and group.world_size != tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, but the launch has {group.world_size} ranks")
        self._group = group if group is not None else RankGroup(tensor_parallel_size, launch_options)
        serve = serve_config(model, config, enable_attention_dp=enable_attention_dp, check_decisions=check_decisions,
                             checkpoint=checkpoint)
        self._job = self._group.start(serve_rank, serve)
        self._dispatcher = threading.Thread(target=self._dispatch, name="MultiRankExecutor", daemon=True)
        self._dispatcher.start()

    # ---- what LLM calls -------------------------------------------------------------
    def start(self) -> None:
        """The ranks start serving at construction; kept for PyExecutor's interface."""

    def validate(self, request: LlmRequest) -> None:
        self._validator(request)

    def enqueue_request(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        return self.enqueue_requests([(request, on_response)])[0]

    def enqueue_requests(self, requests: Sequence[tuple[LlmRequest, ResponseCallback | None]]) -> list[int]:
        """One message to rank 0, which takes all of them before its next iteration."""
        with self._lock:
            if self._failure is not None or self._stopping:
                raise ExecutorShutdown(self._failure or "the executor is shut down")
            dead = self._group.dead_ranks()
            if dead:  # before the dispatcher has noticed and failed the group
                raise ExecutorShutdown(self._group.why_dead(dead[0]))
            if not self._callbacks:  # idle ranks report nothing: the stall clock starts with the work
                self._heartbeat = time.monotonic()
            for request, on_response in requests:
                self._callbacks[request.request_id] = (request, on_response)
        now = time.monotonic()
        self._group.send(0, ("submit", [RequestSpec.of(request, arrival_time=now) for request, _ in requests]))
        return [request.request_id for request, _ in requests]

    def cancel_request(self, request_id: int) -> None:
        if self._failure is None and not self._stopping:
            self._group.send(0, ("cancel", request_id))

    @property
    def iteration_stats(self) -> list[IterationStats]:
        """Rank 0's statistics (under attention DP: every rank's, ordered by iteration then rank)."""
        return [s for _, s in self.iteration_stats_by_rank()]

    def iteration_stats_by_rank(self) -> list[tuple[int, IterationStats]]:
        """``(rank, stats)`` of :attr:`iteration_stats`, in the same order."""
        with self._lock:
            if not self.mapping.enable_attention_dp:
                return [(0, s) for s in self._stats[0]]
            merged = [(s.iteration, rank, s) for rank, stats in self._stats.items() for s in stats]
        return [(rank, s) for _, rank, s in sorted(merged, key=lambda item: item[:2])]

    def add_iteration_listener(self, listener: IterationListener) -> None:
        """Call ``listener(stats)`` for every iteration the group reports (rank 0's under TP,
        every rank's under attention DP), on the dispatcher thread; it must be quick. An
        exception it raises is logged and ignored."""
        self._listeners.append(listener)

    @property
    def rank_pids(self) -> list[int | None]:
        """The process id of each rank, by rank (an operator's, or a test's that kills one);
        None for a rank on another host."""
        return self._group.pids

    def faults_injected(self) -> Mapping[str, int]:
        """None here: fault injection runs inside the rank processes."""
        return {}

    def get_kv_cache_events(self, timeout: float | None) -> list[KVEventRecord]:
        """The events the ranks posted since the last call (see the module docstring)."""
        if self._kv_events is None:
            raise KVCacheEventsDisabled("KV cache events are off: set kv_cache_config.event_buffer_max_size > 0")
        return self._kv_events.take(timeout)

    def kv_cache_event_counts(self) -> KVEventCounts | None:
        return self._kv_events.counts() if self._kv_events is not None else None

    def reset_prefix_cache(self) -> bool:
        """Refused: the ranks would have to reset at the same iteration (not built)."""
        raise NotImplementedError("reset_prefix_cache runs with one rank only (tensor_parallel_size=1)")

    def load(self) -> Load:
        """The group's load as the ranks last reported it, plus what rank 0 has not taken yet:
        under TP rank 0's (every rank holds the same requests); under attention DP summed over
        the ranks (every rank has a pool of the same size)."""
        with self._lock:
            load = _combined(list(self._loads.values()))
            queued = max(0, len(self._callbacks) - load.running - load.waiting)
        return Load(load.running, load.waiting + queued, load.kv)

    def health(self) -> Health:
        """:class:`Health` of the whole group, with ``ranks`` and ``dead_ranks``.

        Unhealthy once any rank has died (the reason names it, even before the dispatcher has
        failed the group), the group failed or shut down, or while requests are in flight and
        no rank has reported anything for ``health_check_timeout_s``."""
        with self._lock:
            dead = self._group.dead_ranks()
            in_flight = len(self._callbacks)
            stalled_s = time.monotonic() - self._heartbeat if in_flight else 0.0
            load = _combined(list(self._loads.values()))
            if self._failure is not None:
                reason = f"the rank group failed: {self._failure}"
            elif dead:
                reason = "a rank is dead: " + "; ".join(self._group.why_dead(r) for r in dead)
            elif self._stopping:
                reason = "the executor is shut down"
            elif stalled_s > self.config.health_check_timeout_s:
                reason = (f"no rank has reported progress for {stalled_s:.1f} s while requests are in flight"
                          f" (health_check_timeout_s={self.config.health_check_timeout_s:g})")
            else:
                reason = None
            return Health(
                healthy=reason is None,
                reason=reason,
                alive=self._failure is None and not dead and not self._stopping,
                seconds_since_progress=round(stalled_s, 3),
                iterations=self._iterations,
                active_requests=in_flight,
                # submitted, not yet held by any rank (the ranks' last report)
                queued_requests=max(0, in_flight - load.running - load.waiting),
                failed_batches=self._failed_batches,
                budget_violations=self._budget_violations,
                # a dead rank is news before the dispatcher has noticed it and failed the group
                last_error=self._failure or (f"rank {dead[0]} exited" if dead else None),
                ranks=self.mapping.world_size,
                dead_ranks=tuple(dead),
            )

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
                    self._ended(None, group.why_dead(dead[0]))
                    group.close(kill=True)
                    return
                continue
            self._route(rank, kind, body)

    def _drain_posts(self) -> None:
        while not self._group.posts.empty():
            rank, (kind, body) = self._group.posts.get_nowait()
            self._route(rank, kind, body)

    def _route(self, rank: int, kind: str, body) -> None:
        with self._lock:
            self._heartbeat = time.monotonic()
        if kind == "stats":
            self._record(rank, body)
        elif kind == "load":
            with self._lock:
                self._loads[rank] = body
        elif kind == "response":
            self._respond(body)
        elif kind == "kv_events" and self._kv_events is not None:
            records: list[KVEventRecord] = body
            if self.mapping.enable_attention_dp:  # each rank's pool is its own: say whose
                records = [record._replace(rank=rank) for record in records]
            self._kv_events.forward(records)

    def _record(self, rank: int, stats: IterationStats) -> None:
        with self._lock:
            self._stats[rank].append(stats)
            if rank == 0:
                self._iterations = stats.iteration + 1
            self._failed_batches += stats.error is not None
            self._budget_violations += stats.overshoot > 0
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # a listener must not stop the responses
                logger.exception("iteration listener %r failed", listener)

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


def _combined(loads: list[Load]) -> Load:
    if not loads:
        return Load(0, 0, KvCacheStats(0, 0, 0))
    return Load(sum(x.running for x in loads), sum(x.waiting for x in loads), sum((x.kv for x in loads[1:]), loads[0].kv))


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
        if request.beam_width > 1:
            # The ranks exchange each request's picked token, not beams (their tables, parents, scores).
            raise InvalidRequestError(
                f"request {request.request_id}: beam search runs with one rank only (tensor_parallel_size=1,"
                " no attention DP)"
            )
        validate_request(request, self.limits, self.kv)
