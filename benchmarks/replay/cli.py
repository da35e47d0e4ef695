"""Replay a request trace through the executor under each token-budget policy.

    python -m benchmarks.replay [--trace FILE] [--format auto|mooncake|azure|trtllm] \
        [--policies none,trim,fit,recheck] [--engine sim|torch] [--max-num-tokens N] \
        [--num-requests N] [--seed S] [--json OUT.json] [--plot OUT.png] ...
        [--tp-size N | --attention-dp N] [--check-decisions] [--no-single-rank]
        [--priority-mix FRACTION [--priority-rates 1,1.5,2]]   (benchmarks.replay.priority)

Every policy replays the same trace from scratch on a fresh executor. Requests enter the
executor at their trace timestamps on the engine's clock (virtual for ``sim``); when the
executor is idle the clock jumps to the next arrival. A request asks for exactly its
trace output length (the synthetic sampler never stops early).

``none`` is upstream before any fix: at the first forward whose positions exceed
``max_num_tokens`` the replay stops, as upstream's assertion stops the executor thread,
and reports the crash, the overshoot mechanism that fired (docs/design.md §1) and how many
requests were left unserved. The other policies go on past an overshoot: the executor
fails that batch with ``TokenBudgetExceeded`` and serves everyone else.

Without ``--trace`` the built-in default scenario is replayed (``benchmarks.replay.scenario``),
under defaults tuned so that ``none`` crashes early on every seed while ``recheck``
completes every request.

``--tp-size N`` / ``--attention-dp N`` replay on N ranks, one process each, on the sim
engine (``benchmarks.replay.ranks``): the table and the JSON give, per policy, the group's
§5 keys, a ``ranks`` list (each rank's keys, requests and share of the work) and the
balance; the single-rank replay of the same trace runs beside it unless ``--no-single-rank``
(JSON ``single_rank``). ``none`` stops the whole group at its first overshoot on any rank.

The trace flags are generated from ``TraceSpec``'s fields, the settings flags from
``ReplaySettings``'s (``ExecutorConfig``'s fields, hyphenated and dotted, then the replay's
own; ``--help`` lists them): a new executor setting is a replay flag at once.

Modules of ``benchmarks/replay/``: this one holds the trace spec and the CLI (``__main__``
runs it); ``settings`` the settings; ``loop`` replays one policy; ``diagnosis`` names the
overshoot mechanism; ``report`` prints the table and writes the JSON and the plot;
``sim_engine`` builds the engines; ``traces`` and ``scenario`` make the trace; ``cost_model``
prices a forward; ``ranks`` runs the replay on several ranks; ``priority`` the priority mix;
``diff`` compares two replays' JSONs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from benchmarks.replay import ranks, report
from benchmarks.replay.diagnosis import MECHANISMS, Overshoot, classify_claim, diagnose_overshoot
from benchmarks.replay.loop import PolicyRun, ReplayResult, replay_policy
from benchmarks.replay.ranks import RankLayout, RanksJob, RanksResult, ranks_config, run_on_ranks
from benchmarks.replay.settings import SET_BY_THE_REPLAY, ReplaySettings, max_seq_len_for
from benchmarks.replay.scenario import ScenarioConfig, default_scenario
from benchmarks.replay.traces import Trace, load_trace
from tensorrt_llm._torch.distributed.launcher import LaunchOptions
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName
from tensorrt_llm.llmapi.config_fields import add_arguments, from_mapping, overrides_from_args

__all__ = [
    "DEFAULT_SCENARIO_REQUESTS", "KNOWN_POLICIES", "MECHANISMS", "POLICIES", "Overshoot", "PolicyRun", "ReplayResult",
    "ReplaySettings", "TraceSpec", "build_parser", "classify_claim", "diagnose_overshoot", "main", "max_seq_len_for",
    "parse_args", "rank_layout", "replay_on_ranks", "replay_policy", "replay_trace", "run_replay", "settings_from_args",
]

POLICIES = ("none", "trim", "fit", "recheck", "claim")  # docs/design.md §5 set, plus claim-then-charge
KNOWN_POLICIES = tuple(p.value for p in TokenBudgetPolicyName)  # also later work, e.g. "claim"
# The default scenario's length in the replay: 100 s of arrivals at 7 req/s. The bug is a
# rare coincidence (a few overshoots per 100 s of this traffic under the default settings),
# so the replay runs long enough for ``none`` to hit it on every seed tried.
DEFAULT_SCENARIO_REQUESTS = 700


# ---------------------------------------------------------------------------------------
# The whole replay
# ---------------------------------------------------------------------------------------


TRACE_FORMATS = ("auto", "mooncake", "azure", "trtllm")


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Where the requests come from and how they are re-timed; the replay's trace flags are
    generated from these fields (``path`` is ``--trace``)."""

    path: str | None = field(default=None, metadata={"metavar": "FILE"})  # trace file; None: the built-in default scenario
    format: str = field(default="auto", metadata={"choices": TRACE_FORMATS})  # the trace file's format (auto: detected)
    num_requests: int | None = None  # keep the first N requests
    seed: int = 0  # scenario seed; Azure content seed; --qps arrival seed
    qps: float | None = None  # replace arrivals by Poisson arrivals at this rate
    time_scale: float = 1.0  # multiply arrival times (< 1 = more load)
    system_prompt_len: int = 0  # azure: a shared synthetic system prompt of this many tokens

    def __post_init__(self) -> None:
        if self.format not in TRACE_FORMATS:
            raise ValueError(f"format must be one of {TRACE_FORMATS}, got {self.format!r}")
        if self.num_requests is not None and not _is_int(self.num_requests, minimum=1):
            raise ValueError(f"num_requests must be None or an int >= 1, got {self.num_requests!r}")
        if not _is_int(self.seed, minimum=None):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.qps is not None and not (_is_number(self.qps) and self.qps > 0):
            raise ValueError(f"qps must be None or a finite number > 0, got {self.qps!r}")
        if not (_is_number(self.time_scale) and self.time_scale >= 0):
            raise ValueError(f"time_scale must be a finite number >= 0, got {self.time_scale!r}")
        if not _is_int(self.system_prompt_len, minimum=0):
            raise ValueError(f"system_prompt_len must be an int >= 0, got {self.system_prompt_len!r}")

    def load(self, settings: ReplaySettings) -> Trace:
        return self.load_for(vocab_size=settings.vocab_size, tokens_per_block=settings.executor.kv_cache_config.tokens_per_block)

    def load_for(self, *, vocab_size: int, tokens_per_block: int) -> Trace:
        """The trace with token ids in ``[1, vocab_size)``; the default scenario block-aligns its
        regenerated prompts to ``tokens_per_block``."""
        vocab = vocab_size
        if self.path is None:
            trace = default_scenario(ScenarioConfig(
                num_requests=self.num_requests or DEFAULT_SCENARIO_REQUESTS,
                seed=self.seed,
                tokens_per_block=tokens_per_block,
                vocab_size=vocab,
            ))
        else:
            trace = load_trace(
                self.path, self.format, vocab_size=vocab, system_prompt_len=self.system_prompt_len, seed=self.seed,
                num_requests=self.num_requests,
            )
        if self.qps is not None:
            trace = trace.retimed(self.qps, self.seed)
        if self.time_scale != 1.0:
            trace = trace.scaled(self.time_scale)
        return trace


