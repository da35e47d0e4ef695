"""The invariant checker every test uses (DESIGN.md §3).

Batch level (one ``prepare_resources`` + ``_prepare_tp_inputs``):
  1. no overshoot, 2. the cost charged before allocation bounds the positions appended,
  3. a deferred request is untouched.
Executor level (after every ``step``): 4. nothing is lost, 5. progress, 6. KV integrity.

Failures raise AssertionError with the batch printed in readable form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor, Response
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    state: object
    position: int
    chunk: int
    prepopulated: int
    block_table: tuple[int, ...] | None
    full_cost: int


def snapshot(request: LlmRequest, kv: KVCacheManager) -> RequestSnapshot:
    table = tuple(kv.block_table(request)) if kv.is_allocated(request) else None
    return RequestSnapshot(
        state=request.state,
        position=request.context_current_position,
        chunk=request.context_chunk_size,
        prepopulated=request.prepopulated_prompt_len,
        block_table=table,
        full_cost=forward_cost(request, reuse_can_shift=kv.reuse_can_shift(request)),
    )


@dataclass(slots=True)
class BatchOutcome:
    """What one batch did: the positions built, or the overshoot that stopped it."""

    scheduled: ScheduledRequests
    before: dict[int, RequestSnapshot]
    forward_tokens: int | None = None
    overshoot: TokenBudgetExceeded | None = None
    description: str = ""


def run_batch(scheduled: ScheduledRequests, kv: KVCacheManager, engine: ModelEngine) -> BatchOutcome:
    """``prepare_resources`` then ``_prepare_tp_inputs`` on one batch, recording what each step saw."""
    description = repr(scheduled)
    before = {r.request_id: snapshot(r, kv) for r in scheduled.all_requests}
    outcome = BatchOutcome(scheduled, before, description=description)
    kv.prepare_resources(scheduled)
    try:
        outcome.forward_tokens = engine._prepare_tp_inputs(scheduled).total_num_tokens
    except TokenBudgetExceeded as error:
        outcome.overshoot = error
    return outcome


def check_batch(outcome: BatchOutcome, kv: KVCacheManager, max_num_tokens: int, *, claims_safety: bool) -> None:
    """Invariants 1-3 (1 only where the policy claims safety)."""
    context = f"\nbatch as scheduled: {outcome.description}\nafter: {outcome.scheduled!r}"
    if claims_safety:
        assert outcome.overshoot is None, f"invariant 1 (no overshoot) violated: {outcome.overshoot}{context}"
        assert outcome.forward_tokens <= max_num_tokens, context
    for request in outcome.scheduled.all_requests:
        was = outcome.before[request.request_id]
        charged, appended = was.full_cost, forward_cost(request)
        assert appended <= charged, (
            f"invariant 2 (cost is an upper bound) violated for {request!r}: charged {charged}, appends {appended}"
            f"{context}"
        )
        untouched = request.prepopulated_prompt_len == was.prepopulated and request.context_chunk_size == was.chunk
        if untouched and request.is_context_init_state:
            assert appended == charged - _drafts_dropped(request, was), (
                f"invariant 2: no reuse materialised but {request!r} appends {appended} != charged {charged}{context}"
            )
    for request, _reason in outcome.scheduled.deferred_requests:
        was, now = outcome.before[request.request_id], snapshot(request, kv)
        assert (now.state, now.position, now.prepopulated, now.block_table) == (
            was.state,
            was.position,
            was.prepopulated,
            was.block_table,
        ), f"invariant 3 (clean deferral) violated for {request!r}: was {was}, now {now}{context}"
    kv.check_integrity()


def _drafts_dropped(request: LlmRequest, was: RequestSnapshot) -> int:
    """Drafts a first chunk was charged in case reuse made it the last chunk, when it did not."""
    if was.block_table is None and not request.is_last_context_chunk:
        return request.num_draft_tokens
    return 0


@dataclass(slots=True)
class ExecutorChecker:
    """Drives a :class:`PyExecutor` and checks invariants 4-6 after every step."""

    executor: PyExecutor
    submitted: dict[int, LlmRequest] = field(default_factory=dict)
    final: dict[int, Response] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0

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
        before = {
            r.request_id: (r.context_current_position, r.is_context_init_state) for r in self.executor.active_requests
        }
        stats = self.executor.step()
        self.steps += 1
        kv.check_integrity()  # invariant 6, every step
        self._check_nothing_lost()
        scheduled = self.executor.last_scheduled
        if stats is None or scheduled is None:
            return
        if kv.token_budget is not None and kv.token_budget.claims_safety:
            assert stats.overshoot == 0, f"invariant 1 violated at iteration {stats.iteration}: {stats.error}"
        tpb = kv.tokens_per_block
        for request in scheduled.context_requests:  # invariant 5: progress, block-aligned chunk ends
            if request.is_finished and request.error:
                continue
            old_position, _ = before.get(request.request_id, (0, True))
            end = request.context_current_position if request.is_context_init_state else request.prompt_len
            assert end > old_position or end == request.prompt_len, f"no progress for {request!r}"
            if request.is_context_init_state and end % tpb:
                raise AssertionError(f"invariant 5: non-last chunk of {request!r} ends off a block boundary")
        for request in self.executor.active_requests:
            assert request.consecutive_budget_deferrals <= 1 or not kv.token_budget.claims_safety, (
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

    def drain(self, max_steps: int = 20_000) -> None:
        """Step until idle; every request must end (liveness) and the pool must be clean."""
        for _ in range(max_steps):
            if not self.executor.has_work:
                break
            self.step()
        assert not self.executor.has_work, f"liveness: still busy after {max_steps} steps: {self.executor.active_requests}"
        assert set(self.final) == set(self.submitted), "liveness: a request never got its final response"
        self.check_drained()

    def check_drained(self) -> None:
        kv = self.executor.kv_cache_manager
        kv.check_integrity()
        assert not kv._sequences, f"sequences left after a drain: {list(kv._sequences)}"
        pool = kv.pool
        assert pool.num_free + pool.num_cached == pool.num_blocks, (
            f"leak: free {pool.num_free} + cached {pool.num_cached} != {pool.num_blocks}"
        )
