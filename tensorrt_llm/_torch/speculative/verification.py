"""Greedy verification: which drafts the target model accepts, and the token it adds.

One forward of the target computes, at the newest token and at each draft position, the token
greedy decoding would pick there (``targets``, ``1 + len(drafts)`` of them). Draft ``i`` is
accepted while every draft before it was and it equals ``targets[i]``; the target's own pick
after the last accepted draft (the *bonus* token) is always kept. The tokens returned are
therefore exactly the next ``accepted + 1`` tokens of plain greedy decoding, whatever the drafts:
speculation changes how many tokens a forward yields, never which.
"""

from __future__ import annotations

from typing import Sequence


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to append: the accepted drafts, then the bonus token (1 to ``len(drafts) + 1``).

    ``targets[i]`` is the target's greedy pick after the newest token and the first ``i`` drafts;
    ``len(targets)`` must be ``len(drafts) + 1``.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target picks, got {len(targets)}")
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        accepted += 1
    return list(targets[: accepted + 1])
