"""The replay: a request trace through the executor under each token-budget policy.

``python -m benchmarks.replay`` runs the CLI (:mod:`benchmarks.replay.cli`; its flags and JSON
are the contract of docs/design.md §5). The modules, lowest first:

* ``traces``: trace files (Mooncake, Azure, the project's own) and synthetic requests;
  ``scenario``: the built-in default scenario;
* ``cost_model``: a forward's time from its shape (roofline, fitted to ``benchmarks/calibration/``);
  ``tp_cost_model``: a tensor-parallel rank's share; ``sim_engine``: the engines a replay runs;
* ``settings``: the replay's settings; ``diagnosis``: which mechanism an overshoot came from;
* ``loop``: one policy's replay; ``report``: the table, the JSON and the plot;
* ``ranks``: the replay on several ranks; ``priority``: the priority mix;
* ``cli``: the trace spec and the command line; ``diff``: do two replays' JSONs agree.

The CLI's public names (``TraceSpec``, ``replay_trace``, ``run_replay``, ``ReplaySettings``,
``build_parser``, ...) are importable from this package as before; they load on first use, so
that ``python -m benchmarks.replay.cost_model`` or an import of ``benchmarks.replay.traces``
does not load the whole CLI.
"""

from __future__ import annotations

import importlib

_FROM_CLI = frozenset({
    "POLICIES", "KNOWN_POLICIES", "TraceSpec", "ReplaySettings", "replay_trace", "run_replay", "replay_policy",
    "replay_on_ranks", "build_parser", "parse_args", "settings_from_args", "rank_layout", "main",
})


def __getattr__(name: str):
    if name not in _FROM_CLI:
        raise AttributeError(f"module 'benchmarks.replay' has no attribute {name!r}")
    return getattr(importlib.import_module("benchmarks.replay.cli"), name)
