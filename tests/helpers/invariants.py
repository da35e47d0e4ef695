"""The invariant checker every test uses (DESIGN.md §3).

Batch level (one ``prepare_resources`` + ``_prepare_tp_inputs``, :func:`run_batch` then
:func:`check_batch`): 1. no overshoot, 2. the full forward cost computed before allocation
bounds the positions appended (equal when no reuse materialises and nothing was cut), 3. a
deferred request is untouched and no block leaks.
Executor level (:class:`ExecutorChecker`, after every ``step``): the same 1-3 on the batch
the step returned, 4. nothing is lost, 5. progress, 6. KV integrity; at a drain, liveness
and the leak oracle.

Everything is read from values: the batch the scheduler built, the ``PreparedBatch`` that
``prepare_resources`` returned (the batch that ran, the deferrals, the claims), and
snapshots of the requests taken before the iteration. ``_prepare_tp_inputs`` asserts that
each request appends exactly its :func:`forward_cost`, so the positions of the batch that
ran are its chunks' and steps' costs.

Failures raise AssertionError with the batch printed in readable form (:func:`format_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.engine.inputs import prepare_tp_inputs
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import ModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import Iteration, PyExecutor, Response
from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch, ResourceManager
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests

ALL_INVARIANTS = frozenset(range(1, 7))
#: What each policy promises. ``none`` and ``fit`` do not claim safety (1). ``trim`` shrinks
#: chunks by arbitrary token counts (5: chunk ends off block boundaries) and defers requests
#: after their blocks were claimed (3) — defects of the closed proposal, not checked for it.
POLICY_INVARIANTS: dict[TokenBudgetPolicyName, frozenset[int]] = {
    TokenBudgetPolicyName.RECHECK: ALL_INVARIANTS,
    TokenBudgetPolicyName.CLAIM: ALL_INVARIANTS,
    TokenBudgetPolicyName.FIT: ALL_INVARIANTS - {1},
    TokenBudgetPolicyName.NONE: ALL_INVARIANTS - {1},
    TokenBudgetPolicyName.TRIM: frozenset({2, 4, 6}),
}


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """A request before an iteration: what invariant 3 compares a deferred request with."""

    state: object
    position: int
    prepopulated: int
    block_table: tuple[int, ...] | None
    budget_deferred: bool = False  # entered the iteration owing a budget deferral
    text: str = ""  # repr at snapshot time

    @property
    def allocated(self) -> bool:
        return self.block_table is not None


def snapshot(request: LlmRequest, kv: KVCacheManager) -> RequestSnapshot:
    table = tuple(kv.block_table(request)) if kv.is_allocated(request) else None
    return RequestSnapshot(
        state=request.state,
        position=request.context_current_position,
        prepopulated=request.prepopulated_prompt_len,
        block_table=table,
        budget_deferred=request.py_budget_deferred,
        text=repr(request),
    )


@dataclass(frozen=True, slots=True)
class Charged:
    """A scheduled request's full forward cost before allocation (reuse not discounted)."""

    full_cost: int
    chunk: ContextChunk | None  # as scheduled; None for a generation step
    reuse_can_shift: bool  # the bound counts drafts in case reuse makes the chunk the last one


def full_costs(scheduled: ScheduledRequests, kv: KVCacheManager) -> dict[int, Charged]:
    """Every scheduled request's pre-allocation bound; call before ``prepare_resources``."""
    costs = {}
    for chunk in scheduled.context_chunks:
        can_shift = kv.prefix.can_shift(chunk.request)
        costs[chunk.request.request_id] = Charged(chunk.cost(reuse_can_shift=can_shift), chunk, can_shift)
    for request in scheduled.generation_requests:
        costs[request.request_id] = Charged(forward_cost(request), None, False)
    return costs


