"""Replay a trace on several ranks: tensor parallel or attention data parallel, sim engine.

The machinery behind ``python -m benchmarks.replay --tp-size N`` and ``--attention-dp N``
(``python -m benchmarks.replay.ranks ARGS`` is an alias of ``python -m benchmarks.replay ARGS``).

One process per rank (``torch.multiprocessing`` spawn, gloo on 127.0.0.1) runs a
:class:`RankExecutor` over the simulated engine: the real scheduler, re-check and KV
manager on every rank, forward times from the cost model on a virtual clock. Rank 0
injects the trace's arrivals and broadcasts them, exactly as it would serve them:

* ``--tp-size N``: every rank runs every request; a forward costs a TP rank's share
  (``benchmarks.replay.tp_cost_model``: the work divided by N, plus the all-reduces);
* ``--attention-dp N``: new requests are spread over the ranks (fewest active requests,
  then most free KV blocks); each rank has its own ``max_num_tokens`` and its own KV pool
  of ``--kv-blocks`` blocks, and an iteration ends when the slowest rank's forward does
  (the ranks' virtual clocks are synchronised at every iteration).

Per policy the result holds the §5 keys for the whole group, a ``ranks`` list (one entry
per rank: its §5 keys, its requests and its share of the group's work) and the balance
between ranks. ``none`` stops the whole group at the iteration after the first overshoot on
any rank, with ``crashed: true`` and the budget check's message, as the single-rank replay
does (upstream's assertion stops the executor there).

Arrivals are injected at rank 0's clock, which may lag the group's by the difference of
one iteration's forward times between ranks (attention DP): a request can enter one
iteration late.
"""

from __future__ import annotations

import runpy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from benchmarks.replay.cost_model import ModelShape, default_cost_model
from benchmarks.replay.loop import percentiles
from benchmarks.replay.report import RESULT_SCHEMA
from benchmarks.replay.settings import ReplaySettings
from benchmarks.replay.sim_engine import Engine, build_sim_engine
from benchmarks.replay.tp_cost_model import TensorParallelCostModel
from benchmarks.replay.traces import Trace
from tensorrt_llm._torch.distributed.launcher import LaunchOptions, RankContext, launch
from tensorrt_llm._torch.distributed.rank_executor import RankExecutor
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.py_executor import Response

# A replay whose group runs this many iterations in a row without a forward and without an
# arrival to wait for is stuck (a scheduling bug): fail loudly instead of spinning.
_MAX_IDLE_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class RankLayout:
    size: int
    attention_dp: bool

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"the number of ranks must be >= 1, got {self.size}")

    @property
    def label(self) -> str:
        return f"{'attention DP' if self.attention_dp else 'TP'} {self.size}"


@dataclass(frozen=True, slots=True)
class RanksJob:
    """What every rank needs: the traffic (rank 0 injects it), the settings, the layout."""

    trace: Trace
    settings: ReplaySettings
    policies: tuple[str, ...]
    layout: RankLayout
    check_decisions: bool = False


