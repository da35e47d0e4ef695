"""Do two replay JSONs report the same behaviour? Everything but wall-clock time must match.

A speed-up of the executor must not change a single decision: replay the same trace before
and after it (``python -m benchmarks.replay ... --json OUT.json``) and compare::

    python -m benchmarks.replay.diff BEFORE.json AFTER.json

Exit status 0 when every policy present in both files has the same metrics (``wall_s``
left out), 1 otherwise, with one line per differing metric. Policies in only one file are
named and skipped, and so are metrics in only one file (a newer replay reports more, e.g.
``errors``); ``budget_utilization_before_crash`` is compared only when both files hold the same
policies (it is taken over the forwards before the first crash among them).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

TIMING_KEYS = frozenset({"wall_s"})
_CROSS_POLICY_KEYS = frozenset({"budget_utilization_before_crash"})


def differences(before: dict, after: dict) -> list[str]:
    """One line per metric that differs between two replay JSONs (``results`` by policy)."""
    a, b = before["results"], after["results"]
    ignored = TIMING_KEYS if set(a) == set(b) else TIMING_KEYS | _CROSS_POLICY_KEYS
    lines = [f"{policy}: only in {'before' if policy in a else 'after'}" for policy in sorted(set(a) ^ set(b))]
    for policy in (p for p in a if p in b):
        lines += [f"{policy} {key}: only in {'before' if key in a[policy] else 'after'}"
                  for key in sorted((set(a[policy]) ^ set(b[policy])) - ignored)]
        for key in sorted((set(a[policy]) & set(b[policy])) - ignored):
            if a[policy][key] != b[policy][key]:
                lines.append(f"{policy} {key}: {a[policy][key]!r} != {b[policy][key]!r}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="replay JSON before the change")
    parser.add_argument("after", help="replay JSON after the change")
    args = parser.parse_args(argv)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    lines = differences(before, after)
    different = [line for line in lines if " only in " not in line]
    for line in lines:
        print(line)
    common = [p for p in before["results"] if p in after["results"]]
    print(("DIFFERENT" if different else "IDENTICAL") + f" ({', '.join(common)}; wall time ignored)")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