def positions(batch: ScheduledRequests) -> dict[int, int]:
    """Positions each request of the batch that ran appends (``_prepare_tp_inputs`` asserts this count)."""
    built = {chunk.request.request_id: chunk.cost() for chunk in batch.context_chunks}
    built.update((r.request_id, forward_cost(r)) for r in batch.generation_requests)
    return built


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
    """What one batch did: as scheduled, as prepared, and the positions built or the overshoot."""

    scheduled: ScheduledRequests
    prepared: PreparedBatch
    before: dict[int, RequestSnapshot]
    charged: dict[int, Charged]
    forward_tokens: int | None = None
    overshoot: TokenBudgetExceeded | None = None
    max_num_tokens: int = 0
    kv_before: str = ""
    policy: str = ""
    built: dict[int, int] = field(default_factory=dict)  # request id -> positions appended
    output: object = None  # the engine's ForwardOutput, when the engine ran the batch (run_batch(forward=True))

    @property
    def total_tokens(self) -> int:
        """Positions the forward carried (or would have carried, for a batch that overshot)."""
        return self.overshoot.total_num_tokens if self.overshoot is not None else (self.forward_tokens or 0)

    @property
    def overshoot_tokens(self) -> int:
        return max(0, self.total_tokens - self.max_num_tokens)

    @property
    def deferred(self) -> list[tuple[LlmRequest, DeferReason]]:
        return [(d.request, d.reason) for d in self.prepared.deferred]


def run_batch(
    scheduled: ScheduledRequests, resources: ResourceManager, engine: ModelEngine, *, forward: bool = False
) -> BatchOutcome:
    """``prepare_resources`` then ``_prepare_tp_inputs`` on one batch, recording what each step saw.
    ``forward``: the engine runs the batch (``_prepare_tp_inputs``, then its model) and the outcome
    keeps what it returned (:func:`check_engine_output`)."""
    kv = resources.kv_cache_manager
    outcome = BatchOutcome(
        scheduled,
        prepared=None,
        before={r.request_id: snapshot(r, kv) for r in scheduled.all_requests},
        charged=full_costs(scheduled, kv),
        max_num_tokens=engine.max_num_tokens,
        kv_before=describe_kv(kv),
        policy=resources.token_budget.name.value,
    )
    outcome.prepared = resources.prepare_resources(scheduled)
    batch = outcome.prepared.scheduled
    try:
        if forward and not batch.is_empty:
            outcome.output = engine.forward(batch)
            outcome.forward_tokens = outcome.output.num_tokens
        else:
            outcome.forward_tokens = prepare_tp_inputs(batch, kv, engine.max_num_tokens).total_num_tokens
    except TokenBudgetExceeded as error:
        outcome.overshoot = error
    outcome.built = positions(outcome.prepared.scheduled)
    return outcome


def format_batch(outcome: BatchOutcome) -> str:
    """The batch as a person reads it: the pool, each request as scheduled and as it ran, the total."""
    claims = {c.request_id: c for c in outcome.prepared.claims}
    deferred = {d.request.request_id: d.reason.value for d in outcome.prepared.deferred}
    ran = {c.request.request_id: c for c in outcome.prepared.scheduled.context_chunks}
    lines = [f"{outcome.kv_before}", f"policy {outcome.policy}, max_num_tokens={outcome.max_num_tokens}"]
    for request_id, was in outcome.before.items():
        charged = outcome.charged[request_id]
        charge = outcome.scheduled.charges.get(request_id)
        what = f"{charged.chunk!r}" if charged.chunk is not None else "step"
        line = (
            f"  {was.text:<46} {what:<34} charged {charge if charge is not None else '-':>4}"
            f"  full cost {charged.full_cost:>4}"
        )
        if request_id in deferred:
            line += f"  -> deferred ({deferred[request_id]})"
        elif request_id in outcome.built:
            claim = claims.get(request_id)
            reuse = f", reused {claim.reused_tokens} of est {claim.estimated_reusable_tokens}" if claim else ""
            now = ran.get(request_id)
            window = f" as {now!r}" if now is not None and now != charged.chunk else ""
            line += f"  -> appends {outcome.built[request_id]}{window}{reuse}"
        lines.append(line)
    verdict = f"overshoot +{outcome.overshoot_tokens}" if outcome.overshoot_tokens else f"fits ({outcome.total_tokens})"
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
    context = f"\n{format_batch(outcome)}\nbatch as scheduled: {outcome.scheduled!r}"
    if claims_safety:
        assert outcome.overshoot is None, f"invariant 1 (no overshoot) violated: {outcome.overshoot}{context}"
        assert outcome.forward_tokens <= max_num_tokens, context
    check_costs(outcome.charged, outcome.built, outcome.prepared, context)
    if check_deferrals:
        check_deferrals_clean(outcome.prepared, outcome.before, kv, context)
    kv.check_integrity()


