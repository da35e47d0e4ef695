"""Scenarios and the jobs that run them on a rank group, plus the single-rank reference.

A :class:`Scenario` is plain data (an executor config, a model config or None for the
simulated engine, and arrivals keyed by iteration), so it pickles to the ranks unchanged
and a shrunk hypothesis example rebuilds the same run. :func:`run_scenario` runs on every
rank of a group (rank 0 submits, everyone steps); :func:`run_reference` runs the same
scenario on one ordinary executor in the test process. Both drive their executor with the
same loop: at iteration ``i`` the arrivals of ``i`` are submitted and the cancellations of
``i`` sent, then one step; so the two see the same requests at the same iterations.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from tests.helpers.factories import KV_BYTES_PER_TOKEN, VOCAB

from tensorrt_llm._torch.distributed.digest import decision_records, digest
from tensorrt_llm._torch.distributed.launcher import RankContext
from tensorrt_llm._torch.distributed.rank_executor import RankExecutor
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor, Response
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tensorrt_llm.mapping import Mapping

MAX_ITERATIONS = 3000  # far beyond any scenario here: a run that needs more is stuck
#: Every collective (control exchanges and the model's) fails after this long instead of hanging.
COLLECTIVE_TIMEOUT_S = 30.0
#: A job (one example on every rank) that takes longer kills the group.
JOB_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Arrival:
    iteration: int
    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    cancel_at: int | None = None  # iteration at which it is cancelled, if any


@dataclass(frozen=True, slots=True)
class Scenario:
    config: ExecutorConfig  # its host_cache_size is ignored: see host_blocks
    arrivals: tuple[Arrival, ...]
    model: LlamaConfig | None = None  # None: the simulated engine (synthetic tokens)
    host_blocks: int = 0  # host tier in blocks, whatever a block's bytes on a rank (a TP shard's are fewer)

    @property
    def last_event(self) -> int:
        return max([a.iteration for a in self.arrivals] + [a.cancel_at or 0 for a in self.arrivals])


@dataclass(slots=True)
class Outcome:
    """What one executor (one rank, or the reference) produced."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    final: dict[int, str | None] = field(default_factory=dict)  # finished: error, "cancelled" or None
    local: dict | None = None  # attention DP: the outputs of the requests this rank ran
    decision_digests: list[int] = field(default_factory=list)
    max_forward_tokens: int = 0
    overshoots: int = 0
    iterations: int = 0
    busy_iterations: int = 0
    forward_tokens: int = 0
    deferrals: int = 0
    capacity_deferrals: int = 0
    reused_tokens: int = 0
    # reference only: (request id, still in context) of every active request before each step
    active_before_step: list[tuple[tuple[int, bool], ...]] = field(default_factory=list)
    agreement_cost: dict | None = None
    wall_s: float = 0.0

    def record(self, request: LlmRequest, response: Response) -> None:
        assert response.request_id not in self.final, f"a response after the final one: {response}"
        self.tokens.setdefault(response.request_id, []).extend(response.new_token_ids)
        if response.finished:
            self.final[response.request_id] = response.error or ("cancelled" if response.cancelled else None)

    @property
    def outputs(self) -> dict[int, tuple[tuple[int, ...], str | None]]:
        """id -> (tokens, how it ended), for every request that got a response."""
        return {rid: (tuple(tokens), self.final.get(rid, "unfinished")) for rid, tokens in self.tokens.items()}

    def add(self, stats) -> None:
        self.iterations += 1
        if stats is None:
            return
        self.max_forward_tokens = max(self.max_forward_tokens, stats.forward_tokens)
        self.overshoots += stats.overshoot > 0
        self.busy_iterations += stats.forward_tokens > 0
        self.forward_tokens += stats.forward_tokens
        self.deferrals += stats.num_budget_deferrals
        self.capacity_deferrals += stats.num_capacity_deferrals
        self.reused_tokens += stats.reuse_claimed_tokens


def _with_host_bytes(config: ExecutorConfig, host_blocks: int, bytes_per_block: int) -> ExecutorConfig:
    kv = dataclasses.replace(config.kv_cache_config, host_cache_size=host_blocks * bytes_per_block)
    return dataclasses.replace(config, kv_cache_config=kv)