@dataclass(slots=True)
class RankRun:
    """One rank's replay of one policy: what it ran, and what its requests saw."""

    rank: int
    requests: int = 0  # admitted on this rank (every request under TP)
    completed: int = 0
    errored: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    deferrals: int = 0
    max_consecutive_deferrals: int = 0
    capacity_deferrals: int = 0
    overshoots: int = 0
    first_overshoot: dict | None = None
    max_forward_tokens: int = 0
    forward_tokens: int = 0
    busy_iterations: int = 0
    bound_iterations: int = 0  # busy iterations after which some request still had prompt to compute
    bound_forward_tokens: int = 0
    group_iterations: int = 0
    end_time_s: float = 0.0
    wall_s: float = 0.0
    agreement_cost: dict | None = None

    def record(self, request: LlmRequest, response: Response) -> None:
        """``on_local_response``: this rank ran ``request``."""
        if not response.finished:
            return
        self.deferrals += request.counters.budget_deferrals
        self.capacity_deferrals += request.counters.capacity_deferrals
        self.max_consecutive_deferrals = max(self.max_consecutive_deferrals, request.counters.max_consecutive_budget_deferrals)
        if request.first_token_time is not None:
            self.ttft_ms.append((request.first_token_time - request.arrival_time) * 1e3)
        if request.state is LlmRequestState.GENERATION_COMPLETE and not request.is_cancelled:
            self.completed += 1
            self.output_tokens += request.num_generated_tokens
            if request.num_generated_tokens > 1:
                tpot = (request.finish_time - request.first_token_time) / (request.num_generated_tokens - 1)
                self.tpot_ms.append(tpot * 1e3)
        else:
            self.errored += 1

    def add(self, stats) -> None:
        self.group_iterations += 1
        if stats is None:
            return
        if stats.overshoot:
            self.overshoots += 1
            if self.first_overshoot is None:
                self.first_overshoot = {"iteration": stats.iteration, "message": stats.error, "time_s": stats.start_time,
                                        "rank": self.rank}
        elif stats.forward_tokens:
            self.busy_iterations += 1
            self.forward_tokens += stats.forward_tokens
            if stats.budget_bound:
                self.bound_iterations += 1
                self.bound_forward_tokens += stats.forward_tokens
        self.max_forward_tokens = max(self.max_forward_tokens, stats.forward_tokens)


# ---- on every rank ------------------------------------------------------------------------
def build_rank_engine(settings: ReplaySettings, policy: str, max_seq_len: int, layout: RankLayout) -> Engine:
    """The sim engine one rank runs: a TP rank's forward times, or a whole model's under attention DP."""
    shape = ModelShape()
    config = settings.executor_config(policy, max_seq_len=max_seq_len, kv_bytes_per_token=shape.kv_bytes_per_token())
    cost_model = default_cost_model()
    if not layout.attention_dp:
        cost_model = TensorParallelCostModel(cost_model, layout.size, shape)
    return build_sim_engine(config, cost_model=cost_model, model_shape=shape, vocab_size=settings.vocab_size)


def replay_on_rank(ctx: RankContext, job: RanksJob) -> dict[str, RankRun]:
    """Rank job: every policy of ``job`` on this rank, one fresh executor per policy."""
    max_seq_len = job.settings.max_seq_len(job.trace)  # the same on every rank: each has the whole trace
    return {policy: _replay_policy(ctx, job, policy, max_seq_len) for policy in job.policies}


def _replay_policy(ctx: RankContext, job: RanksJob, policy: str, max_seq_len: int) -> RankRun:
    started = time.perf_counter()
    layout = job.layout
    engine = build_rank_engine(job.settings, policy, max_seq_len, layout)
    clock = engine.clock
    run = RankRun(ctx.rank)
    rank_executor = RankExecutor(
        engine.executor, ctx.comm, ctx.mapping(enable_attention_dp=layout.attention_dp),
        check_decisions=job.check_decisions, on_local_response=run.record, clock_sync=clock.advance_to,
        stop_on_overshoot=policy == TokenBudgetPolicyName.NONE.value,
    )
    requests = job.trace.requests if ctx.rank == 0 else ()
    next_arrival, idle_steps, last_overshoot_errors = 0, 0, 0
    while True:
        if ctx.rank == 0:  # inject what has arrived by now
            while next_arrival < len(requests) and requests[next_arrival].arrival_s <= clock():
                r = requests[next_arrival]
                rank_executor.submit(LlmRequest(
                    input_token_ids=r.prompt_token_ids(), max_new_tokens=r.output_len, request_id=next_arrival,
                    arrival_time=r.arrival_s,
                ))
                next_arrival += 1
        errored_before = run.errored
        step = rank_executor.step()
        if step.stopped:
            if step.overshot_ranks and last_overshoot_errors:
                # Upstream's assertion fires before the forward: the overshooting batch never
                # answers. The executor here failed it with errors; they count as unserved.
                run.errored -= last_overshoot_errors
            break
        run.requests += len(step.assigned)
        run.add(step.stats)
        last_overshoot_errors = run.errored - errored_before if step.stats is not None and step.stats.overshoot else 0
        idle_steps = idle_steps + 1 if step.stats is None or not step.stats.forward_tokens else 0
        if ctx.rank != 0:
            continue
        if step.group_idle or idle_steps > _MAX_IDLE_STEPS:
            if next_arrival < len(requests):
                clock.advance_to(requests[next_arrival].arrival_s)
                idle_steps = 0
            elif step.group_idle:
                rank_executor.request_stop()
            else:
                raise RuntimeError(f"{policy}: no forward in {_MAX_IDLE_STEPS} iterations on rank 0")
    run.end_time_s = clock()
    run.wall_s = time.perf_counter() - started
    if rank_executor.agreement is not None:
        run.agreement_cost = rank_executor.agreement.cost.per_iteration_us()
    return run