def check_engine_output(outcome: BatchOutcome) -> None:
    """What the engine returned for the batch it ran: a logits row for every request that samples,
    every beam's row for a beam-search request in generation, a pick after every draft verified."""
    output, batch = outcome.output, outcome.prepared.scheduled
    if output is None:
        assert outcome.overshoot is not None or batch.is_empty, "the engine did not run the batch"
        return
    context = f"\n{format_batch(outcome)}"
    assert output.num_tokens == outcome.forward_tokens == sum(outcome.built.values()), context
    sampling = [c.request for c in batch.context_chunks if c.is_last] + list(batch.generation_requests)
    assert set(output.logits) == {r.request_id for r in sampling}, f"a sampling row is missing{context}"
    vocab = next(iter(output.logits.values())).shape[-1] if output.logits else 0
    beams = {r.request_id: r.beam_width for r in batch.generation_requests if r.beam_width > 1}
    assert {rid: tuple(rows.shape) for rid, rows in (output.beam_logits or {}).items()} == {
        rid: (width, vocab) for rid, width in beams.items()}, f"beam rows are not one per beam{context}"
    drafts = {r.request_id: len(r.py_draft_tokens) for r in sampling if r.py_draft_tokens}
    verified = {rid: len(picks) - 1 for rid, picks in (output.draft_targets or {}).items()}
    assert verified == drafts, f"draft picks {verified} != drafts {drafts}{context}"


def check_costs(
    charged: dict[int, Charged], built: dict[int, int], prepared: PreparedBatch, context: str = ""
) -> None:
    """Invariant 2 for every request that reached ``_prepare_tp_inputs``: its positions
    (``built``) are at most its full cost before allocation, and equal to it when its chunk
    ran as scheduled."""
    batch = prepared.scheduled
    for request_id, appended in built.items():
        bound = charged[request_id]
        assert appended <= bound.full_cost, (
            f"invariant 2 (cost is an upper bound) violated for request {request_id}: charged {bound.full_cost},"
            f" appends {appended}{context}"
        )
    for chunk in batch.context_chunks:
        bound = charged[chunk.request.request_id]
        if chunk == bound.chunk:  # no reuse shifted it, nothing cut it: the bound is exact
            dropped = len(chunk.request.py_draft_tokens) if bound.reuse_can_shift and not chunk.is_last else 0
            assert chunk.cost() == bound.full_cost - dropped, (
                f"invariant 2: no reuse materialised but {chunk!r} appends {chunk.cost()} != charged"
                f" {bound.full_cost}{context}"
            )
    if prepared.budget is not None:  # what the re-check charged each chunk it admitted also bounds it
        for chunk in batch.context_chunks:
            admitted = prepared.budget.chunks[chunk.request.request_id]
            can_shift = charged[chunk.request.request_id].reuse_can_shift and not admitted.reused
            assert chunk.cost() <= admitted.cost(reuse_can_shift=can_shift), (
                f"invariant 2: {chunk!r} appends more than the re-check charged for {admitted!r}{context}"
            )