def _is_int(value: object, *, minimum: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def describe_config(trace: Trace, spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str], engine: dict) -> dict:
    """Every setting the replay used, for the JSON's ``config``."""
    kv_bytes = engine["kv_bytes_per_token"]
    tpb = settings.executor.kv_cache_config.tokens_per_block
    executor_config = settings.executor_config(policies[0], max_seq_len=settings.max_seq_len(trace), kv_bytes_per_token=kv_bytes)
    kv = executor_config.kv_cache_config
    gib = 1 << 30
    return {
        "trace": {
            "name": trace.name,
            "format": trace.format,
            "path": spec.path,
            "requests": len(trace),
            "notes": list(trace.notes),
            "requested_format": spec.format,
            "num_requests": spec.num_requests,
            "seed": spec.seed,
            "qps": spec.qps,
            "time_scale": spec.time_scale,
            "system_prompt_len": spec.system_prompt_len,
            "prompt_tokens": sum(r.input_len for r in trace.requests),
            "output_tokens": sum(r.output_len for r in trace.requests),
            "arrival_span_s": trace.requests[-1].arrival_s if len(trace) else 0.0,
        },
        "policies": list(policies),
        "engine": {k: v for k, v in engine.items() if k != "kv_bytes_per_token"}
        | ({"cost_model_file": settings.cost_model} if settings.cost_model else {}),
        "executor": {
            "max_num_tokens": executor_config.max_num_tokens,
            "max_batch_size": executor_config.max_batch_size,
            "max_seq_len": executor_config.max_seq_len,
            "enable_chunked_prefill": executor_config.enable_chunked_prefill,
            "chunk_unit_size": executor_config.chunk_unit_size,
            "context_chunking_policy": executor_config.context_chunking_policy.value,
            "capacity_scheduler_policy": executor_config.capacity_scheduler_policy.value,
        },
        "kv_cache": {
            "tokens_per_block": tpb,
            "num_blocks": kv.num_blocks,
            "num_tokens": kv.num_blocks * tpb,
            "enable_block_reuse": kv.enable_block_reuse,
            "enable_partial_reuse": kv.enable_partial_reuse,
            "host_cache_blocks": settings.host_cache_blocks,
            "host_cache_size": kv.host_cache_size,
            "kv_bytes_per_token": kv_bytes,
            "device_pool_gib": kv.num_blocks * tpb * kv_bytes / gib,
            "host_pool_gib": kv.host_cache_size / gib,
        },
        "settings": settings.options(),  # every setting, by the names the flags and from_options take
    }