# ---- in the launching process ---------------------------------------------------------------
def summarize(runs: Sequence[RankRun], layout: RankLayout, max_num_tokens: int, num_requests: int,
              first_arrival_s: float) -> dict:
    """§5 metrics of the whole group, each rank's (``ranks``), and the balance between ranks."""
    tokens = [run.forward_tokens for run in runs]
    assigned = [run.requests for run in runs]
    per_rank = []
    for i, run in enumerate(runs):
        entry = {"rank": i, **_metrics([run], max_num_tokens, run.requests, first_arrival_s)}
        entry["forward_tokens"] = run.forward_tokens
        # this rank's share of the group's work (1/N each when perfectly balanced; 1 each under TP)
        entry["share_of_requests"] = run.requests / num_requests if num_requests else 0.0
        entry["share_of_forward_tokens"] = run.forward_tokens / sum(tokens) if sum(tokens) else 0.0
        per_rank.append(entry)
    # Under TP every rank ran every request: the group's numbers are any one rank's.
    group = _metrics(runs if layout.attention_dp else runs[:1], max_num_tokens, num_requests, first_arrival_s)
    group["ranks"] = per_rank
    group["balance"] = {
        "requests": assigned,
        "forward_tokens": tokens,
        "max_over_mean_forward_tokens": max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 1.0,
        "max_over_mean_requests": max(assigned) / (sum(assigned) / len(assigned)) if sum(assigned) else 1.0,
    }
    if not layout.attention_dp:
        same = ("completed", "forward_tokens", "busy_iterations", "deferrals", "max_forward_tokens")
        group["ranks_agree"] = all(all(getattr(run, k) == getattr(runs[0], k) for k in same) for run in runs)
    costs = [run.agreement_cost for run in runs if run.agreement_cost]
    if costs:
        group["decision_check_us_per_iteration"] = costs
    return group


