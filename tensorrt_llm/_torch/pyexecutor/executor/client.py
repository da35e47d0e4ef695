"""``ExecutorClient``: what ``LLM``, the OpenAI server and the tests may ask of an executor.

Two classes stand in for each other behind it: :class:`~py_executor.PyExecutor` (one rank,
its loop on a thread of this process) and :class:`~distributed.multi_rank_executor.MultiRankExecutor`
(several rank processes, each with its own ``PyExecutor``). A caller never tells them apart:
everything it reads comes back as one of the values below, the same shape for both.

Every method is callable from any thread. Responses and iteration listeners run on the
executor's own thread (one rank) or its dispatcher thread (several): they must be quick.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVEventCounts, KVEventRecord
from tensorrt_llm._torch.pyexecutor.kv_cache.values import KvCacheStats
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats
from tensorrt_llm._torch.pyexecutor.response import ResponseCallback


IterationListener = Callable[[IterationStats], None]


@dataclass(frozen=True, slots=True)
class Health:
    """Liveness and the failures a load balancer should see (``/health`` serves it).

    ``healthy`` is False once the loop (or a rank) has died or shut down, or while it has
    work and has not shown progress for ``health_check_timeout_s``; ``reason`` says which.
    Failed batches do not make it unhealthy: the loop goes on serving. ``ranks`` and
    ``dead_ranks`` describe a multi-rank group (one rank: 1 and none).
    """

    healthy: bool
    reason: str | None
    alive: bool
    seconds_since_progress: float
    iterations: int
    active_requests: int
    queued_requests: int  # submitted, not yet fetched by the loop
    failed_batches: int  # running total, not a window
    budget_violations: int  # batches that failed TokenBudgetExceeded, running total
    last_error: str | None
    ranks: int = 1
    dead_ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "dead_ranks": list(self.dead_ranks)}


@dataclass(frozen=True, slots=True)
class Load:
    """The executor's load, for the server's gauges and admission: requests holding KV blocks,
    requests waiting (queued, or active without blocks yet), and the KV pool. Several ranks:
    summed over the ranks under attention DP (each holds its own requests), rank 0's under TP."""

    running: int
    waiting: int
    kv: KvCacheStats
    # the waiting requests the executor holds (not those still queued), by priority class
    # (``priority.priority_class``); empty where not counted (several ranks)
    waiting_by_class: Mapping[str, int] = field(default_factory=dict)


class ExecutorClient(Protocol):
    """The executor interface: submission, cancellation, health, load and statistics."""

    config: ExecutorConfig

    def start(self) -> None:
        """Start serving (idempotent)."""

    def shutdown(self) -> None:
        """Stop; every unfinished request ends with an ``ExecutorShutdown`` error."""

    def validate(self, request: LlmRequest) -> None:
        """Raise ``InvalidRequestError`` if this executor could never serve ``request``."""

    def enqueue_request(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        """Queue one request; returns its id. Raises ``ExecutorShutdown`` once stopped or dead."""

    def enqueue_requests(self, requests: Sequence[tuple[LlmRequest, ResponseCallback | None]]) -> list[int]:
        """Queue several requests at once: the loop fetches them in the same iteration."""

    def cancel_request(self, request_id: int) -> None:
        """End a request early: it finishes ``cancelled`` and its blocks are freed."""

    def health(self) -> Health: ...

    def load(self) -> Load: ...

    @property
    def iteration_stats(self) -> list[IterationStats]:
        """The most recent iteration statistics, oldest first (a bounded ring on a server)."""

    def iteration_stats_by_rank(self) -> list[tuple[int, IterationStats]]:
        """``(rank, stats)`` of :attr:`iteration_stats`, in the same order."""

    def add_iteration_listener(self, listener: IterationListener) -> None:
        """Call ``listener(stats)`` after every iteration; an exception it raises is logged."""

    def faults_injected(self) -> Mapping[str, int]:
        """Faults injected so far by kind (chaos testing); empty when injection is off or
        happens in other processes (several ranks)."""

    def get_kv_cache_events(self, timeout: float | None) -> list[KVEventRecord]:
        """The KV cache events emitted since the last call, oldest first, waiting up to
        ``timeout`` seconds for one when none is waiting; ``KVCacheEventsDisabled`` when
        ``kv_cache_config.event_buffer_max_size`` is 0. Several ranks: rank 0's pool's under
        tensor parallelism (every rank decides the same), every rank's under attention DP
        (each record names its rank)."""

    def kv_cache_event_counts(self) -> KVEventCounts | None:
        """Events emitted and dropped unread so far; None when events are off."""

    def reset_prefix_cache(self) -> bool:
        """Empty the reuse index between two iterations (``KVCacheManager.reset_prefix_cache``);
        False while a request holds cached blocks."""