def build_executor(scenario: Scenario, mapping: Mapping | None = None) -> PyExecutor:
    """The executor one rank (or the reference) runs: the sharded model under TP.

    The host tier holds ``scenario.host_blocks`` blocks on every rank and in the reference, so
    that the ranks' KV decisions can be compared with the single rank's one for one."""
    config = scenario.config
    tpb = config.kv_cache_config.tokens_per_block
    if scenario.model is not None:
        model = LlamaForCausalLM(scenario.model, mapping)
        block = KVCacheStorage.bytes_per_block(scenario.model.num_layers, model.kv_cache_shape(1, tpb)[1:],
                                               scenario.model.torch_dtype)
        return create_py_executor(_with_host_bytes(config, scenario.host_blocks, block), model=model)
    config = _with_host_bytes(config, scenario.host_blocks, tpb * KV_BYTES_PER_TOKEN)

    def engine(kv):
        return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB)

    return create_py_executor(
        config, engine_factory=engine, sampler=SyntheticSampler(VOCAB), kv_bytes_per_token=KV_BYTES_PER_TOKEN
    )


class DecisionLog:
    """A resource manager that only records each iteration's decision digest (for the reference)."""

    def __init__(self, kv) -> None:
        self.kv, self.digests = kv, []

    def prepare_resources(self, prepared) -> None:
        self.digests.append(digest(decision_records(prepared, self.kv)))

    def update_resources(self, scheduled) -> None:
        pass

    def free_resources(self, request, *, store_for_reuse: bool = True) -> None:
        pass


def _requests_at(scenario: Scenario) -> tuple[dict[int, list[Arrival]], dict[int, list[int]]]:
    arrivals: dict[int, list[Arrival]] = {}
    cancels: dict[int, list[int]] = {}
    for a in scenario.arrivals:
        arrivals.setdefault(a.iteration, []).append(a)
        if a.cancel_at is not None:
            cancels.setdefault(a.cancel_at, []).append(a.request_id)
    return arrivals, cancels


def _request(a: Arrival) -> LlmRequest:
    return LlmRequest(input_token_ids=list(a.prompt), max_new_tokens=a.max_new_tokens, request_id=a.request_id)


def run_reference(scenario: Scenario) -> Outcome:
    """The scenario on one ordinary executor, stepped by the same loop as the ranks."""
    started = time.perf_counter()
    executor = build_executor(scenario)
    log = DecisionLog(executor.kv_cache_manager)
    executor.resource_manager.add_resource_manager("decision_log", log)
    outcome = Outcome()
    arrivals, cancels = _requests_at(scenario)
    for iteration in range(MAX_ITERATIONS):
        if iteration > scenario.last_event and not executor.has_work:
            break
        for a in arrivals.get(iteration, ()):
            executor.enqueue_request(_request(a), outcome.record)
        for request_id in cancels.get(iteration, ()):
            executor.cancel_request(request_id)
        # what a plant hook on a rank sees: requests admitted before this iteration
        outcome.active_before_step.append(tuple((r.request_id, r.is_context_init_state) for r in executor.active_requests))
        step = executor.step()
        outcome.add(step.stats if step is not None else None)
    else:
        raise AssertionError(f"reference still busy after {MAX_ITERATIONS} iterations")
    outcome.decision_digests = log.digests
    executor.kv_cache_manager.check_integrity()
    outcome.wall_s = time.perf_counter() - started
    return outcome


