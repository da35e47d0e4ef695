"""A/B of the host path: this tree against other commits, runs alternated, medians compared.

The machine this runs on is shared, so a number measured alone says little. This script
checks each commit out into its own temporary ``git worktree``, then runs the same
benchmark in every tree in turn, once per round, rotating the order each round so that no
tree always goes first, and reports each tree's median over the rounds, its ratio to the
first ``--against`` commit (the reference), and in how many rounds it was below the reference
(the rounds are paired: a round's trees ran back to back)::

    python -m benchmarks.host_path.ab --against c7cec84,e787698 [--tree HEAD] \
        [--active 256,1024] [--iterations 200] [--runs 7] [--json OUT.json]
    python -m benchmarks.host_path.ab --against e787698 --replay -- \
        --trace TRACE.jsonl --tokens-per-block 64 --kv-blocks 8192 --host-cache-blocks 16384 --policies recheck

Two benchmarks:

* ``overhead`` (the default): this tree's ``benchmarks/host_path/overhead.py``, copied into every other
  tree (into its ``benchmarks/host_path/``, made if an older tree lacks it) so that one benchmark measures them all, at each ``--active`` size, in a fresh
  interpreter. Two numbers are compared: ``host_us_per_request`` (median microseconds of
  scheduling + ``prepare_resources`` per iteration, over the active requests) and
  ``step_us_per_request`` (the whole iteration, the simulated forward's host side, sampling,
  the requests' update and the KV commit included); the phases are kept beside them. They
  are timed with the thread's CPU clock by default (``--clock cpu``): on a machine shared with
  other work the wall clock also counts the time spent waiting for a core.
* ``--phases``: this tree's ``benchmarks/host_path/phases.py`` (copied in too): each phase of
  the step in CPU microseconds per active request (``<phase>@<active>``), to see which
  phase a difference comes from.
* ``--replay``: each tree's own ``benchmarks.replay`` with the arguments after ``--``; the
  numbers compared are each policy's ``wall_s`` and the replay process's CPU time (``cpu_s``,
  start-up and trace loading included: what a busy machine disturbs least). The replays' JSONs must agree on everything
  else (``benchmarks.replay.diff``); a difference is reported (``identical: false``).

Every run imports the package from its own tree (``PYTHONPATH`` is the tree, checked before
the first run), with this interpreter. ``--tree`` is the tree under test: this working tree
(the default, uncommitted edits included) or a commit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from benchmarks.replay.diff import differences

REPO = Path(__file__).resolve().parents[2]
WORKING_TREE = "working-tree"
BENCHMARK_DIR = Path("benchmarks") / "host_path"
BENCHMARK_FILES = ("__init__.py", "overhead.py", "phases.py")  # copied into every tree: one benchmark measures them all


@dataclass
class Tree:
    """One side of the comparison: a label (a commit or the working tree) and its root."""

    label: str
    root: Path
    samples: dict[str, list[float]] = field(default_factory=dict)  # metric -> one value per round


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def checked_out(refs: Sequence[str], tree: str | None, *, same_benchmark: bool) -> Iterator[list[Tree]]:
    """The trees to compare, ``refs`` first, then the tree under test; the worktrees made here
    are removed on the way out, whatever happens. ``same_benchmark``: this tree's
    ``benchmarks/host_path/overhead.py`` replaces theirs."""
    made: list[Path] = []
    scratch = Path(tempfile.mkdtemp(prefix="host-path-ab-"))
    try:
        trees = []
        for ref in [*refs, *([tree] if tree else [])]:
            sha = _git("rev-parse", "--short", f"{ref}^{{commit}}")
            path = scratch / sha
            if not path.exists():
                _git("worktree", "add", "--detach", str(path), sha)
                made.append(path)
                if same_benchmark:
                    (path / BENCHMARK_DIR).mkdir(exist_ok=True)  # trees before the benchmarks/ grouping lack it
                    for name in BENCHMARK_FILES:
                        shutil.copyfile(REPO / BENCHMARK_DIR / name, path / BENCHMARK_DIR / name)
            trees.append(Tree(sha, path))
        if not tree:
            trees.append(Tree(WORKING_TREE, REPO))
        yield trees
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
        with contextlib.suppress(OSError):
            scratch.rmdir()


def _run(tree: Tree, args: Sequence[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree.root))
    done = subprocess.run([sys.executable, *args], cwd=tree.root, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree.label}: {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done


def check_imports(tree: Tree) -> None:
    """Fail early unless the package imports from ``tree`` itself (not an installed copy)."""
    where = Path(_run(tree, ["-c", "import tensorrt_llm; print(tensorrt_llm.__file__)"]).stdout.strip()).resolve()
    if tree.root.resolve() not in where.parents:
        raise SystemExit(f"{tree.label}: tensorrt_llm imports from {where}, not from {tree.root}")


def run_overhead(tree: Tree, sizes: Sequence[int], iterations: int, clock: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        _run(tree, ["-m", "benchmarks.host_path.overhead", "--active", ",".join(map(str, sizes)),
                    "--iterations", str(iterations), "--clock", clock, "--json", str(out)])
        rows = json.loads(out.read_text())["results"]
    for size, row in zip(sizes, rows):
        for key in ("host_us_per_request", "step_us_per_request", "schedule_us", "prepare_resources_us", "step_us"):
            tree.samples.setdefault(f"{key}@{size}", []).append(row[key])


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


def run_phases(tree: Tree, sizes: Sequence[int], iterations: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "phases.json"
        for size in sizes:
            _run(tree, ["-m", "benchmarks.host_path.phases", "--active", str(size), "--iterations", str(iterations),
                        "--json", str(out)])
            for phase, us in json.loads(out.read_text())["us_per_request"].items():
                tree.samples.setdefault(f"{phase}@{size}", []).append(us)


def run_replay(tree: Tree, replay_args: Sequence[str], keep: Path) -> dict:
    out = keep / f"{tree.label}.json"
    before = _children_cpu_s()
    _run(tree, ["-m", "benchmarks.replay", *replay_args, "--json", str(out)])
    tree.samples.setdefault("cpu_s", []).append(round(_children_cpu_s() - before, 3))  # the whole process's
    result = json.loads(out.read_text())
    for policy, metrics in result["results"].items():
        tree.samples.setdefault(f"wall_s@{policy}", []).append(metrics["wall_s"])
    return result


def summarize(trees: Sequence[Tree]) -> dict:
    """Per metric: each tree's median, min, max and samples, its median over the reference's,
    and in how many rounds its sample was below the reference's of the same round (a metric a
    tree lacks, such as a phase an older tree does not have, is left out for it)."""
    reference = trees[0]
    metrics = list(dict.fromkeys(m for tree in trees for m in tree.samples))
    table = {}
    for metric in metrics:
        ref = reference.samples.get(metric)
        table[metric] = {}
        for tree in trees:
            values = tree.samples.get(metric)
            if not values:
                continue
            median = statistics.median(values)
            table[metric][tree.label] = {
                "median": round(median, 4), "min": min(values), "max": max(values),
                "ratio_to_reference": round(median / statistics.median(ref), 3) if ref else None,
                "rounds_below_reference": (sum(v < r for v, r in zip(values, ref))
                                           if ref and tree is not reference else None),
                "samples": values,
            }
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    replay_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, replay_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="comma-separated commits; the first is the reference")
    parser.add_argument("--tree", help="the commit under test (default: this working tree, as it is)")
    parser.add_argument("--active", default="256,1024", help="overhead: comma-separated numbers of active requests")
    parser.add_argument("--iterations", type=int, default=200, help="overhead: timed iterations per size")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="overhead: the clock that times the phases (cpu: the thread's CPU time, robust to"
                             " other work on the machine; wall: what make overhead reports)")
    parser.add_argument("--phases", action="store_true", help="time each phase of the step (benchmarks.host_path.phases)")
    parser.add_argument("--replay", action="store_true", help="time benchmarks.replay (its arguments after --)")
    parser.add_argument("--runs", type=int, default=7, help="rounds; each runs every tree once")
    parser.add_argument("--json", help="write the samples, medians and ratios here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if replay_args and not args.replay:
        parser.error("arguments after -- are for --replay")
    sizes = [int(n) for n in args.active.split(",")]
    refs = [r for r in args.against.split(",") if r]
    given_replay_args = list(replay_args)  # as given, for the JSON (no machine's paths in it)
    # every run's working directory is its own tree: a file named relative to here is named absolutely
    replay_args = [str(Path(a).resolve()) if not a.startswith("-") and Path(a).exists() else a for a in replay_args]

    def shown(metric: str) -> bool:  # printed; the JSON keeps every metric
        return args.phases or metric.startswith(("host", "step_us_per", "wall", "cpu"))

    with checked_out(refs, args.tree, same_benchmark=not args.replay) as trees, tempfile.TemporaryDirectory() as keep:
        for tree in trees:
            check_imports(tree)
        replays: dict[str, dict] = {}
        for round_index in range(args.runs):
            shift = round_index % len(trees)
            for tree in trees[shift:] + trees[:shift]:  # rotated: each tree goes first in turn
                if args.replay:
                    replays[tree.label] = run_replay(tree, replay_args, Path(keep))
                elif args.phases:
                    run_phases(tree, sizes, args.iterations)
                else:
                    run_overhead(tree, sizes, args.iterations, args.clock)
            print(f"round {round_index + 1}/{args.runs}: "
                  + ", ".join(f"{t.label} {', '.join(f'{m}={v[-1]}' for m, v in t.samples.items() if shown(m))}"
                              for t in trees), file=sys.stderr, flush=True)
        table = summarize(trees)
        identical = None
        if args.replay:  # every tree's behaviour against the reference's (the last round's JSONs)
            ref = replays[trees[0].label]
            identical = {t.label: not [d for d in differences(ref, replays[t.label]) if " only in " not in d]
                         for t in trees[1:]}

    def cell(row: dict | None) -> str:  # median (ratio, rounds below the reference)
        if row is None:
            return f"{'-':>26}"
        if row["ratio_to_reference"] is None:
            return f"{row['median']:>26.3f}"
        below = row["rounds_below_reference"]
        rounds = f" {below}/{len(row['samples'])}" if below is not None else ""
        return f"{row['median']:>12.3f} ({row['ratio_to_reference']:.2f}x{rounds})".ljust(26)

    print(f"{'metric':<28}" + "".join(f"{t.label:>26}" for t in trees)
          + "   (median, ratio to the reference, rounds below it)")
    for metric, by_tree in table.items():
        if shown(metric):
            print(f"{metric:<28}" + "".join(cell(by_tree.get(t.label)) for t in trees))
    if identical is not None:
        print("replay_diff against " + trees[0].label + ": "
              + ", ".join(f"{label} {'IDENTICAL' if same else 'DIFFERENT'}" for label, same in identical.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "config": {"benchmark": "replay" if args.replay else "phases" if args.phases else "overhead",
                           "reference": trees[0].label,
                           "trees": [t.label for t in trees], "runs": args.runs,
                           "commits": {t.label: (_git("rev-parse", t.label) if t.label != WORKING_TREE else None) for t in trees},
                           **({"replay_args": given_replay_args} if args.replay
                              else {"active": sizes, "iterations": args.iterations, "clock": args.clock}),
                           "python": sys.version.split()[0], "cpus": os.cpu_count()},
                "results": table,
                **({"replay_identical_to_reference": identical} if identical is not None else {}),
            }, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
