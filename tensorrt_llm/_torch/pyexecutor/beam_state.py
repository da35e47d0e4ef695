"""A beam search's values: what a request asks for (:class:`BeamConfig`) and the beams it holds
between steps (:class:`BeamState`, ``LlmRequest.py_beams``).

These are values a request carries, so they live beside ``llm_request`` and import nothing of
the executor. The step that takes the beams one token further (``advance``, ``BeamStep``) and
the search's rules are in :mod:`.sampling.beam_search`, which re-exports everything here.

A beam's *score* is upstream's: its cumulative log-probability divided by
``length ** length_penalty`` (:func:`length_penalized`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: ``early_stopping`` values (upstream's integer encoding of HuggingFace's True / False / "never").
EARLY_STOP_HEURISTIC, EARLY_STOP, EARLY_STOP_NEVER = 0, 1, 2


def length_penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Upstream's score: ``cum_logprob / length ** length_penalty`` (unchanged for a penalty of 0 or one token)."""
    if length_penalty == 0.0 or length == 1:
        return cum_logprob
    return cum_logprob / length**length_penalty


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """One beam: the tokens it generated (after the prompt) and their cumulative log-probability.
    ``finished``: it ended on an end token (kept, as the stop rule keeps it)."""

    tokens: tuple[int, ...]
    cum_logprob: float
    finished: bool = False

    def score(self, length_penalty: float) -> float:
        return length_penalized(self.cum_logprob, len(self.tokens), length_penalty)


@dataclass(frozen=True, slots=True)
class BeamConfig:
    """What a beam-search request asks for. ``beam_width`` W (>= 2), ``num_return_sequences`` (1..W)."""

    beam_width: int
    length_penalty: float = 0.0
    early_stopping: int = EARLY_STOP
    num_return_sequences: int = 1


@dataclass(frozen=True, slots=True)
class BeamState:
    """A request's beams between steps.

    ``live``: exactly W beams, best first, all of one length (the next forward computes one
    position per beam). Where fewer than W continuations exist (a tiny vocabulary, the first
    step), the rest are *padding*: copies of the best live beam at ``-inf``, which no candidate
    ever comes from (upstream initialises beams 1..W-1 the same way). ``finished``: the kept
    hypotheses (at most W). ``done``: the search is over; ``results`` then holds the answer.
    """

    live: tuple[Hypothesis, ...]
    finished: tuple[Hypothesis, ...] = ()
    done: bool = False
    results: tuple[Hypothesis, ...] = ()

    @staticmethod
    def start(beam_width: int) -> "BeamState":
        """Before the first token: one empty beam (the prompt), padded to ``beam_width``."""
        return BeamState(padded((Hypothesis((), 0.0),), beam_width))

    @property
    def num_live(self) -> int:
        """Live beams that are not padding (the candidates come from these)."""
        return sum(1 for h in self.live if h.cum_logprob > -math.inf)

    @property
    def length(self) -> int:
        """Tokens each live beam has generated."""
        return len(self.live[0].tokens)

    def last_tokens(self) -> list[int]:
        """Each live beam's newest token: the next forward's input, one position per beam."""
        return [h.tokens[-1] for h in self.live]


def padded(live: tuple[Hypothesis, ...], width: int) -> tuple[Hypothesis, ...]:
    """``live`` padded to ``width`` beams with copies of its best at ``-inf`` (see :class:`BeamState`)."""
    pad = Hypothesis(live[0].tokens, -math.inf)
    return live + (pad,) * (width - len(live))