def _metrics(runs: Sequence[RankRun], max_num_tokens: int, num_requests: int, first_arrival_s: float) -> dict:
    ttft = [t for run in runs for t in run.ttft_ms]
    tpot = [t for run in runs for t in run.tpot_ms]
    busy = sum(run.busy_iterations for run in runs)
    forward = sum(run.forward_tokens for run in runs)
    bound = sum(run.bound_iterations for run in runs)
    bound_forward = sum(run.bound_forward_tokens for run in runs)
    group_iterations = max(run.group_iterations for run in runs)
    makespan = max(run.end_time_s for run in runs) - first_arrival_s
    overshoots = [run.first_overshoot for run in runs if run.first_overshoot]
    completed = sum(run.completed for run in runs)
    errored = sum(run.errored for run in runs)
    output_tokens = sum(run.output_tokens for run in runs)
    return {
        "requests": num_requests,
        "completed": completed,
        "errored": errored,
        "crashed": bool(overshoots),  # upstream's assertion stops here (``none`` stops; other policies go on)
        "crash": min(overshoots, key=lambda o: o["iteration"]) if overshoots else None,
        "overshoots": sum(run.overshoots for run in runs),
        "max_forward_tokens": max(run.max_forward_tokens for run in runs),
        "deferrals": sum(run.deferrals for run in runs),
        "max_consecutive_deferrals": max(run.max_consecutive_deferrals for run in runs),
        "budget_utilization": forward / busy / max_num_tokens if busy else 0.0,
        # docs/design.md §5: over the busy iterations in which the budget, not the traffic, was the limit
        "budget_utilization_when_bound": bound_forward / bound / max_num_tokens if bound else 0.0,
        # the share of all group iterations a rank's budget was used: an idle rank waits at 0
        "budget_utilization_all_iterations": forward / (group_iterations * len(runs)) / max_num_tokens
        if group_iterations else 0.0,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "output_tokens_per_s": output_tokens / makespan if makespan > 0 else 0.0,
        "wall_s": max(run.wall_s for run in runs),
        "unserved": num_requests - completed - errored,
        "capacity_deferrals": sum(run.capacity_deferrals for run in runs),
        "output_tokens": output_tokens,
        "makespan_s": makespan,
        "iterations": busy,
        "group_iterations": group_iterations,
    }


@dataclass(slots=True)
class RanksResult:
    """Per policy, the group's metrics (``summarize``); ``config`` and the single-rank baseline
    are the caller's (``benchmarks.replay`` fills them)."""

    layout: RankLayout
    results: dict[str, dict]
    config: dict = field(default_factory=dict)
    single_rank: dict[str, dict] | None = None

    def to_json(self) -> dict:
        document = {"config": self.config, "results": self.results}
        if self.single_rank is not None:
            document["single_rank"] = self.single_rank
        return document


def run_on_ranks(job: RanksJob, *, options: LaunchOptions = LaunchOptions()) -> RanksResult:
    """Replay ``job`` on its ranks: one process per rank, every policy in turn."""
    if job.settings.engine != "sim":
        raise ValueError("the multi-rank replay runs the sim engine only (--engine sim)")
    if not len(job.trace):
        raise ValueError("the trace has no requests")
    per_rank = launch(replay_on_rank, job.layout.size, job, options=options)
    first = job.trace.requests[0].arrival_s
    results = {
        policy: summarize([runs[policy] for runs in per_rank], job.layout, job.settings.executor.max_num_tokens, len(job.trace),
                          first)
        for policy in job.policies
    }
    return RanksResult(job.layout, results)


def ranks_config(job: RanksJob) -> dict:
    """The ``config["ranks"]`` entry of the JSON."""
    kv = job.settings.executor.kv_cache_config
    # The settings' options, and the flat KV keys this entry had before the settings held an ExecutorConfig.
    settings = job.settings.options() | {"tokens_per_block": kv.tokens_per_block, "kv_blocks": kv.num_blocks,
                                         "enable_block_reuse": kv.enable_block_reuse,
                                         "enable_partial_reuse": kv.enable_partial_reuse}
    return {"size": job.layout.size, "attention_dp": job.layout.attention_dp, "tp_size": job.layout.size,
            "check_decisions": job.check_decisions, "kv_blocks_per_rank": kv.num_blocks,
            "max_num_tokens_per_rank": job.settings.executor.max_num_tokens, "settings": settings}


def schema_errors(result: RanksResult) -> list[str]:
    """What breaks the §5 keys in the group totals and in every rank's entry."""
    errors = []
    for policy, group in result.results.items():
        for who, metrics in [("total", group), *((f"rank {i}", m) for i, m in enumerate(group["ranks"]))]:
            for key, kind in RESULT_SCHEMA.items():
                if not isinstance(metrics.get(key), kind) or (kind is int and isinstance(metrics.get(key), bool)):
                    errors.append(f"{policy} {who}: {key} must be {kind}")
    return errors