def check_deferrals_clean(
    prepared: PreparedBatch, before: dict[int, RequestSnapshot], kv: KVCacheManager, context: str = "",
    completed: frozenset[int] = frozenset(),
) -> None:
    """Invariant 3: a deferred request holds what it held, where it was (the caller checks leaks).

    ``completed``: requests whose previous forward completed during the step (overlap). That
    completion may finish one, or commit a block it filled to the prefix tree, where an
    identical cached block can take its place: for those, the same number of blocks; or fewer,
    where the completion released blocks that held only rejected drafts (``SequenceBlocks._trim``),
    but never fewer than its tokens need."""
    for deferral in prepared.deferred:
        request = deferral.request
        was, now = before[request.request_id], snapshot(request, kv)
        if request.request_id in completed:
            if request.is_finished:
                continue
            held, had = len(now.block_table or ()), len(was.block_table or ())
            needed = -(-len(request.tokens) // kv.tokens_per_block)
            drafted = request.max_draft_len or request.py_draft_tokens
            assert (now.state, now.position, now.prepopulated) == (was.state, was.position, was.prepopulated) and (
                held == had or (drafted and needed <= held < had)
            ), f"invariant 3 (clean deferral) violated for {request!r}: was {was}, now {now}{context}"
            continue
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
    for deferral in outcome.prepared.deferred:
        if deferral.reason is DeferReason.BUDGET and outcome.before[deferral.request.request_id].budget_deferred:
            raise AssertionError(
                f"invariant 5: {deferral.request!r} was budget-deferred twice in a row\n{format_batch(outcome)}"
            )


def check_priority_recheck(decision, first_chunks, later_chunks, rank, *, reuse_can_shift: bool = False) -> None:
    """The re-check's rules under priority (``recheck_by_priority``), on its decision values:
    the admitted chunks fit the budget; a request that owed a deferral is admitted; and no
    request is deferred while one ranked below it runs uncut, unless that one owed a deferral
    (it runs at most what was set aside for it: it is cut, or its chunk was no larger)."""
    scheduled = {c.request.request_id: (c, False) for c in later_chunks}
    scheduled.update({c.request.request_id: (c, reuse_can_shift) for c in first_chunks})
    total = 0
    for rid, chunk in decision.chunks.items():
        original, shift = scheduled[rid]
        assert chunk.start == original.start and 0 < chunk.size <= original.size, f"{chunk!r} from {original!r}"
        total += chunk.cost(reuse_can_shift=shift)
    assert total + sum(map(forward_cost, decision.generation)) <= decision.max_num_tokens, (
        f"re-check admitted {total} positions over {decision.max_num_tokens}: {decision}")
    deferred = [request for request, _ in decision.deferred]
    for request in deferred:
        assert not request.py_budget_deferred, f"{request!r} owed a deferral and was deferred again"
    for request in deferred:
        for rid, chunk in decision.chunks.items():
            original, _ = scheduled[rid]
            if rank(original.request) > rank(request) and chunk == original and not original.request.py_budget_deferred:
                raise AssertionError(
                    f"{request!r} (priority {request.priority}) was deferred while {original!r}"
                    f" (priority {original.request.priority}), ranked below it, ran uncut")


def check_priority_order(before: dict[int, "PrioritySnapshot"], iteration: Iteration, order, *,
                         cooldown: int | None, ended: frozenset[int] = frozenset()) -> None:
    """The independent oracle over one iteration's decision values (``waiting_queue_policy=priority``).

    ``before``: every open request as it was before the step. Ranks are recomputed here from
    effective priorities (``priority + rate * (now - arrival)`` at a common ``now``), not from
    the scheduler's key. A context request passed over (not in the batch that runs, or deferred)
    while one ranked below it runs is a violation, except where the difference is memory, not
    order: the one that ran held KV blocks and the other did not (admission is for memory), or
    the one passed over was capacity-deferred or paused; or the one that ran owed a budget
    deferral. ``ended``: requests that ended during the step (refused, cancelled, failed): they
    are not passed over. Every preemption pauses a request of strictly lower priority and lower effective
    priority than the one it was paused for, outside its cooldown."""
    now = max((s.arrival for s in before.values()), default=0.0) + 1.0

    def ahead(a: "PrioritySnapshot", b: "PrioritySnapshot") -> bool:
        ea = a.priority + order.aging_rate * (now - a.arrival)
        eb = b.priority + order.aging_rate * (now - b.arrival)
        if abs(ea - eb) > 1e-9:
            return ea > eb
        return (a.arrival, a.request_id) < (b.arrival, b.request_id)

    prepared = iteration.prepared
    ran = {c.request.request_id for c in prepared.scheduled.context_chunks}
    excused = {d.request.request_id for d in prepared.deferred if d.reason is DeferReason.CAPACITY}
    excused |= {r.request_id for r in iteration.scheduled.paused_requests}
    excused |= ended
    contexts = [s for s in before.values() if s.context]
    for passed in contexts:
        if passed.request_id in ran or passed.request_id in excused:
            continue
        for runner in contexts:
            if runner.request_id not in ran or not ahead(passed, runner):
                continue
            if runner.owed_deferral or (runner.allocated and not passed.allocated):
                continue
            raise AssertionError(
                f"iteration {iteration.launch.iteration}: request {passed.request_id} (priority {passed.priority},"
                f" arrived {passed.arrival}) was passed over for request {runner.request_id} (priority"
                f" {runner.priority}, arrived {runner.arrival}); batch {iteration.batch!r}")
    for victim_id, waiter_id in iteration.scheduled.preempted_for.items():
        victim, waiter = before[victim_id], before[waiter_id]
        assert victim.priority < waiter.priority and ahead(waiter, victim), (
            f"request {victim_id} (priority {victim.priority}) preempted for {waiter_id} (priority {waiter.priority})")
        assert cooldown is not None, "a preemption with preemption off"
        assert victim.resumed_iteration < 0 or iteration.launch.iteration - victim.resumed_iteration >= cooldown, (
            f"request {victim_id} preempted again {iteration.launch.iteration - victim.resumed_iteration} iterations"
            f" after it resumed (cooldown {cooldown})")


@dataclass(frozen=True, slots=True)
class PrioritySnapshot:
    request_id: int
    priority: float
    arrival: float
    context: bool
    allocated: bool
    owed_deferral: bool
    resumed_iteration: int


def priority_snapshot(request: LlmRequest, kv: KVCacheManager) -> PrioritySnapshot:
    return PrioritySnapshot(request.request_id, request.priority, request.arrival_time, request.is_context_init_state,
                            kv.is_allocated(request), request.py_budget_deferred, request.counters.resumed_iteration)


@dataclass(slots=True)
class ExecutorChecker:
    """Drives a :class:`PyExecutor` and checks invariants after every step.

    It snapshots every submitted, unfinished request before a step and reads the rest from
    the :class:`Iteration` the step returns; the executor itself is not touched. With a drafter,
    it also notes which requests the drafter leaves due for a padded first draft each step (the
    drafter drops a due first draft in an iteration without drafts: ``max_concurrency``).
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
    iterations: list[Iteration] = field(default_factory=list)

    _first_drafts: set[int] | None = None  # as the drafter left them this step (None: no drafter ran)

    def __post_init__(self) -> None:
        policy = self.executor.resource_manager.token_budget
        if self.invariants is None:
            self.invariants = POLICY_INVARIANTS[policy.name]
        drafter = self.executor.drafter
        if drafter is not None:  # observe its decision: it calls through, unchanged
            prepare = drafter.prepare_draft_tokens

            def observed(requests, **kwargs):
                requests = list(requests)
                prepare(requests, **kwargs)
                self._first_drafts = {r.request_id for r in requests if r.is_first_draft}

            drafter.prepare_draft_tokens = observed

    @property
    def claims_safety(self) -> bool:
        return self.executor.resource_manager.token_budget.claims_safety

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

    def step(self) -> Iteration | None:
        kv = self.executor.kv_cache_manager
        check = self.invariants
        open_requests = [r for rid, r in self.submitted.items() if rid not in self.final]
        before = {r.request_id: snapshot(r, kv) for r in open_requests}
        can_shift = {r.request_id: kv.prefix.can_shift(r) for r in open_requests}
        # A generation step's cost is read after the step, from the drafts that ran (the drafter
        # proposes them inside the step, and they stay until the next step's drafter), except
        # first-draft padding, which the step clears: whether a request was first-draft is taken now.
        first_draft = {r.request_id for r in open_requests if r.is_first_draft}
        self._first_drafts = None
        completed = self.executor.in_flight_request_ids  # overlap: its forward completes during this step
        iteration = self.executor.step()
        if self._first_drafts is not None:  # the drafter ran: a first draft it dropped ran plain
            first_draft &= self._first_drafts
        step_cost = {
            r.request_id: 1 + r.max_draft_len if r.request_id in first_draft else forward_cost(r)
            for r in open_requests if not r.is_context_init_state
        }
        self.steps += 1
        if 6 in check:
            kv.check_integrity()  # every step; the drain adds the leak oracle
        if 4 in check:
            self._check_nothing_lost()
        if iteration is None:
            return None
        self.iterations.append(iteration)
        # What the iteration decided and measured at launch: under overlap its statistics
        # are made a step later, when its forward completes.
        launch, prepared = iteration.launch, iteration.prepared
        context = f"\niteration {launch.iteration}: {iteration.scheduled!r} -> {iteration.batch!r}"
        # the loop survives any batch failure, so a bug would only show as failed requests:
        # the one failure by design is a policy without safety overshooting
        assert iteration.error is None or launch.overshoot > 0, f"batch failed: {iteration.error}{context}"
        assert prepared is not None, context
        budget = sum(d.reason is DeferReason.BUDGET for d in prepared.deferred)
        self.num_budget_deferrals += budget
        self.num_capacity_deferrals += len(prepared.deferred) - budget
        # A chunk's cost depends only on its window, its prompt and its drafts: it can be
        # taken now, although the requests that ran have moved on.
        built = {chunk.request.request_id: chunk.cost() for chunk in prepared.scheduled.context_chunks}
        built.update((r.request_id, step_cost[r.request_id]) for r in prepared.scheduled.generation_requests)
        if 1 in check:
            assert launch.overshoot == 0, f"invariant 1 violated at iteration {launch.iteration}: {iteration.error}"
            total = sum(built.values())
            assert total <= self.executor.config.max_num_tokens, f"invariant 1: {total} positions{context}"
        if 2 in check:
            charged = {}
            for chunk in iteration.scheduled.context_chunks:
                shift = can_shift[chunk.request.request_id]
                charged[chunk.request.request_id] = Charged(chunk.cost(reuse_can_shift=shift), chunk, shift)
            for request in iteration.scheduled.generation_requests:
                charged[request.request_id] = Charged(step_cost[request.request_id], None, False)
            check_costs(charged, built, prepared, context)
        if 3 in check:
            check_deferrals_clean(prepared, before, kv, context, completed)
        if 5 in check:
            self._check_progress(iteration, before, kv)
        return iteration

    def _check_progress(self, iteration: Iteration, before: dict[int, RequestSnapshot], kv: KVCacheManager) -> None:
        tpb = kv.tokens_per_block
        for chunk in iteration.batch.context_chunks:  # each chunk advances; non-last chunks end on a block boundary
            request = chunk.request
            if request.is_finished and request.error:
                continue
            assert chunk.size > 0 and chunk.end > before[request.request_id].position, f"no progress for {chunk!r}"
            if not chunk.is_last and chunk.end % tpb:
                raise AssertionError(f"invariant 5: non-last chunk {chunk!r} ends off a block boundary")
        if self.claims_safety:
            for request in self.executor.active_requests:
                assert request.counters.consecutive_budget_deferrals <= 1, (
                    f"invariant 5: {request!r} deferred for budget {request.counters.consecutive_budget_deferrals} times in a row"
                )

    def _check_nothing_lost(self) -> None:
        active = {r.request_id for r in self.executor.active_requests}
        for request_id, request in self.submitted.items():
            in_flight = request_id in active  # (the step fetched everything queued before it)
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
        held = [r for r in self.submitted.values() if kv.is_allocated(r)]
        assert not held, f"requests still holding blocks after a drain: {held}"
        pool = kv.pool
        assert pool.num_free + pool.num_cached == pool.num_blocks, (
            f"leak: free {pool.num_free} + cached {pool.num_cached} != {pool.num_blocks}"
        )
