"""The routers' decisions, as values: which replicas a request may go to, best first.

Each function takes the candidates, what is known of them and a random source, and returns
ranked groups of replica ids (Ray Serve's ``choose_replicas`` contract: the router tries the
first group, within a group the replica with the shortest queue that accepts, then the next
group). Nothing here imports Ray; ``routers`` wraps these in Ray Serve's ``RequestRouter``.

Prefix-aware rule (:func:`prefix_aware_choice`):

1. The load bound. ``load`` is the requests in flight on each replica (routed and not
   completed). A replica is *eligible* unless its load exceeds the least-loaded candidate's by
   more than ``max_load_gap``, or has reached ``max_in_flight`` (when set). If no candidate is
   eligible (all at ``max_in_flight``), the least-loaded ones are.
2. Among the eligible, the replicas with the longest cached prefix of the request
   (``matched`` blocks, from the KV events), if that is at least ``min_match_blocks``, form the
   first group: a hot prefix fills its replica only up to the bound, then spills to the others
   (which cache it in turn).
3. Otherwise, and as the fallback group after (2): power of two choices, Ray Serve's default,
   over the eligible (two at random; Ray Serve sends to the shorter queue).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True, slots=True)
class LoadBound:
    """How far the prefix-aware router lets load drift to follow a cached prefix."""

    max_load_gap: int = 4  # a replica with more in flight than the least-loaded one plus this is skipped
    max_in_flight: int | None = None  # a replica with this many requests in flight is skipped; None: no cap
    min_match_blocks: int = 1  # a cached prefix shorter than this (in blocks) does not steer the request

    def __post_init__(self) -> None:
        if isinstance(self.max_load_gap, bool) or not isinstance(self.max_load_gap, int) or self.max_load_gap < 0:
            raise ValueError(f"max_load_gap must be an integer >= 0, got {self.max_load_gap!r}")
        if self.max_in_flight is not None and (isinstance(self.max_in_flight, bool)
                                               or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1):
            raise ValueError(f"max_in_flight must be None or an integer >= 1, got {self.max_in_flight!r}")
        if isinstance(self.min_match_blocks, bool) or not isinstance(self.min_match_blocks, int) \
                or self.min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be an integer >= 1, got {self.min_match_blocks!r}")


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Ranked groups of replica ids, and why (``prefix``: the first group holds the longest cached
    prefix; ``balance``: power of two choices; ``round_robin``)."""

    ranked: list[list[str]]
    reason: str
    matched_blocks: int = 0  # the first group's cached prefix, in blocks


def eligible_replicas(candidates: Sequence[str], load: Mapping[str, int], bound: LoadBound) -> list[str]:
    """Step 1 of the rule: the candidates within the load bound (never none, given candidates)."""
    loads = {c: load.get(c, 0) for c in candidates}
    if not loads:
        return []
    least = min(loads.values())
    eligible = [c for c, n in loads.items() if n - least <= bound.max_load_gap
                and (bound.max_in_flight is None or n < bound.max_in_flight)]
    return eligible or [c for c, n in loads.items() if n == least]


def power_of_two(candidates: Sequence[str], rng: random.Random) -> list[str]:
    """Two candidates at random (all of them when fewer): the group Ray Serve's power-of-two router returns."""
    return list(candidates) if len(candidates) <= 2 else rng.sample(list(candidates), 2)


def prefix_aware_choice(candidates: Sequence[str], matched: Mapping[str, int], load: Mapping[str, int],
                        bound: LoadBound, rng: random.Random) -> RoutingDecision:
    """The rule of the module docstring. ``matched``: each candidate's cached prefix in blocks
    (absent: 0); ``load``: each one's requests in flight (absent: 0)."""
    eligible = eligible_replicas(candidates, load, bound)
    if not eligible:
        return RoutingDecision([], "balance")
    best = max(matched.get(c, 0) for c in eligible)
    if best < bound.min_match_blocks:
        return RoutingDecision([power_of_two(eligible, rng)], "balance")
    holders = [c for c in eligible if matched.get(c, 0) == best]
    rest = [c for c in eligible if c not in holders]
    ranked = [holders] + ([power_of_two(rest, rng)] if rest else [])
    return RoutingDecision(ranked, "prefix", best)


def round_robin_choice(candidates: Sequence[str], turn: int) -> RoutingDecision:
    """The ``turn``-th replica in id order, then the others (a replica whose queue is full is skipped)."""
    ordered = sorted(candidates)
    if not ordered:
        return RoutingDecision([], "round_robin")
    first = ordered[turn % len(ordered)]
    rest = [c for c in ordered if c != first]
    return RoutingDecision([[first]] + ([rest] if rest else []), "round_robin")
