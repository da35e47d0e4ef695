"""Executor configuration: dataclasses validated at construction, with upstream's field names."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class CapacitySchedulerPolicy(enum.Enum):
    """How the capacity scheduler admits requests into KV memory."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # reserve blocks to completion; never pause a started request
    MAX_UTILIZATION = "MAX_UTILIZATION"  # reserve one step; pause the last started request when blocks run out


class ContextChunkingPolicy(enum.Enum):
    """How the micro-batch scheduler splits the token budget between context requests."""

    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


class WaitingQueuePolicy(enum.Enum):
    """Which waiting request is served first when not all can be (upstream's names)."""

    FCFS = "fcfs"  # arrival order; a request's priority is accepted and ignored
    PRIORITY = "priority"  # effective priority (priority raised by aging), then arrival


class TokenBudgetPolicyName(enum.Enum):
    """Which guard keeps a forward pass within ``max_num_tokens`` (see ``token_budget``)."""

    NONE = "none"  # upstream before any fix
    TRIM = "trim"  # shrink trailing chunks at the top of _prepare_tp_inputs (closed upstream proposal)
    FIT = "fit"  # shrink chunks after allocation (upstream's merged approach)
    RECHECK = "recheck"  # ours: full-cost re-check before any allocation
    CLAIM = "claim"  # ours, later work: pin every matched prefix first, then charge exact costs