def run_scenario(ctx: RankContext, scenario: Scenario, attention_dp: bool = False, check: bool = True,
                 plant=None, plant_rank: int | None = None) -> Outcome:
    """Rank job: the scenario on every rank of the group, rank 0 submitting.

    Returns this rank's outcome: rank 0's ``outputs`` are what the submitter received; under
    attention DP every rank also records the requests it ran itself (``local``)."""
    started = time.perf_counter()
    mapping = ctx.mapping(enable_attention_dp=attention_dp)
    executor = build_executor(scenario, mapping)
    local = Outcome()
    rank_executor = RankExecutor(
        executor, ctx.comm, mapping, check_decisions=check, forward_responses=attention_dp,
        on_local_response=local.record, plant=plant if plant_rank == ctx.rank else None,
    )
    if rank_executor.agreement is not None:
        rank_executor.agreement.decision_log = []
    received = Outcome()
    arrivals, cancels = _requests_at(scenario)
    for _ in range(MAX_ITERATIONS):
        iteration = rank_executor.iteration
        if ctx.rank == 0:
            for a in arrivals.get(iteration, ()):
                rank_executor.submit(_request(a), received.record)
            for request_id in cancels.get(iteration, ()):
                rank_executor.cancel(request_id)
            if iteration > scenario.last_event and len(received.final) == len(scenario.arrivals):
                rank_executor.request_stop()
        step = rank_executor.step()
        if step.stopped:
            break
        local.add(step.stats)
        _check_rank_step(executor, step.stats, scenario.config)
    else:
        raise AssertionError(f"rank {ctx.rank}: still running after {MAX_ITERATIONS} iterations")
    executor.kv_cache_manager.check_integrity()
    assert not executor.active_requests, f"rank {ctx.rank}: requests left after the stop: {executor.active_requests}"
    outcome = received if ctx.rank == 0 else Outcome()
    outcome.decision_digests = list(rank_executor.agreement.decision_log or []) if rank_executor.agreement else []
    outcome.max_forward_tokens, outcome.overshoots = local.max_forward_tokens, local.overshoots
    outcome.iterations, outcome.busy_iterations = local.iterations, local.busy_iterations
    outcome.forward_tokens, outcome.deferrals = local.forward_tokens, local.deferrals
    outcome.capacity_deferrals, outcome.reused_tokens = local.capacity_deferrals, local.reused_tokens
    outcome.agreement_cost = rank_executor.agreement.cost.per_iteration_us() if rank_executor.agreement else None
    outcome.wall_s = time.perf_counter() - started
    outcome.local = local.outputs
    return outcome


def _check_rank_step(executor: PyExecutor, stats, config: ExecutorConfig) -> None:
    """Per-rank invariants after every step: the KV pool is consistent, the forward fits the budget
    (for the policies that promise it)."""
    executor.kv_cache_manager.check_integrity()
    if stats is not None and config.token_budget_policy.value in ("recheck", "claim"):
        assert stats.forward_tokens <= config.max_num_tokens and not stats.overshoot, (
            f"iteration {stats.iteration}: {stats.forward_tokens} forward tokens > {config.max_num_tokens}"
        )


# ---- planted faults (test-only hooks, run on one rank right before a step) --------------


@dataclass(frozen=True, slots=True)
class ReverseActiveRequests:
    """Set-order nondeterminism: this rank sees its active requests in another order."""

    at: int

    def __call__(self, executor: PyExecutor, iteration: int) -> None:
        if iteration == self.at:
            executor.active_requests.reverse()


@dataclass(frozen=True, slots=True)
class ShrinkRecheckBudget:
    """Rank-local config drift: this rank's re-check defers what the others admit."""

    at: int

    def __call__(self, executor: PyExecutor, iteration: int) -> None:
        if iteration == self.at:
            executor.resource_manager.token_budget.max_num_tokens = 1


@dataclass(frozen=True, slots=True)
class CorruptNewestToken:
    """A sampling divergence: this rank's newest token of a generating request differs."""

    at: int

    def __call__(self, executor: PyExecutor, iteration: int) -> None:
        if iteration == self.at:
            request = next(r for r in executor.active_requests if not r.is_context_init_state)
            request.tokens[-1] = (request.tokens[-1] + 1) % 512


@dataclass(frozen=True, slots=True)
class RaiseInForward:
    """This rank's last MLP raises mid-forward, while its peers wait in that MLP's all-reduce."""

    at: int

    def __call__(self, executor: PyExecutor, iteration: int) -> None:
        if iteration == self.at:
            def fail(*args, **kwargs):
                raise RuntimeError(f"planted failure in the forward of iteration {iteration}")

            executor.model_engine.model.model.layers[-1].mlp.forward = fail


@dataclass(frozen=True, slots=True)
class RaiseBeforeStep:
    """This rank raises between two exchanges, outside the executor."""

    at: int

    def __call__(self, executor: PyExecutor, iteration: int) -> None:
        if iteration == self.at:
            raise ValueError(f"planted failure before the step of iteration {iteration}")


def tp_logits(ctx: RankContext, model: LlamaConfig, prompt: tuple[int, ...]):
    """Rank job: full-sequence logits of the sharded model (every rank gets all of them)."""
    import torch

    with torch.inference_mode():
        return LlamaForCausalLM(model, ctx.mapping()).forward_full(torch.tensor(prompt))
