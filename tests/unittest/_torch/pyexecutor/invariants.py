"""The invariant checker every test uses (DESIGN.md §3).

Batch level (one ``prepare_resources`` + ``_prepare_tp_inputs``, :func:`run_batch` then
:func:`check_batch`): 1. no overshoot, 2. the full forward cost computed before allocation
bounds the positions appended (equal when no reuse materialises), 3. a deferred request is
untouched and no block leaks.
Executor level (:class:`ExecutorChecker`, after every ``step``): the same 1-3 on the batch
the step ran, 4. nothing is lost, 5. progress, 6. KV integrity; at a drain, liveness and the
leak oracle.

Failures raise AssertionError with the batch printed in readable form (:func:`format_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import ClaimRecord, KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor, Response
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

ALL_INVARIANTS = frozenset(range(1, 7))
#: What each policy promises. ``none`` and ``fit`` do not claim safety (1). ``trim`` shrinks
#: chunks by arbitrary token counts (5: chunk ends off block boundaries) and defers requests
#: after their blocks were claimed (3) — defects of the closed proposal, not checked for it.
POLICY_INVARIANTS: dict[TokenBudgetPolicyName, frozenset[int]] = {
    TokenBudgetPolicyName.RECHECK: ALL_INVARIANTS,
    TokenBudgetPolicyName.CLAIM: ALL_INVARIANTS,
    TokenBudgetPolicyName.CLAIM: ALL_INVARIANTS,
    TokenBudgetPolicyName.FIT: ALL_INVARIANTS - {1},
    TokenBudgetPolicyName.NONE: ALL_INVARIANTS - {1},
    TokenBudgetPolicyName.TRIM: frozenset({2, 4, 6}),
}


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    state: object
    position: int
    chunk: int
    prepopulated: int
    block_table: tuple[int, ...] | None
    full_cost: int
    budget_deferred: bool = False  # entered the iteration owing a budget deferral
    reuse_can_shift: bool = False  # full_cost counts drafts in case reuse makes this the last chunk
    text: str = ""  # repr at snapshot time


def snapshot(request: LlmRequest, kv: KVCacheManager) -> RequestSnapshot:
    table = tuple(kv.block_table(request)) if kv.is_allocated(request) else None
    can_shift = kv.reuse_can_shift(request)
    return RequestSnapshot(
        state=request.state,
        position=request.context_current_position,
        chunk=request.context_chunk_size,
        prepopulated=request.prepopulated_prompt_len,
        block_table=table,
        full_cost=forward_cost(request, reuse_can_shift=can_shift),
        budget_deferred=request.py_budget_deferred,
        reuse_can_shift=can_shift,
        text=repr(request),
    )


@dataclass(frozen=True, slots=True)
class BuiltRequest:
    """A request as ``_prepare_tp_inputs`` saw it: its positions and the window they came from."""

    positions: int
    prepopulated: int
    chunk: int
    is_context: bool
    last_chunk: bool
    drafts: int


def built(scheduled: ScheduledRequests) -> dict[int, BuiltRequest]:
    """Taken right after ``_prepare_tp_inputs`` (which asserts each request appends ``forward_cost``)."""
    return {
        r.request_id: BuiltRequest(
            forward_cost(r),
            r.prepopulated_prompt_len,
            r.context_chunk_size,
            r.is_context_init_state,
            r.is_last_context_chunk,
            r.num_draft_tokens,
        )
        for r in scheduled.all_requests
    }


def describe_kv(kv: KVCacheManager) -> str:
    """The pool in one line: sizes, what is free / cached / held, the host tier, the reuse switches."""
    pool = kv.pool
    held = pool.num_blocks - pool.num_free - pool.num_cached
    host = f", host tier {pool.num_host_blocks} blocks ({pool.num_host_cached} cached)" if pool.num_host_blocks else ""
    partial = "on" if kv.enable_partial_reuse else "off"
    reuse = f"reuse on, partial {partial}" if kv.enable_block_reuse else "reuse off"
    return (
        f"KV pool {pool.num_blocks} blocks x tokens_per_block={kv.tokens_per_block}"
        f" (free {pool.num_free}, cached {pool.num_cached}, held {held}){host}; {reuse}"
    )


@dataclass(slots=True)
class BatchOutcome:
    """What one batch did: the positions built, or the overshoot that stopped it."""

    scheduled: ScheduledRequests
    before: dict[int, RequestSnapshot]
    forward_tokens: int | None = None
    overshoot: TokenBudgetExceeded | None = None
    description: str = ""
    max_num_tokens: int = 0
    kv_before: str = ""
    policy: str = ""
    charges: dict[int, int] = field(default_factory=dict)  # what admission charged each request
    built: dict[int, BuiltRequest] = field(default_factory=dict)  # each request as the forward took it
    claims: list[ClaimRecord] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        """Positions the forward carried (or would have carried, for a batch that overshot)."""
        return self.overshoot.total_num_tokens if self.overshoot is not None else (self.forward_tokens or 0)

    @property
    def overshoot_tokens(self) -> int:
        return max(0, self.total_tokens - self.max_num_tokens)


def run_batch(scheduled: ScheduledRequests, kv: KVCacheManager, engine: ModelEngine) -> BatchOutcome:
    """``prepare_resources`` then ``_prepare_tp_inputs`` on one batch, recording what each step saw."""
    description = repr(scheduled)
    before = {r.request_id: snapshot(r, kv) for r in scheduled.all_requests}
    policy = kv.token_budget.name.value if kv.token_budget is not None else "-"
    outcome = BatchOutcome(
        scheduled,
        before,
        description=description,
        max_num_tokens=engine.max_num_tokens,
        kv_before=describe_kv(kv),
        policy=policy,
        charges=dict(scheduled.charges),
    )
    kv.prepare_resources(scheduled)
    outcome.claims = list(kv.last_claims)
    try:
        outcome.forward_tokens = engine._prepare_tp_inputs(scheduled).total_num_tokens
    except TokenBudgetExceeded as error:
        outcome.overshoot = error
    outcome.built = built(scheduled)
    return outcome


def format_batch(outcome: BatchOutcome) -> str:
    """The batch as a person reads it: the pool, each request as scheduled and as it ran, the total."""
    claims = {c.request_id: c for c in outcome.claims}
    deferred = {r.request_id: why.value for r, why in outcome.scheduled.deferred_requests}
    admitted = {r.request_id: r for r in outcome.scheduled.all_requests}
    lines = [f"{outcome.kv_before}", f"policy {outcome.policy}, max_num_tokens={outcome.max_num_tokens}"]
    for request_id, was in outcome.before.items():
        charge = outcome.charges.get(request_id)
        line = f"  {was.text:<62} charged {charge if charge is not None else '-':>4}  full cost {was.full_cost:>4}"
        if request_id in deferred:
            line += f"  -> deferred ({deferred[request_id]})"
        elif request_id in admitted:
            claim = claims.get(request_id)
            reuse = f", reused {claim.reused_tokens} of est {claim.estimated_reusable_tokens}" if claim else ""
            now = outcome.built.get(request_id)
            line += f"  -> appends {now.positions if now else '?'}{reuse}"
        lines.append(line)
    verdict = (
        f"overshoot +{outcome.overshoot_tokens}" if outcome.overshoot_tokens else f"fits ({outcome.total_tokens})"
    )
    lines.append(f"total built {outcome.total_tokens} vs max_num_tokens {outcome.max_num_tokens}: {verdict}")
    return "\n".join(lines)


def check_batch(
    outcome: BatchOutcome,
    kv: KVCacheManager,
    max_num_tokens: int,
    *,
    claims_safety: bool,
    check_deferrals: bool = True,
) -> None:
    """Invariants 1-3 (1 only where the policy claims safety; 3 unless ``check_deferrals`` is off)."""
    context = f"\n{format_batch(outcome)}\nbatch as scheduled: {outcome.description}"
    if claims_safety:
        assert outcome.overshoot is None, f"invariant 1 (no overshoot) violated: {outcome.overshoot}{context}"
        assert outcome.forward_tokens <= max_num_tokens, context
    check_costs(outcome.before, outcome.built, context)
    if check_deferrals:
        check_deferrals_clean(outcome.scheduled, outcome.before, kv, context)
    kv.check_integrity()


def check_costs(before: dict[int, RequestSnapshot], built: dict[int, "BuiltRequest"], context: str = "") -> None:
    """Invariant 2 for every request that reached ``_prepare_tp_inputs``."""
    for request_id, now in built.items():
        was = before[request_id]
        assert now.positions <= was.full_cost, (
            f"invariant 2 (cost is an upper bound) violated for {was.text}: charged {was.full_cost},"
            f" appends {now.positions}{context}"
        )
        untouched = now.prepopulated == was.prepopulated and now.chunk == was.chunk
        if untouched and now.is_context:
            dropped = now.drafts if was.reuse_can_shift and not now.last_chunk else 0
            assert now.positions == was.full_cost - dropped, (
                f"invariant 2: no reuse materialised but {was.text} appends {now.positions} != charged"
                f" {was.full_cost}{context}"
            )


def check_deferrals_clean(
    scheduled: ScheduledRequests, before: dict[int, RequestSnapshot], kv: KVCacheManager, context: str = ""
) -> None:
    """Invariant 3: a deferred request holds what it held, where it was (the caller checks leaks)."""
    for request, _reason in scheduled.deferred_requests:
        was, now = before[request.request_id], snapshot(request, kv)
        assert (now.state, now.position, now.prepopulated, now.block_table) == (
            was.state,
            was.position,
            was.prepopulated,
            was.block_table,
        ), f"invariant 3 (clean deferral) violated for {request!r}: was {was}, now {now}{context}"


def check_budget_priority(outcome: BatchOutcome) -> None:
    """Invariant 5's "never deferred twice in a row for budget reasons", for a batch the real
    scheduler built under ``recheck``: a request that entered owing a deferral was charged
    its full cost, so the re-check must admit it."""
    for request, reason in outcome.scheduled.deferred_requests:
        if reason is DeferReason.BUDGET and outcome.before[request.request_id].budget_deferred:
            raise AssertionError(
                f"invariant 5: {request!r} was budget-deferred twice in a row\n{format_batch(outcome)}"
            )


@dataclass(slots=True)
class ExecutorChecker:
    """Drives a :class:`PyExecutor` and checks invariants after every step.

    It observes each iteration between scheduling and allocation (a snapshot of the batch)
    and at ``_prepare_tp_inputs`` (the positions each request appends) by wrapping those
    two calls on this executor instance; the executor itself is unchanged.
    ``invariants`` defaults to what the executor's token-budget policy promises.
    """

    executor: PyExecutor
    submitted: dict[int, LlmRequest] = field(default_factory=dict)
    final: dict[int, Response] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0
    invariants: frozenset[int] | None = None
    num_budget_deferrals: int = 0
    num_capacity_deferrals: int = 0
    _before: dict[int, RequestSnapshot] = field(default_factory=dict)
    _built: dict[int, BuiltRequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        policy = self.executor.kv_cache_manager.token_budget
        if self.invariants is None:
            self.invariants = POLICY_INVARIANTS[policy.name] if policy is not None else ALL_INVARIANTS
        resources, engine = self.executor.resource_manager, self.executor.model_engine
        prepare, build = resources.prepare_resources, engine._prepare_tp_inputs
        kv = self.executor.kv_cache_manager

        def observed_prepare(scheduled: ScheduledRequests) -> None:
            self._before = {r.request_id: snapshot(r, kv) for r in scheduled.all_requests}
            prepare(scheduled)

        def observed_build(scheduled: ScheduledRequests):
            try:
                return build(scheduled)
            finally:  # also for a batch that overshoots: what it would have appended
                self._built = built(scheduled)

        resources.prepare_resources = observed_prepare
        engine._prepare_tp_inputs = observed_build

    def submit(self, request: LlmRequest) -> None:
        self.submitted[request.request_id] = request
        self.tokens[request.request_id] = []
        self.executor.enqueue_request(request, self._on_response)

    def cancel(self, request_id: int) -> None:
        self.executor.cancel_request(request_id)

    def _on_response(self, request: LlmRequest, response: Response) -> None:
        assert request.request_id not in self.final, f"response after the final one for {request!r}"
        self.tokens[request.request_id].extend(response.new_token_ids)
        if response.finished:
            self.final[request.request_id] = response

    def step(self) -> None:
        kv = self.executor.kv_cache_manager
        check = self.invariants
        before = {
            r.request_id: (r.context_current_position, r.is_context_init_state) for r in self.executor.active_requests
        }
        self._before, self._built = {}, {}
        stats = self.executor.step()
        self.steps += 1
        if 6 in check:
            kv.check_integrity()  # every step; the drain adds the leak oracle
        if 4 in check:
            self._check_nothing_lost()
        scheduled = self.executor.last_scheduled
        if stats is None or scheduled is None:
            return
        self.num_budget_deferrals += stats.num_budget_deferrals
        self.num_capacity_deferrals += stats.num_capacity_deferrals
        context = f"\niteration {stats.iteration}: {scheduled!r}"
        # the loop survives any batch failure, so a bug would only show as failed requests:
        # the one failure by design is a policy without safety overshooting
        assert stats.error is None or stats.overshoot > 0, f"batch failed: {stats.error}{context}"
        if 1 in check:
            assert stats.overshoot == 0, f"invariant 1 violated at iteration {stats.iteration}: {stats.error}"
            total = sum(b.positions for b in self._built.values())
            assert total <= self.executor.config.max_num_tokens, f"invariant 1: {total} positions{context}"
        if 2 in check:
            check_costs(self._before, self._built, context)
        if 3 in check:
            check_deferrals_clean(scheduled, self._before, kv, context)
        if 5 in check:
            self._check_progress(scheduled, before, kv)

    def _check_progress(self, scheduled: ScheduledRequests, before: dict, kv: KVCacheManager) -> None:
        tpb = kv.tokens_per_block
        for request in scheduled.context_requests:  # each chunk advances; non-last chunks end on a block boundary
            if request.is_finished and request.error:
                continue
            old_position, _ = before.get(request.request_id, (0, True))
            end = request.context_current_position if request.is_context_init_state else request.prompt_len
            assert end > old_position or end == request.prompt_len, f"no progress for {request!r}"
            if request.is_context_init_state and end % tpb:
                raise AssertionError(f"invariant 5: non-last chunk of {request!r} ends off a block boundary")
        claims_safety = kv.token_budget is not None and kv.token_budget.claims_safety
        for request in self.executor.active_requests:
            assert request.consecutive_budget_deferrals <= 1 or not claims_safety, (
                f"invariant 5: {request!r} deferred for budget {request.consecutive_budget_deferrals} times in a row"
            )

    def _check_nothing_lost(self) -> None:
        active = {r.request_id for r in self.executor.active_requests}
        for request_id, request in self.submitted.items():
            in_flight = request_id in active or any(r is request for r in self.executor._new_requests)
            finished = request_id in self.final
            assert in_flight != finished, (
                f"invariant 4: {request!r} is {'both' if in_flight else 'neither'} active and finished"
            )
            if finished:
                assert request.is_finished, f"{request!r} got a final response but is not finished"

    def drain(self, max_steps: int = 20_000, stall_steps: int = 200) -> None:
        """Step until idle; every request must end (liveness) and the pool must be clean.

        Without arrivals the simulated executor is deterministic, so ``stall_steps``
        iterations in which no request moves (no chunk, no token, nothing finished) mean it
        never will: that fails at once instead of after ``max_steps``.
        """
        last, still = None, 0
        for _ in range(max_steps):
            if not self.executor.has_work:
                break
            self.step()
            progress = self._progress()
            still = still + 1 if progress == last else 0
            last = progress
            assert still < stall_steps, (
                f"liveness: no request moved in {stall_steps} steps: {self.executor.active_requests}"
            )
        busy = self.executor.active_requests
        assert not self.executor.has_work, f"liveness: still busy after {max_steps} steps: {busy}"
        assert set(self.final) == set(self.submitted), "liveness: a request never got its final response"
        self.check_drained()

    def _progress(self) -> tuple[int, int, int]:
        active = self.executor.active_requests
        return (
            len(self.final),
            sum(r.context_current_position for r in active),
            sum(len(r.tokens) for r in active),
        )

    def check_drained(self) -> None:
        kv = self.executor.kv_cache_manager
        kv.check_integrity()
        assert not kv._sequences, f"sequences left after a drain: {list(kv._sequences)}"
        pool = kv.pool
        assert pool.num_free + pool.num_cached == pool.num_blocks, (
            f"leak: free {pool.num_free} + cached {pool.num_cached} != {pool.num_blocks}"
        )