def run_replay(
    spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str] = POLICIES, *, progress: bool = True,
    on_policy: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Load the trace ``spec`` describes and replay it under each of ``policies``."""
    return replay_trace(spec.load(settings), settings, policies, spec=spec, progress=progress, on_policy=on_policy)


def replay_trace(
    trace: Trace,
    settings: ReplaySettings,
    policies: Sequence[str] = POLICIES,
    *,
    spec: TraceSpec | None = None,
    progress: bool = True,
    on_policy: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Replay an in-memory ``trace`` under each policy, each on a fresh executor.

    ``on_policy``: called after each policy with the result of the policies replayed so far (a
    long replay on a real engine that is stopped part-way keeps what it finished)."""
    if not len(trace):
        raise ValueError("the trace has no requests")
    if not policies:
        raise ValueError("no policy to replay")
    spec = spec or TraceSpec(path=None)
    max_seq_len = settings.max_seq_len(trace)
    runs: dict[str, PolicyRun] = {}
    engine: dict | None = None
    for policy in policies:
        runs[policy] = replay_policy(trace, settings, policy, max_seq_len=max_seq_len, progress=progress)
        if engine is None:
            # Built after the first run, not before: a settings subclass that records its first
            # engine per policy (gpu_phase_b) must record the replayed one, not this probe.
            probe = settings.build_engine(policies[0], max_seq_len)  # only to describe it; nothing runs on it
            engine = {**probe.description, "kv_bytes_per_token": probe.kv_bytes_per_token}
            del probe
        _utilization_before_crash(runs, settings.executor.max_num_tokens)
        if on_policy is not None and len(runs) < len(policies):
            on_policy(ReplayResult(describe_config(trace, spec, settings, list(runs), engine), dict(runs), trace.notes))
    return ReplayResult(describe_config(trace, spec, settings, policies, engine), runs, trace.notes)


