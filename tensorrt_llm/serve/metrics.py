"""Prometheus metrics of a server: one registry per server (``/prometheus/metrics``).

Three sources, each pushed or pulled once:

- every executor iteration, on the executor thread (an iteration listener): budget
  deferrals and overshoots, failed batches, prefix-cache queries and hits, forward tokens
  and budget utilization;
- every request, on the event loop (:class:`RequestMetrics`): prompt and generated tokens,
  time to first token, inter-token latency, end-to-end latency, how it finished;
- at scrape time: running and waiting requests, KV-cache usage, the pool's size in tokens and
  (one rank) the bytes a token takes in it (``kv_cache_config.dtype``: fp8 halves them), health, injected faults, and
  memory: the process's (``process_resident_memory_bytes`` and the rest of prometheus-client's
  process collector) and, once CUDA is in use in this process, torch's allocated and reserved
  bytes per GPU (``trtllm_gpu_memory_{allocated,reserved}_bytes{device}``): a soak tells a leak
  (allocated grows) from the caching allocator keeping what a peak used (reserved grows);
- admission, on the event loop: requests refused with 503 before they were queued
  (``trtllm_requests_rejected_total{reason}``: ``unhealthy``, ``queue_full``);
- KV cache events (``kv_cache_config.event_buffer_max_size``, or ``kv_events_config``), read at
  scrape time from the event buffer's running totals: ``trtllm_kv_cache_events_total`` emitted,
  ``trtllm_kv_cache_events_dropped_total`` dropped unread because nobody read them in time (the
  buffer full: a publisher or a caller of ``get_kv_cache_events`` that fell behind). Absent
  while events are off.

prometheus-client objects are thread-safe, so the two writers need no lock of their own.

Priority classes (``SchedulerConfig.priority_low_below`` / ``priority_high_above``: "low",
"normal", "high"). ``trtllm_num_requests_waiting`` and ``trtllm_time_to_first_token_seconds``
keep their unlabelled series, every request counted, exactly as before (existing scrapers and
dashboards read the same numbers), and carry beside them, in the same family, one series per
class labelled ``priority_class``: the exposition allows a family's samples to differ in their
labels. Aggregate one or the other, never both: ``trtllm_num_requests_waiting{priority_class=""}``
is the total, ``sum(trtllm_num_requests_waiting{priority_class!=""})`` the same total from the
classes. The per-class waiting counts are the requests the executor holds without KV blocks
(a request still in the submission queue counts only in the total; several ranks do not count
classes yet: their class series stay 0). ``trtllm_preemptions_total`` counts requests paused
for one of higher priority (``SchedulerConfig.enable_preemption``; 0 without it).

Several ranks (``--tp_size``): the iteration listener runs on ``MultiRankExecutor``'s
dispatcher thread. Under TP it sees rank 0's iterations only: the ranks make one decision,
so each rank's counters would be the same, and summing them would count every deferral N
times. Under attention DP it sees every rank's iterations: each rank's batch is its own, so
the counters are sums over ranks. The gauges come from the ranks' last reported load; requests
submitted that no rank holds yet count as waiting.
"""

from __future__ import annotations

import time

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tensorrt_llm._torch.pyexecutor.executor.client import ExecutorClient, Load
from tensorrt_llm._torch.pyexecutor.priority import DEFAULT_PRIORITY, PRIORITY_CLASSES, priority_class
from tensorrt_llm._torch.pyexecutor.engine.fault_injection import FAULT_KINDS
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats

FINISH_REASONS = ("stop", "length", "error", "cancelled")
REJECT_REASONS = ("unhealthy", "queue_full")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_UTILIZATION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.25, 1.5, 2.0)  # > 1: an overshoot


def _token_buckets(max_num_tokens: int) -> tuple[float, ...]:
    """Powers of two up to the budget, the budget itself, and twice it (overshoots)."""
    buckets = {float(max_num_tokens), float(2 * max_num_tokens)}
    power = 1
    while power < max_num_tokens:
        buckets.add(float(power))
        power *= 2
    return tuple(sorted(buckets))