def parse_enum(kind: type[enum.Enum], value: object, name: str) -> enum.Enum:
    """``value`` as a member of ``kind`` (a member, or a member's value); ValueError naming
    ``name`` and the choices otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in kind)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


#: ``KvCacheConfig.dtype`` values (upstream's names); ``attention_backend.kv_quant`` maps them to torch dtypes.
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(slots=True)
class KvCacheConfig:
    """Paged KV cache settings.

    The pool is ``num_blocks`` blocks of ``tokens_per_block`` tokens, or enough blocks for
    ``max_tokens`` tokens. ``host_cache_size`` is the host (offload) tier in bytes, as
    upstream; 0 disables the tier.

    On a GPU, with neither size given, the pool takes ``free_gpu_memory_fraction`` of the device
    memory still free once the weights are loaded (upstream's default 0.9); the rest is left to
    activations, CUDA graphs and the allocator. On the CPU the fraction is not used.

    ``offload_ahead_blocks`` (needs the host tier; 0, the default, turns it off): after each
    launch the KV manager moves least recently used cached blocks to the host until this many
    primary blocks are free. Their copies then run beside the forward just launched instead of
    just before the forward that needs the slots (``KVCacheManager.offload_ahead``), at the price
    of the reserve's share of the primary cache (its blocks stay matchable, from the host).

    ``dtype`` (upstream's key): what the pool stores, ``"auto"`` (the model's dtype) or ``"fp8"``
    (float8_e4m3fn, with per-layer K/V scales: the checkpoint's; without them, derived at
    start-up from a calibration prefill when ``calculate_kv_scales`` (vLLM's name; the default),
    else 1.0: ``models/kv_calibration.py``). FP8 takes half
    a bf16 pool's bytes per token, so a pool sized by memory (``free_gpu_memory_fraction``, or the
    CPU's default cap) holds twice the tokens; ``max_tokens`` / ``num_blocks`` stay token counts.
    Attention dequantizes what it reads (``attention_backend/kv_quant.py``).

    ``event_buffer_max_size`` (upstream's key; 0, the default, turns events off at no cost):
    the pool tells what its reuse index does (blocks stored, removed, moved between tiers, all
    cleared) into a buffer of this many events, read by ``LLM.get_kv_cache_events`` or the ZMQ
    publisher (``kv_events_config``); unread events beyond it are dropped, oldest first, and
    counted (``kv_cache/events.py``, ``docs/scale-out.md``).
    """

    tokens_per_block: int = 32  # tokens per KV block, the unit of allocation and of prefix reuse
    max_tokens: int | None = None  # the pool's size in tokens (or num_blocks, not both)
    num_blocks: int | None = None  # the pool's size in blocks (or max_tokens, not both)
    enable_block_reuse: bool = True  # a prompt claims the cached blocks of its prefix instead of recomputing them
    enable_partial_reuse: bool = True  # a partly matching block is copied and reused too
    host_cache_size: int = 0  # the host (offload) tier, in bytes; 0: none
    free_gpu_memory_fraction: float = 0.9  # GPU, neither size given: the share of free memory the pool takes
    offload_ahead_blocks: int = 0  # with a host tier: primary blocks kept free by offloading after each launch
    # what the pool stores: auto (the model's dtype) or fp8 (float8_e4m3fn, half bf16's bytes)
    dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    # KV cache events kept for a reader (LLM.get_kv_cache_events, the ZMQ publisher); 0: events off
    event_buffer_max_size: int = 0
    # fp8 without a checkpoint's scales: derive per-layer scales at start-up (True) or use 1.0
    calculate_kv_scales: bool = True

    def __post_init__(self) -> None:
        _positive("KvCacheConfig.tokens_per_block", self.tokens_per_block)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"KvCacheConfig.calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KvCacheConfig.dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))},"
                             f" got {self.dtype!r}")
        fraction = self.free_gpu_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"KvCacheConfig.free_gpu_memory_fraction must be in (0, 1], got {fraction!r}")
        if self.max_tokens is not None and self.num_blocks is not None:
            raise ValueError("KvCacheConfig: give max_tokens or num_blocks, not both")
        if self.max_tokens is not None:
            _positive("KvCacheConfig.max_tokens", self.max_tokens)
        if self.num_blocks is not None:
            _positive("KvCacheConfig.num_blocks", self.num_blocks)
        if not isinstance(self.host_cache_size, int) or isinstance(self.host_cache_size, bool) or self.host_cache_size < 0:
            raise ValueError(f"KvCacheConfig.host_cache_size must be >= 0 bytes, got {self.host_cache_size!r}")
        # Whether there is a host tier to offload to is checked where it is sized, by the KV manager.
        _non_negative_int("KvCacheConfig.offload_ahead_blocks", self.offload_ahead_blocks)
        _non_negative_int("KvCacheConfig.event_buffer_max_size", self.event_buffer_max_size)

    @property
    def is_sized(self) -> bool:
        """True when the pool's size is given (``num_blocks`` or ``max_tokens``)."""
        return self.num_blocks is not None or self.max_tokens is not None

    def resolve_num_blocks(self, default_blocks: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if self.max_tokens is not None:
            return -(-self.max_tokens // self.tokens_per_block)
        return default_blocks


def _non_negative_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _positive_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class FaultInjectionConfig:
    """Chaos testing (off by default): faults injected into the model engine's forwards.

    Counting forwards from 1, every ``forward_error_every``-th raises (its batch fails), every
    ``nan_logits_every``-th gives one sampling request of the batch NaN logits (that request
    fails), every ``slow_forward_every``-th first sleeps ``slow_forward_s``. 0 disables a fault.
    ``seed`` picks which request gets the NaN logits.
    """

    forward_error_every: int = 0  # every N-th forward raises, failing its batch; 0: never
    nan_logits_every: int = 0  # every N-th forward gives one request NaN logits, failing it; 0: never
    slow_forward_every: int = 0  # every N-th forward first sleeps slow_forward_s; 0: never
    slow_forward_s: float = 1.0  # how long a slow forward sleeps, in seconds
    seed: int = 0  # picks the request that gets NaN logits

    def __post_init__(self) -> None:
        for name in ("forward_error_every", "nan_logits_every", "slow_forward_every"):
            _non_negative_int(f"fault_injection.{name}", getattr(self, name))
        _positive_seconds("fault_injection.slow_forward_s", self.slow_forward_s)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"fault_injection.seed must be an integer, got {self.seed!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.forward_error_every or self.nan_logits_every or self.slow_forward_every)


@dataclass(slots=True)
class CudaGraphConfig:
    """Decode steps replayed from CUDA graphs, one graph per batch size (upstream's names).

    A forward whose requests all compute one token (a decode batch) and whose size has a graph
    (or, with ``enable_padding``, is at most the largest one: padded up to the next) replays
    its graph instead of launching some 600 kernels from Python. ``batch_sizes`` default: 1, 2,
    4, 8, then every multiple of 8, the powers of two, and ``max_batch_size`` itself (0: the
    executor's; with speculative decoding the rows of a verification step count, ``max_batch_size
    * (1 + max_draft_len)``: each draft position is a decode row of its own). Padding is on by
    default here (upstream: off), because decode batch sizes change every few iterations in
    serving. Graphs are captured when a size is first used. Ignored on the CPU.

    Every other forward (context chunks, with or without decodes; a decode batch no decode graph
    serves: beams, prompt logits, drafts, more requests than the largest size) of at most the
    largest of ``capture_num_tokens`` tokens is padded up to the next of them and replays
    piecewise graphs: everything but attention, which runs eagerly between them
    (``piecewise_cuda_graph``; the name is upstream's, from its ``torch_compile_config``).
    Default: 16, 32, 64, 128, 256, 384, 512, 768, 1024, with ``max_num_tokens`` in place of the
    sizes above it. Given sizes above ``max_num_tokens`` are dropped (no forward needs them); an
    empty list turns the piecewise graphs off. Captured at the engine's warm-up.
    """

    batch_sizes: list[int] | None = None  # the batch sizes with a graph; default: see above
    max_batch_size: int = 0  # the largest batch size with a graph; 0: the executor's max_batch_size
    enable_padding: bool = True  # a decode batch of a size without a graph is padded up to the next one
    capture_num_tokens: list[int] | None = None  # mixed forwards' padded token counts with piecewise graphs

    def __post_init__(self) -> None:
        if self.batch_sizes is not None:
            if not self.batch_sizes:
                raise ValueError("CudaGraphConfig.batch_sizes must not be empty (use cuda_graph_config=None)")
            for size in self.batch_sizes:
                _positive("CudaGraphConfig.batch_sizes[]", size)
            self.batch_sizes = sorted(set(self.batch_sizes))
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 0:
            raise ValueError(f"CudaGraphConfig.max_batch_size must be an int >= 0, got {self.max_batch_size!r}")
        if self.capture_num_tokens is not None:
            if not isinstance(self.capture_num_tokens, (list, tuple)):
                raise ValueError(f"CudaGraphConfig.capture_num_tokens must be a list of ints, got {self.capture_num_tokens!r}")
            for size in self.capture_num_tokens:
                _positive("CudaGraphConfig.capture_num_tokens[]", size)
            self.capture_num_tokens = sorted(set(self.capture_num_tokens))

    def resolve_capture_num_tokens(self, max_num_tokens: int) -> list[int]:
        """The padded token counts of the piecewise graphs (see the class docstring)."""
        if self.capture_num_tokens is not None:
            return [s for s in self.capture_num_tokens if s <= max_num_tokens]
        top = min(1024, max_num_tokens)  # past ~1k tokens a mixed forward is bound by the GPU, not the host
        return sorted(s for s in {16, 32, 64, 128, 256, 384, 512, 768, 1024, top} if s <= top)

    def resolve_batch_sizes(self, executor_max_batch_size: int) -> list[int]:
        if self.batch_sizes is not None:
            return list(self.batch_sizes)
        limit = self.max_batch_size or executor_max_batch_size
        sizes = {1, 2, 4, limit} | set(range(8, limit + 1, 8)) | {1 << i for i in range(limit.bit_length())}
        return sorted(s for s in sizes if s <= limit) or [1]


class DecodingType(enum.Enum):
    """Speculative decoding modes (upstream's ``decoding_type`` names)."""

    NGRAM = "NGram"  # prompt lookup: drafts from the request's own tokens, no second model


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (upstream's ``speculative_config``): a drafter proposes up to
    ``max_draft_len`` tokens per step and the target model verifies them in one forward.

    Only greedy requests with one beam are speculated on (their outputs equal those without
    speculation, token for token); every other request runs as without it. Each speculative
    request's first generation step is a first-draft step of ``1 + max_draft_len`` positions.

    Speculation that does not pay can be turned off, as upstream's fields do:
    ``max_concurrency`` skips the drafts of an iteration with more active requests than that
    (those still in their prompt included: a large batch gains little from drafts and pays their
    positions), and
    ``acceptance_rate_threshold`` turns speculation off for good once the acceptance (accepted
    over verified drafts) over the last ``acceptance_rate_window_size`` iterations that verified
    drafts (8 unless given) falls below it. Then every request leaves speculation and runs as
    without it (CUDA graphs and the overlap scheduler again).
    """

    decoding_type: DecodingType = DecodingType.NGRAM  # the drafter, upstream's name: NGram (prompt lookup)
    max_draft_len: int = 4  # draft tokens proposed per step (at most)
    # NGram: the longest suffix of the sequence looked up earlier in it (shorter ones are tried next)
    max_matching_ngram_size: int = 3
    max_concurrency: int | None = None  # no drafts in an iteration with more active requests; None: no limit
    acceptance_rate_threshold: float | None = None  # speculation off for good below this acceptance; None: never
    acceptance_rate_window_size: int = 8  # iterations with drafts the threshold's acceptance is taken over

    def __post_init__(self) -> None:
        object.__setattr__(self, "decoding_type", parse_enum(DecodingType, self.decoding_type, "speculative_config.decoding_type"))
        _positive("speculative_config.max_draft_len", self.max_draft_len)
        _positive("speculative_config.max_matching_ngram_size", self.max_matching_ngram_size)
        if self.max_concurrency is not None:
            _positive("speculative_config.max_concurrency", self.max_concurrency)
        _positive("speculative_config.acceptance_rate_window_size", self.acceptance_rate_window_size)
        threshold = self.acceptance_rate_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 <= threshold <= 1):
            raise ValueError(f"speculative_config.acceptance_rate_threshold must be in [0, 1], got {threshold!r}")


#: A request's priority when none is given (upstream's default), and the range priorities live in.
DEFAULT_PRIORITY = 0.5


def _unit_interval(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Who runs and who waits (upstream's ``scheduler_config``): the capacity and chunking
    policies, the waiting-queue policy, and what ``priority`` adds to it.

    Under ``waiting_queue_policy="priority"`` every decision that chooses who waits follows a
    request's *effective priority*, ``priority + priority_aging_rate * seconds waited`` (see
    ``pyexecutor/priority.py``, which states the wait bound aging gives). With
    ``enable_preemption`` a waiting request that cannot get KV memory may pause running
    requests of strictly lower priority (``pyexecutor/scheduler/preemption.py``); a request that resumed
    is not paused again for ``preemption_cooldown_iterations`` iterations. Priority classes, for
    the metrics: below ``priority_low_below`` is "low", above ``priority_high_above`` "high", the
    rest "normal" (by default: below 0.5, 0.5, above 0.5). ``low_priority_max_num_tokens`` caps
    the "low" class's prompt tokens per forward, so that forwards carrying only low-priority
    prefill stay short and a higher-priority arrival starts sooner. ``docs/scheduler.md`` has it all.
    """

    # How the capacity scheduler admits requests into KV memory.
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    # How the micro-batch scheduler splits the token budget between context requests.
    context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    # fcfs: arrival order (priority ignored); priority: effective priority, then arrival.
    waiting_queue_policy: WaitingQueuePolicy = WaitingQueuePolicy.FCFS
    # priority: effective priority gained per second a request has waited since it arrived (0: no aging).
    priority_aging_rate: float = 0.01
    # priority: a waiting request that cannot get KV memory may pause running ones of strictly lower priority.
    enable_preemption: bool = False
    # a request that resumed after a preemption is not preempted again for this many iterations.
    preemption_cooldown_iterations: int = 16
    # priority: prompt tokens of "low" requests one forward computes at most (None: no cap). Short
    # forwards while only low-priority prompts run let a higher-priority arrival start sooner.
    low_priority_max_num_tokens: int | None = None
    # metrics: a priority below this is in class "low".
    priority_low_below: float = DEFAULT_PRIORITY
    # metrics: a priority above this is in class "high" (between the two: "normal").
    priority_high_above: float = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "capacity_scheduler_policy", parse_enum(
            CapacitySchedulerPolicy, self.capacity_scheduler_policy, "scheduler_config.capacity_scheduler_policy"))
        set_(self, "context_chunking_policy", parse_enum(
            ContextChunkingPolicy, self.context_chunking_policy, "scheduler_config.context_chunking_policy"))
        set_(self, "waiting_queue_policy", parse_enum(
            WaitingQueuePolicy, self.waiting_queue_policy, "scheduler_config.waiting_queue_policy"))
        rate = self.priority_aging_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise ValueError(f"scheduler_config.priority_aging_rate must be a finite number >= 0, got {rate!r}")
        if not isinstance(self.enable_preemption, bool):
            raise ValueError(f"scheduler_config.enable_preemption must be a bool, got {self.enable_preemption!r}")
        _non_negative_int("scheduler_config.preemption_cooldown_iterations", self.preemption_cooldown_iterations)
        if self.low_priority_max_num_tokens is not None:
            _positive("scheduler_config.low_priority_max_num_tokens", self.low_priority_max_num_tokens)
        _unit_interval("scheduler_config.priority_low_below", self.priority_low_below)
        _unit_interval("scheduler_config.priority_high_above", self.priority_high_above)
        if self.priority_low_below > self.priority_high_above:
            raise ValueError(f"scheduler_config.priority_low_below ({self.priority_low_below}) must not exceed"
                             f" priority_high_above ({self.priority_high_above})")
        if self.enable_preemption and self.waiting_queue_policy is not WaitingQueuePolicy.PRIORITY:
            raise ValueError("scheduler_config.enable_preemption needs waiting_queue_policy='priority'"
                             " (under fcfs every request has the same priority: none could preempt another)")

    @property
    def by_priority(self) -> bool:
        return self.waiting_queue_policy is WaitingQueuePolicy.PRIORITY


#: ``ExecutorConfig``'s flat keywords that stand for ``scheduler_config``'s fields (today's names).
SCHEDULER_ALIASES = ("capacity_scheduler_policy", "context_chunking_policy")


@dataclass(slots=True)
class ExecutorConfig:
    """Scheduling and budget settings of one executor."""

    max_batch_size: int = 64  # requests in one forward
    max_num_tokens: int = 8192  # the token budget: positions in one forward
    max_seq_len: int = 4096  # prompt and output tokens of one request
    enable_chunked_prefill: bool = False  # a long prompt is computed in chunks that fit the token budget
    chunk_unit_size: int | None = None  # context chunks are multiples of it (but the last); None: tokens_per_block
    # Alias of scheduler_config.context_chunking_policy (None: scheduler_config's).
    context_chunking_policy: ContextChunkingPolicy | None = None
    # Alias of scheduler_config.capacity_scheduler_policy (None: scheduler_config's).
    capacity_scheduler_policy: CapacitySchedulerPolicy | None = None
    # Who runs and who waits: capacity, chunking and waiting-queue policies, priority, preemption.
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    # The guard that keeps a forward within max_num_tokens (recheck: the full-cost re-check).
    token_budget_policy: TokenBudgetPolicyName = TokenBudgetPolicyName.RECHECK
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)  # the paged KV cache
    # Serving: /health reports the loop stalled when, with work, no iteration finished for this long.
    health_check_timeout_s: float = 60.0
    # Iteration statistics kept (a ring, oldest dropped); None keeps all (replays read the whole record).
    iter_stats_max_iterations: int | None = None
    fault_injection: FaultInjectionConfig | None = None  # chaos testing: faults injected into forwards; None: off
    # A request whose forward fails (an error raised by the engine, not a budget violation) starts
    # over, its KV recomputed, up to this many times in a row (without a token generated in
    # between) before it fails with the error; 0: fail at once.
    max_forward_retries: int = 1
    # Decode steps replayed from CUDA graphs (ignored on the CPU); None: no graphs.
    cuda_graph_config: CudaGraphConfig | None = field(default_factory=CudaGraphConfig)
    # Upstream's overlap scheduler: schedule and prepare iteration n+1 while the engine runs n.
    # None (default): on when the engine completes asynchronously (CUDA), off on the CPU, whose
    # engine is synchronous (nothing to hide the host's work behind). See PyExecutor.
    disable_overlap_scheduler: bool | None = None
    # Speculative decoding (NGram: prompt lookup); None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(
                f"speculative_config must be a SpeculativeConfig or None, got {type(self.speculative_config).__name__}"
            )
        if self.disable_overlap_scheduler is not None and not isinstance(self.disable_overlap_scheduler, bool):
            raise ValueError(f"disable_overlap_scheduler must be a bool or None, got {self.disable_overlap_scheduler!r}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            _positive(name, getattr(self, name))
        _positive_seconds("health_check_timeout_s", self.health_check_timeout_s)
        _non_negative_int("max_forward_retries", self.max_forward_retries)
        if self.iter_stats_max_iterations is not None:
            _positive("iter_stats_max_iterations", self.iter_stats_max_iterations)
        if self.fault_injection is not None and not isinstance(self.fault_injection, FaultInjectionConfig):
            raise ValueError(f"fault_injection must be a FaultInjectionConfig, got {type(self.fault_injection).__name__}")
        self._resolve_scheduler_aliases()
        self.token_budget_policy = parse_enum(TokenBudgetPolicyName, self.token_budget_policy, "token_budget_policy")
        if self.cuda_graph_config is not None and not isinstance(self.cuda_graph_config, CudaGraphConfig):
            raise ValueError(
                f"cuda_graph_config must be a CudaGraphConfig or None, got {type(self.cuda_graph_config).__name__}"
            )
        if not isinstance(self.kv_cache_config, KvCacheConfig):
            raise ValueError(f"kv_cache_config must be a KvCacheConfig, got {type(self.kv_cache_config).__name__}")
        tokens_per_block = self.kv_cache_config.tokens_per_block
        if self.chunk_unit_size is None:
            self.chunk_unit_size = tokens_per_block
        _positive("chunk_unit_size", self.chunk_unit_size)
        # A non-last chunk must end on a block boundary even after a reuse shift; that
        # is only possible when chunks are whole blocks.
        if self.chunk_unit_size % tokens_per_block:
            raise ValueError(
                f"chunk_unit_size ({self.chunk_unit_size}) must be a multiple of tokens_per_block ({tokens_per_block})"
            )
        if self.enable_chunked_prefill and self.max_num_tokens < self.chunk_unit_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= chunk_unit_size ({self.chunk_unit_size})"
                " with chunked prefill, or no chunk could ever be scheduled"
            )

    def _resolve_scheduler_aliases(self) -> None:
        """``scheduler_config`` from a mapping, and the flat aliases reconciled with it.

        An alias given with a value other than the default sets that field of
        ``scheduler_config``; giving both, with different values other than the default, is an
        error naming both. Afterwards each alias holds the value in force (readers may use either).
        """
        if isinstance(self.scheduler_config, dict):
            unknown = set(self.scheduler_config) - {f.name for f in dataclasses.fields(SchedulerConfig)}
            if unknown:
                raise ValueError(f"scheduler_config has unknown keys {sorted(unknown)}")
            self.scheduler_config = SchedulerConfig(**self.scheduler_config)
        if not isinstance(self.scheduler_config, SchedulerConfig):
            raise ValueError(f"scheduler_config must be a SchedulerConfig or a mapping, got {type(self.scheduler_config).__name__}")
        default = SchedulerConfig()
        kinds = {"capacity_scheduler_policy": CapacitySchedulerPolicy, "context_chunking_policy": ContextChunkingPolicy}
        for name in SCHEDULER_ALIASES:
            alias = getattr(self, name)
            nested = getattr(self.scheduler_config, name)
            if alias is not None:
                alias = parse_enum(kinds[name], alias, name)
                if alias is not nested:
                    if nested is not getattr(default, name) and alias is not getattr(default, name):
                        raise ValueError(f"{name}={alias.value!r} and scheduler_config.{name}={nested.value!r} disagree:"
                                         f" give one of them")
                    if alias is not getattr(default, name):
                        self.scheduler_config = dataclasses.replace(self.scheduler_config, **{name: alias})
            setattr(self, name, getattr(self.scheduler_config, name))
