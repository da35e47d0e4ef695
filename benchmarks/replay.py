"""Replay a request trace through the executor under each token-budget policy.

    python -m benchmarks.replay [--trace FILE] [--format auto|mooncake|azure|trtllm] \
        [--policies none,trim,fit,recheck] [--engine sim|torch] [--max-num-tokens N] \
        [--num-requests N] [--seed S] [--json OUT.json] [--plot OUT.png] ...
        [--tp-size N | --attention-dp N] [--check-decisions] [--no-single-rank]

Every policy replays the same trace from scratch on a fresh executor. Requests enter the
executor at their trace timestamps on the engine's clock (virtual for ``sim``); when the
executor is idle the clock jumps to the next arrival. A request asks for exactly its
trace output length (the synthetic sampler never stops early).

``none`` is upstream before any fix: at the first forward whose positions exceed
``max_num_tokens`` the replay stops, as upstream's assertion stops the executor thread,
and reports the crash, the overshoot mechanism that fired (DESIGN.md §1) and how many
requests were left unserved. The other policies go on past an overshoot: the executor
fails that batch with ``TokenBudgetExceeded`` and serves everyone else.

Without ``--trace`` the built-in default scenario is replayed (``benchmarks.scenario``),
under defaults tuned so that ``none`` crashes early on every seed while ``recheck``
completes every request.

``--tp-size N`` / ``--attention-dp N`` replay on N ranks, one process each, on the sim
engine (``benchmarks.replay_ranks``): the table and the JSON give, per policy, the group's
§5 keys, a ``ranks`` list (each rank's keys, requests and share of the work) and the
balance; the single-rank replay of the same trace runs beside it unless ``--no-single-rank``
(JSON ``single_rank``). ``none`` stops the whole group at its first overshoot on any rank.

Modules: this one holds the settings, the trace spec and the CLI; ``replay_loop`` replays
one policy; ``replay_diagnosis`` names the overshoot mechanism; ``replay_report`` prints the
table and writes the JSON and the plot; ``sim_engine`` builds the engines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from benchmarks import replay_ranks, replay_report
from benchmarks.replay_diagnosis import MECHANISMS, Overshoot, classify_claim, diagnose_overshoot
from benchmarks.replay_loop import PolicyRun, ReplayResult, replay_policy
from benchmarks.replay_ranks import RankLayout, RanksJob, RanksResult, ranks_config, run_on_ranks
from benchmarks.replay_settings import ReplaySettings, max_seq_len_for
from benchmarks.scenario import ScenarioConfig, default_scenario
from benchmarks.sim_engine import ENGINES
from benchmarks.traces import Trace, load_trace
from tensorrt_llm._torch.distributed.launcher import LaunchOptions
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import TokenBudgetPolicyName

__all__ = [
    "DEFAULT_SCENARIO_REQUESTS", "KNOWN_POLICIES", "MECHANISMS", "POLICIES", "Overshoot", "PolicyRun", "ReplayResult",
    "ReplaySettings", "TraceSpec", "build_parser", "classify_claim", "diagnose_overshoot", "main", "max_seq_len_for",
    "rank_layout", "replay_on_ranks", "replay_policy", "replay_trace", "run_replay", "settings_from_args",
]

POLICIES = ("none", "trim", "fit", "recheck", "claim")  # DESIGN.md §5 set, plus claim-then-charge
KNOWN_POLICIES = tuple(p.value for p in TokenBudgetPolicyName)  # also later work, e.g. "claim"
# The default scenario's length in the replay: 100 s of arrivals at 7 req/s. The bug is a
# rare coincidence (a few overshoots per 100 s of this traffic under the default settings),
# so the replay runs long enough for ``none`` to hit it on every seed tried.
DEFAULT_SCENARIO_REQUESTS = 700


# ---------------------------------------------------------------------------------------
# The whole replay
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Where the requests come from and how they are re-timed."""

    path: str | None = None  # None: the built-in default scenario
    format: str = "auto"
    num_requests: int | None = None
    seed: int = 0
    qps: float | None = None
    time_scale: float = 1.0
    system_prompt_len: int = 0  # azure only

    def load(self, settings: ReplaySettings) -> Trace:
        return self.load_for(vocab_size=settings.vocab_size, tokens_per_block=settings.tokens_per_block)

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