class ServerMetrics:
    """The registry and every metric; :meth:`request` starts one request's metrics."""

    def __init__(self, executor: ExecutorClient, *, kv_bytes_per_token: int | None = None) -> None:
        """``kv_bytes_per_token``: what a token takes in the KV pool (``LLM.kv_bytes_per_token``;
        None: not reported)."""
        self.registry = registry = CollectorRegistry()
        self._executor = executor

        Gauge("trtllm_num_requests_running", "Requests holding KV blocks in the executor", registry=registry
              ).set_function(lambda: self.load().running)
        registry.register(_WaitingCollector(self))
        Gauge("trtllm_kv_cache_usage_ratio", "Fraction of KV blocks referenced by requests (0..1)", registry=registry
              ).set_function(lambda: self.load().kv.usage)
        Gauge("trtllm_executor_healthy", "1 while /health answers 200", registry=registry
              ).set_function(lambda: float(executor.health().healthy))
        tokens_per_block = executor.config.kv_cache_config.tokens_per_block
        Gauge("trtllm_kv_cache_pool_tokens", "Tokens the KV pool holds (its blocks x tokens_per_block)",
              registry=registry).set_function(lambda: self.load().kv.num_blocks * tokens_per_block)
        if kv_bytes_per_token is not None:
            Gauge("trtllm_kv_cache_bytes_per_token", "Bytes of K and V one token takes in the pool, all layers",
                  registry=registry).set(kv_bytes_per_token)

        self.prefix_hit_tokens = Counter(
            "trtllm_prefix_cache_hit_tokens_total", "Prompt tokens whose KV was reused from the prefix cache",
            registry=registry)
        self.prefix_query_tokens = Counter(
            "trtllm_prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache", registry=registry)
        self.budget_deferrals = Counter(
            "trtllm_budget_deferrals_total", "Requests deferred by the token-budget re-check", registry=registry)
        self.budget_overshoots = Counter(
            "trtllm_budget_overshoots_total", "Forwards that exceeded max_num_tokens (their batch failed)",
            registry=registry)
        self.failed_batches = Counter(
            "trtllm_failed_batches_total", "Executor iterations whose batch failed", registry=registry)
        self.requests_retried = Counter(
            "trtllm_requests_retried_total", "Requests of a failed forward that started over instead of failing",
            registry=registry)
        self.iterations = Counter("trtllm_iterations_total", "Executor iterations", registry=registry)
        self.prompt_tokens = Counter(
            "trtllm_prompt_tokens_total", "Prompt tokens of requests that got their first token", registry=registry)
        self.generation_tokens = Counter(
            "trtllm_generation_tokens_total", "Tokens generated and delivered", registry=registry)
        self.request_success = Counter(
            "trtllm_request_success_total", "Finished requests by finish reason", ["finished_reason"],
            registry=registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.requests_rejected = Counter(
            "trtllm_requests_rejected_total", "Requests refused with 503 before they were queued, by reason",
            ["reason"], registry=registry)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(reason)

        self.forward_tokens = Histogram(
            "trtllm_iteration_forward_tokens", "Positions in each forward pass",
            buckets=_token_buckets(executor.config.max_num_tokens), registry=registry)
        self.budget_utilization = Histogram(
            "trtllm_budget_utilization", "Forward positions / max_num_tokens of each forward pass",
            buckets=_UTILIZATION_BUCKETS, registry=registry)
        # every request (unlabelled, as before) and by priority class, exposed as one family
        self.ttft = Histogram(
            "trtllm_time_to_first_token_seconds", "Request received to first token delivered",
            buckets=_LATENCY_BUCKETS, registry=None)
        self.ttft_by_class = Histogram(
            "trtllm_time_to_first_token_seconds", "Request received to first token delivered",
            ["priority_class"], buckets=_LATENCY_BUCKETS, registry=None)
        for name in PRIORITY_CLASSES:
            self.ttft_by_class.labels(name)
        registry.register(_MergedCollector(self.ttft, self.ttft_by_class))
        self.preemptions = Counter(
            "trtllm_preemptions_total", "Requests paused to make KV room for a request of higher priority",
            registry=registry)
        self.scheduling = executor.config.scheduler_config
        self.itl = Histogram(
            "trtllm_inter_token_latency_seconds", "Gap between delivered tokens", buckets=_LATENCY_BUCKETS,
            registry=registry)
        self.e2e = Histogram(
            "trtllm_e2e_request_latency_seconds", "Request received to request finished", buckets=_E2E_BUCKETS,
            registry=registry)

        ProcessCollector(registry=registry)
        registry.register(_GpuMemoryCollector())
        if executor.faults_injected():  # on, in this process (several ranks: in theirs)
            registry.register(_FaultCollector(executor))
        registry.register(_KvEventCollector(executor))
        executor.add_iteration_listener(self.on_iteration)

    def on_iteration(self, stats: IterationStats) -> None:
        """Executor thread, after every iteration."""
        self.iterations.inc()
        self.budget_deferrals.inc(stats.num_budget_deferrals)
        self.prefix_hit_tokens.inc(stats.reuse_claimed_tokens)
        self.prefix_query_tokens.inc(stats.reuse_query_tokens)
        if stats.overshoot > 0:
            self.budget_overshoots.inc()
        if stats.error is not None:
            self.failed_batches.inc()
        self.requests_retried.inc(stats.num_retried_requests)
        self.preemptions.inc(stats.num_preempted_requests)
        if stats.forward_tokens > 0:
            self.forward_tokens.observe(stats.forward_tokens)
            self.budget_utilization.observe(stats.budget_utilization)

    def request(self, priority: float = DEFAULT_PRIORITY) -> "RequestMetrics":
        return RequestMetrics(self, priority_class(priority, self.scheduling))

    def rejected(self, reason: str) -> None:
        """A request was refused at admission (``reason`` in REJECT_REASONS)."""
        self.requests_rejected.labels(reason).inc()

    def load(self) -> Load:
        """The executor's load now; callable from any thread (``ExecutorClient.load``)."""
        return self._executor.load()


class RequestMetrics:
    """One request's timing, from when the server received it; event loop only."""

    def __init__(self, metrics: ServerMetrics, priority_class: str = "normal") -> None:
        self._m = metrics
        self._class = priority_class
        self._start = self._last = time.monotonic()
        self._first = True
        self._done = False

    def tokens(self, count: int, prompt_tokens: int) -> None:
        """``count`` new tokens were delivered now."""
        if count <= 0:
            return
        now = time.monotonic()
        m = self._m
        if self._first:
            self._first = False
            m.ttft.observe(now - self._start)
            m.ttft_by_class.labels(self._class).observe(now - self._start)
            m.prompt_tokens.inc(prompt_tokens)
        else:
            gap = (now - self._last) / count
            for _ in range(count):
                m.itl.observe(gap)
        m.generation_tokens.inc(count)
        self._last = now

    def finished(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._m.request_success.labels(reason).inc()
        self._m.e2e.observe(time.monotonic() - self._start)


class _MergedCollector(Collector):
    """Metrics of one name, unlabelled and labelled, exposed as one family (see the module docstring)."""

    def __init__(self, *metrics) -> None:
        self._metrics = metrics

    def collect(self):
        merged = None
        for metric in self._metrics:
            for family in metric.collect():
                if merged is None:
                    merged = family
                else:
                    merged.samples.extend(family.samples)
        if merged is not None:
            yield merged


class _WaitingCollector(Collector):
    """``trtllm_num_requests_waiting``: the total, and the executor's waiting requests by priority class."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        load = self._metrics.load()
        family = GaugeMetricFamily("trtllm_num_requests_waiting", "Requests queued or active without KV blocks yet")
        family.add_metric([], load.waiting)
        by_class = GaugeMetricFamily("trtllm_num_requests_waiting", "", labels=["priority_class"])
        for name in PRIORITY_CLASSES:
            by_class.add_metric([name], load.waiting_by_class.get(name, 0))
        family.samples.extend(by_class.samples)
        yield family


class _FaultCollector(Collector):
    def __init__(self, executor: ExecutorClient) -> None:
        self._executor = executor

    def collect(self):
        family = CounterMetricFamily("trtllm_faults_injected", "Faults injected into forwards (chaos testing)",
                                     labels=["kind"])
        injected = self._executor.faults_injected()
        for kind in FAULT_KINDS:
            family.add_metric([kind], injected[kind])
        yield family


class _KvEventCollector(Collector):
    """KV cache events emitted and dropped (the buffer's running totals); nothing while events are off."""

    def __init__(self, executor: ExecutorClient) -> None:
        self._executor = executor

    def collect(self):
        counts = self._executor.kv_cache_event_counts()
        if counts is None:
            return
        yield CounterMetricFamily("trtllm_kv_cache_events", "KV cache events emitted by the block pool (stored,"
                                  " removed, moved between tiers, all cleared)", value=counts.emitted)
        yield CounterMetricFamily("trtllm_kv_cache_events_dropped", "KV cache events dropped unread: the event"
                                  " buffer was full (its reader fell behind)", value=counts.dropped)


class _GpuMemoryCollector(Collector):
    """torch's caching allocator, per GPU, read at scrape time (host-side counters: no sync).
    Nothing is reported until CUDA is initialised, so a CPU server never touches CUDA."""

    def collect(self):
        if not torch.cuda.is_initialized():
            return
        allocated = GaugeMetricFamily("trtllm_gpu_memory_allocated_bytes",
                                      "Bytes of GPU memory held by live tensors (torch.cuda.memory_allocated)",
                                      labels=["device"])
        reserved = GaugeMetricFamily("trtllm_gpu_memory_reserved_bytes",
                                     "Bytes of GPU memory held by torch's caching allocator (torch.cuda.memory_reserved)",
                                     labels=["device"])
        for index in range(torch.cuda.device_count()):
            allocated.add_metric([str(index)], torch.cuda.memory_allocated(index))
            reserved.add_metric([str(index)], torch.cuda.memory_reserved(index))
        yield allocated
        yield reserved