# ---- the report ---------------------------------------------------------------------------
def format_table(result: RanksResult) -> str:
    """One row per rank and one for the group's total per policy (and the single-rank row
    beside them when the baseline ran), then the balance and any crash."""
    header = ("policy", "who", "requests", "done", "err", "unserved", "overshoots", "max fwd", "defer", "util busy",
              "util bound", "util all", "fwd tokens", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "out tok/s")
    rows = [header]
    label = f"{result.layout.label} total"

    def row(policy: str, who: str, m: dict, tokens: int | str = "") -> tuple:
        return (policy, who, str(m["requests"]), str(m["completed"]), str(m["errored"]), str(m["unserved"]),
                str(m["overshoots"]), str(m["max_forward_tokens"]), str(m["deferrals"]),
                f"{m['budget_utilization']:.3f}", f"{m['budget_utilization_when_bound']:.3f}",
                f"{m.get('budget_utilization_all_iterations', m['budget_utilization']):.3f}", str(tokens),
                f"{m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f}",
                f"{m['tpot_ms']['p50']:.1f}/{m['tpot_ms']['p99']:.1f}", f"{m['output_tokens_per_s']:.0f}")

    for policy, group in result.results.items():
        if result.single_rank and policy in result.single_rank:
            rows.append(row(policy, "single rank", result.single_rank[policy]))
        tokens = group["balance"]["forward_tokens"]
        for i, m in enumerate(group["ranks"]):
            rows.append(row(policy, f"rank {i}", m, tokens[i]))
        rows.append(row(policy, label, group, sum(tokens) if result.layout.attention_dp else tokens[0]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for policy, group in result.results.items():
        balance = group["balance"]
        lines.append(f"{policy}: balance max/mean forward tokens {balance['max_over_mean_forward_tokens']:.3f},"
                     f" requests {balance['requests']}")
        crash = group["crash"]
        if crash:
            lines.append(f"{policy}: CRASHED at iteration {crash['iteration']} on rank {crash['rank']}"
                         f" (t={crash['time_s']:.2f} s): {crash['message']}; {group['unserved']} of"
                         f" {group['requests']} requests left unserved")
    return "\n".join(lines)


def plot(result: RanksResult, path: Path) -> None:
    """Per policy: forward tokens per rank (bars) and TTFT p50/p99 of each rank, the group and one rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(result.results)
    fig, axes = plt.subplots(len(policies), 2, figsize=(11, 3.2 * len(policies)), squeeze=False)
    for (left, right), policy in zip(axes, policies):
        group = result.results[policy]
        ranks = list(range(len(group["ranks"])))
        left.bar([f"rank {r}" for r in ranks], group["balance"]["forward_tokens"], color="tab:green")
        left.set_title(f"{policy}: forward tokens per rank (max/mean {group['balance']['max_over_mean_forward_tokens']:.2f})")
        names = [f"rank {r}" for r in ranks] + ["group"]
        values = [m["ttft_ms"] for m in group["ranks"]] + [group["ttft_ms"]]
        if result.single_rank and policy in result.single_rank:
            names.append("single rank")
            values.append(result.single_rank[policy]["ttft_ms"])
        x = range(len(names))
        right.bar([i - 0.2 for i in x], [v["p50"] for v in values], width=0.4, label="p50")
        right.bar([i + 0.2 for i in x], [v["p99"] for v in values], width=0.4, label="p99")
        right.set_xticks(list(x), names)
        right.set_yscale("log")
        right.set_ylabel("TTFT (ms)")
        right.legend(fontsize=8)
    trace = result.config.get("trace", {}).get("name", "trace")
    kv_blocks = result.config.get("ranks", {}).get("kv_blocks_per_rank")
    fig.suptitle(f"{trace}: {result.layout.label}, {kv_blocks} KV blocks per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- alias --------------------------------------------------------------------------------
def main() -> None:
    """``python -m benchmarks.replay.ranks ARGS`` runs ``python -m benchmarks.replay ARGS``.

    By module name, not by import: ``benchmarks.replay`` imports this module."""
    runpy.run_module("benchmarks.replay", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.exit(main())