def _utilization_before_crash(runs: dict[str, PolicyRun], max_num_tokens: int) -> None:
    """Add ``budget_utilization_before_crash`` to every result: the §5 utilisation over the
    forwards that ended before the earliest crash (None when nothing crashed), so that
    ``none`` and the policies that go on are compared over the same stretch of traffic."""
    crashes = [run.metrics["crash"]["time_s"] for run in runs.values() if run.metrics["crash"]]
    horizon = min(crashes) if crashes else None
    for run in runs.values():
        value = None
        if horizon is not None:
            tokens = [n for t, n in zip(run.iteration_time_s, run.iteration_tokens) if t <= horizon]
            value = sum(tokens) / len(tokens) / max_num_tokens if tokens else 0.0
        run.metrics["budget_utilization_before_crash"] = value


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in KNOWN_POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"policies must be a comma-separated subset of {','.join(KNOWN_POLICIES)}, got {text!r}")
    return list(dict.fromkeys(names))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


TRACE_FLAG_NAMES = {"path": ["--trace"]}  # docs/design.md §5
# The replay's flag names from before they were generated, kept (the generated ones work too).
SETTINGS_FLAG_ALIASES = {
    "kv_cache_config.tokens_per_block": ["--tokens-per-block"],
    "kv_cache_config.num_blocks": ["--kv-blocks"],
    "kv_cache_config.enable_block_reuse": ["--enable-block-reuse"],
    "kv_cache_config.enable_partial_reuse": ["--enable-partial-reuse"],
}


def build_parser() -> argparse.ArgumentParser:
    """The replay's flags: the trace's (``TraceSpec``) and the settings' (``ReplaySettings``:
    ``ExecutorConfig``'s fields but ``SET_BY_THE_REPLAY``, then the replay's own), generated
    from their fields with hyphens (``--max-num-tokens``, ``--kv-cache-config.tokens-per-block``
    alias ``--tokens-per-block``); the policies, the outputs and the ranks are the CLI's own."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.replay",
        description="Replay a request trace under each token-budget policy (docs/design.md §5).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--policies", type=_policies, default=list(POLICIES), help="comma-separated subset of " + ",".join(KNOWN_POLICIES))
    p.add_argument("--json", metavar="OUT.json", help="write the results (docs/design.md §5 schema)")
    p.add_argument("--plot", metavar="OUT.png", help="forward tokens per iteration and TTFT CDF per policy")
    trace = p.add_argument_group("the trace (TraceSpec)")
    add_arguments(trace, TraceSpec, spell="-", names=TRACE_FLAG_NAMES)
    settings = p.add_argument_group("the executor and the engine (ReplaySettings)")
    add_arguments(settings, ReplaySettings, spell="-", aliases=SETTINGS_FLAG_ALIASES, exclude=SET_BY_THE_REPLAY)
    rank_flags = p.add_argument_group("several ranks (sim engine, one process per rank)")
    layout = rank_flags.add_mutually_exclusive_group()
    layout.add_argument("--tp-size", type=_positive_int, metavar="N", help="tensor parallelism over N ranks")
    layout.add_argument("--attention-dp", type=_positive_int, metavar="N", help="attention data parallelism over N ranks")
    rank_flags.add_argument("--check-decisions", action="store_true",
                       help="compare the ranks' decision digests every iteration")
    rank_flags.add_argument("--single-rank", action=argparse.BooleanOptionalAction, default=True,
                       help="with several ranks: also replay the same trace on one rank, for comparison")
    rank_flags.add_argument("--collective-timeout-s", type=_positive_float, default=120.0)
    mix = p.add_argument_group("priority mix (benchmarks.replay.priority; its own JSON)")
    mix.add_argument("--priority-mix", type=float, metavar="FRACTION",
                     help="mark this fraction of conversations interactive (0.9), the rest batch (0.1), and compare"
                          " fcfs, priority and priority with preemption at each --priority-rates (first --policies policy)")
    mix.add_argument("--priority-rates", type=_rates, default=[1.0, 1.5, 2.0], metavar="R,R,...",
                     help="arrival rates, as multiples of the trace's")
    mix.add_argument("--priority-goal-rate", type=_positive_float, default=1.5, metavar="R",
                     help="the rate the goals are checked at")
    return p


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be finite numbers > 0, got {text!r}")
    return rates


def rank_layout(args: argparse.Namespace) -> RankLayout | None:
    """The ranks ``--tp-size`` / ``--attention-dp`` ask for; None: the ordinary single-rank replay."""
    if args.tp_size is not None:
        return RankLayout(args.tp_size, attention_dp=False)
    if args.attention_dp is not None:
        return RankLayout(args.attention_dp, attention_dp=True)
    return None


def settings_from_args(args: argparse.Namespace) -> tuple[TraceSpec, ReplaySettings, list[str]]:
    """The trace, the settings and the policies the flags give; raises ValueError naming a
    value that the dataclasses refuse (``main`` turns it into a usage error)."""
    spec = from_mapping(TraceSpec, overrides_from_args(args, TraceSpec))
    settings = ReplaySettings.from_options(**overrides_from_args(args, ReplaySettings, exclude=SET_BY_THE_REPLAY))
    return spec, settings, args.policies


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, TraceSpec, ReplaySettings, list[str]]:
    """The flags parsed and built, or exit status 2 with the reason (argparse's usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return (args, *settings_from_args(args))
    except ValueError as error:
        parser.error(str(error))


def replay_on_ranks(
    spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str], layout: RankLayout, *,
    check_decisions: bool = False, single_rank: bool = True, options: LaunchOptions = LaunchOptions(),
) -> RanksResult:
    """Replay the trace of ``spec`` on the ranks of ``layout`` (and on one rank beside them)."""
    if settings.engine != "sim":
        raise ValueError("the multi-rank replay runs the sim engine only (--engine sim)")
    trace = spec.load(settings)
    job = RanksJob(trace, settings, tuple(policies), layout, check_decisions)
    result = run_on_ranks(job, options=options)
    probe = settings.build_engine(policies[0], settings.max_seq_len(trace))  # only to describe it
    engine = {**probe.description, "kv_bytes_per_token": probe.kv_bytes_per_token}
    del probe
    result.config = {**describe_config(trace, spec, settings, policies, engine), "ranks": ranks_config(job)}
    if single_rank:
        single = replay_trace(trace, settings, policies, spec=spec)
        result.single_rank = {name: run.metrics for name, run in single.runs.items()}
    return result