def describe_config(trace: Trace, spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str], engine: dict) -> dict:
    """Every setting the replay used, for the JSON's ``config``."""
    kv_bytes = engine["kv_bytes_per_token"]
    tpb = settings.tokens_per_block
    executor_config = settings.executor_config(policies[0], max_seq_len=settings.max_seq_len(trace), kv_bytes_per_token=kv_bytes)
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
        "engine": {k: v for k, v in engine.items() if k != "kv_bytes_per_token"},
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
            "num_blocks": settings.kv_blocks,
            "num_tokens": settings.kv_blocks * tpb,
            "enable_block_reuse": settings.enable_block_reuse,
            "enable_partial_reuse": settings.enable_partial_reuse,
            "host_cache_blocks": settings.host_cache_blocks,
            "host_cache_size": executor_config.kv_cache_config.host_cache_size,
            "kv_bytes_per_token": kv_bytes,
            "device_pool_gib": settings.kv_blocks * tpb * kv_bytes / gib,
            "host_pool_gib": executor_config.kv_cache_config.host_cache_size / gib,
        },
    }


def run_replay(
    spec: TraceSpec, settings: ReplaySettings, policies: Sequence[str] = POLICIES, *, progress: bool = True,
) -> ReplayResult:
    """Load the trace ``spec`` describes and replay it under each of ``policies``."""
    return replay_trace(spec.load(settings), settings, policies, spec=spec, progress=progress)


def replay_trace(
    trace: Trace,
    settings: ReplaySettings,
    policies: Sequence[str] = POLICIES,
    *,
    spec: TraceSpec | None = None,
    progress: bool = True,
) -> ReplayResult:
    """Replay an in-memory ``trace`` under each policy, each on a fresh executor."""
    if not len(trace):
        raise ValueError("the trace has no requests")
    if not policies:
        raise ValueError("no policy to replay")
    spec = spec or TraceSpec(path=None)
    max_seq_len = settings.max_seq_len(trace)
    runs = {policy: replay_policy(trace, settings, policy, max_seq_len=max_seq_len, progress=progress) for policy in policies}
    _utilization_before_crash(runs, settings.max_num_tokens)
    probe = settings.build_engine(policies[0], max_seq_len)  # only to describe it; nothing runs on it
    engine = {**probe.description, "kv_bytes_per_token": probe.kv_bytes_per_token}
    del probe
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


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = ReplaySettings()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.replay",
        description="Replay a request trace under each token-budget policy (DESIGN.md §5).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--trace", help="trace file; default: the built-in default scenario")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "azure", "trtllm"))
    p.add_argument("--policies", type=_policies, default=list(POLICIES), help="comma-separated subset of " + ",".join(KNOWN_POLICIES))
    p.add_argument("--engine", default=d.engine, choices=ENGINES)
    p.add_argument("--model", default=d.model, choices=sorted(MODEL_PRESETS), help="torch engine's model")
    p.add_argument("--device", default=d.device, choices=("cpu", "cuda"), help="torch engine's device")
    p.add_argument("--disable-overlap-scheduler", action=argparse.BooleanOptionalAction, default=None,
                   help="default: upstream's (overlap on CUDA, off on the CPU)")
    p.add_argument("--max-num-tokens", type=_positive_int, default=d.max_num_tokens)
    p.add_argument("--num-requests", type=_positive_int, default=None, help="keep the first N requests")
    p.add_argument("--seed", type=int, default=0, help="scenario seed; Azure content seed; --qps arrival seed")
    p.add_argument("--json", metavar="OUT.json", help="write the results (DESIGN.md §5 schema)")
    p.add_argument("--plot", metavar="OUT.png", help="forward tokens per iteration and TTFT CDF per policy")
    p.add_argument("--kv-blocks", type=_positive_int, default=d.kv_blocks, help="device KV pool, in blocks")
    p.add_argument("--host-cache-blocks", type=_non_negative_int, default=d.host_cache_blocks,
                   help="host (offload) tier, in blocks; 0 disables it")
    p.add_argument("--tokens-per-block", type=_positive_int, default=d.tokens_per_block)
    p.add_argument("--max-batch-size", type=_positive_int, default=d.max_batch_size)
    p.add_argument("--enable-partial-reuse", action=argparse.BooleanOptionalAction, default=d.enable_partial_reuse)
    p.add_argument("--enable-block-reuse", action=argparse.BooleanOptionalAction, default=d.enable_block_reuse)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1 = more load)")
    p.add_argument("--qps", type=_positive_float, default=None, help="replace arrivals by Poisson arrivals at this rate")
    p.add_argument("--system-prompt-len", type=_non_negative_int, default=0,
                   help="azure: a shared synthetic system prompt of this many tokens")
    ranks = p.add_argument_group("several ranks (sim engine, one process per rank)")
    layout = ranks.add_mutually_exclusive_group()
    layout.add_argument("--tp-size", type=_positive_int, metavar="N", help="tensor parallelism over N ranks")
    layout.add_argument("--attention-dp", type=_positive_int, metavar="N", help="attention data parallelism over N ranks")
    ranks.add_argument("--check-decisions", action="store_true",
                       help="compare the ranks' decision digests every iteration")
    ranks.add_argument("--single-rank", action=argparse.BooleanOptionalAction, default=True,
                       help="with several ranks: also replay the same trace on one rank, for comparison")
    ranks.add_argument("--collective-timeout-s", type=_positive_float, default=120.0)
    return p


def rank_layout(args: argparse.Namespace) -> RankLayout | None:
    """The ranks ``--tp-size`` / ``--attention-dp`` ask for; None: the ordinary single-rank replay."""
    if args.tp_size is not None:
        return RankLayout(args.tp_size, attention_dp=False)
    if args.attention_dp is not None:
        return RankLayout(args.attention_dp, attention_dp=True)
    return None


def settings_from_args(args: argparse.Namespace) -> tuple[TraceSpec, ReplaySettings, list[str]]:
    settings = ReplaySettings(
        engine=args.engine,
        model=args.model,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=args.max_batch_size,
        tokens_per_block=args.tokens_per_block,
        kv_blocks=args.kv_blocks,
        host_cache_blocks=args.host_cache_blocks,
        enable_block_reuse=args.enable_block_reuse,
        enable_partial_reuse=args.enable_partial_reuse,
        enable_chunked_prefill=args.enable_chunked_prefill,
        device=args.device,
        disable_overlap_scheduler=args.disable_overlap_scheduler,
    )
    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        raise SystemExit(f"--time-scale must be finite and >= 0, got {args.time_scale}")
    spec = TraceSpec(
        path=args.trace,
        format=args.format,
        num_requests=args.num_requests,
        seed=args.seed,
        qps=args.qps,
        time_scale=args.time_scale,
        system_prompt_len=args.system_prompt_len,
    )
    return spec, settings, args.policies


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


def _main_on_ranks(args: argparse.Namespace, layout: RankLayout) -> int:
    spec, settings, policies = settings_from_args(args)
    if settings.engine != "sim":
        raise SystemExit("--tp-size / --attention-dp replay the sim engine only (--engine sim)")
    result = replay_on_ranks(
        spec, settings, policies, layout, check_decisions=args.check_decisions, single_rank=args.single_rank,
        options=LaunchOptions(collective_timeout_s=args.collective_timeout_s),
    )
    errors = replay_report.schema_errors(result.to_json()) + replay_ranks.schema_errors(result)
    if errors:  # a bug in the replay, not in the user's input
        raise AssertionError("multi-rank replay JSON breaks DESIGN.md §5: " + "; ".join(errors))
    trace = result.config["trace"]
    print(f"trace: {trace['name']} ({trace['format']}), {trace['requests']} requests over {trace['arrival_span_s']:.1f} s;"
          f" {layout.label}, sim engine, {settings.kv_blocks} KV blocks and max_num_tokens={settings.max_num_tokens}"
          " per rank\n")
    print(replay_ranks.format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    if args.plot:
        replay_ranks.plot(result, Path(args.plot))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    layout = rank_layout(args)
    if layout is not None:
        return _main_on_ranks(args, layout)
    spec, settings, policies = settings_from_args(args)
    result = run_replay(spec, settings, policies)
    print(replay_report.format_report(result))
    if args.json:
        replay_report.write_json(result, Path(args.json))
    if args.plot:
        replay_report.plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