def _main_on_ranks(args: argparse.Namespace, spec: TraceSpec, settings: ReplaySettings, policies: list[str],
                   layout: RankLayout) -> int:
    if settings.engine != "sim":
        raise SystemExit("--tp-size / --attention-dp replay the sim engine only (--engine sim)")
    result = replay_on_ranks(
        spec, settings, policies, layout, check_decisions=args.check_decisions, single_rank=args.single_rank,
        options=LaunchOptions(collective_timeout_s=args.collective_timeout_s),
    )
    errors = report.schema_errors(result.to_json()) + ranks.schema_errors(result)
    if errors:  # a bug in the replay, not in the user's input
        raise AssertionError("multi-rank replay JSON breaks docs/design.md §5: " + "; ".join(errors))
    trace = result.config["trace"]
    print(f"trace: {trace['name']} ({trace['format']}), {trace['requests']} requests over {trace['arrival_span_s']:.1f} s;"
          f" {layout.label}, sim engine, {settings.executor.kv_cache_config.num_blocks} KV blocks and max_num_tokens={settings.executor.max_num_tokens}"
          " per rank\n")
    print(ranks.format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    if args.plot:
        ranks.plot(result, Path(args.plot))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, spec, settings, policies = parse_args(argv)
    if args.priority_mix is not None:
        from benchmarks.replay import priority

        chosen = ["recheck"] if policies == list(POLICIES) else policies  # the default list: the default policy
        return priority.main(spec, settings, chosen, interactive_fraction=args.priority_mix,
                                    rates=args.priority_rates, goal_rate=args.priority_goal_rate,
                                    json_path=args.json, plot_path=args.plot)
    layout = rank_layout(args)
    if layout is not None:
        return _main_on_ranks(args, spec, settings, policies, layout)
    partial = None if not args.json else (lambda so_far: report.write_json(so_far, Path(args.json)))
    result = run_replay(spec, settings, policies, on_policy=partial)  # the JSON grows policy by policy
    print(report.format_report(result))
    if args.json:
        report.write_json(result, Path(args.json))
    if args.plot:
        report.plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
