"""Beam search as values: one request's beams, and the step that takes them one token further.

Upstream's semantics (the TensorRT-LLM beam-search kernels, as HuggingFace's ``BeamSearchScorer``):

* a beam's *cumulative log-probability* is the sum of the model's log-softmax at each token it
  generated; its *score* divides that by ``length ** length_penalty`` (``length``: generated
  tokens, an end token included; ``length_penalty`` 0, the default, or ``length`` 1: no division);
* each step takes the ``2 * W`` best (beam, token) candidates over every live beam (``W`` the
  beam width) by cumulative log-probability, best first. A candidate among the first ``W`` whose
  token ends a sequence (``end_id`` or a stop token) becomes a *finished hypothesis*; one past
  the first ``W`` that ends is dropped; the others continue as the next live beams, until there
  are ``W`` of them. At most ``W`` hypotheses are kept: a better one replaces the worst; a worse
  one is dropped, and with ``early_stopping`` 1 the step stops looking;
* the search is over when ``W`` hypotheses are kept and, with ``early_stopping`` 1 (the default),
  at once; with 0, once no live beam can score better than the worst hypothesis (the best
  candidate's log-probability at the current length); with 2 ("never") and ``length_penalty``
  > 0, at the longest length. It is also over at ``max_new_tokens``: then the live beams compete
  with the hypotheses (not when the search ended early);
* the result is the ``num_return_sequences`` best of them by score.

Nothing here imports torch: :func:`advance` takes candidates already ranked (the sampler computes
them from the logits). The request holds :class:`BeamState` (``LlmRequest.py_beams``); the
executor applies each :class:`BeamStep` to it, and tells the KV manager which beam each new live
beam descends from (``BeamStep.parents``), so that its block tables follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

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
class Candidate:
    """A live beam extended by one token: ``parent`` indexes ``BeamState.live``."""

    parent: int
    token: int
    cum_logprob: float


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
        return BeamState(_padded((Hypothesis((), 0.0),), beam_width))

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


@dataclass(frozen=True, slots=True)
class BeamStep:
    """The outcome of one step: the new state, and the beam of the old state each new live beam
    continues (``parents[j]``: new beam ``j``'s parent; its KV is the parent's, plus this step's)."""

    state: BeamState
    parents: tuple[int, ...]


def advance(
    state: BeamState,
    candidates: Sequence[Candidate],
    config: BeamConfig,
    ends: Callable[[int], bool],
    max_new_tokens: int,
) -> BeamStep:
    """Take one step (see the module docstring).

    ``candidates``: the best ``2 * W`` continuations of the live beams (fewer where fewer exist),
    by cumulative log-probability, best first, none at ``-inf``. ``ends(token)``: whether a token
    ends a sequence. ``max_new_tokens``: the length at which the search stops.
    """
    width, penalty = config.beam_width, config.length_penalty
    live: list[Hypothesis] = []
    parents: list[int] = []
    finished = list(state.finished)
    for rank, candidate in enumerate(candidates):
        parent = state.live[candidate.parent]
        tokens = (*parent.tokens, candidate.token)
        if ends(candidate.token):
            if rank >= width:
                continue  # only the W best candidates may finish
            hypothesis = Hypothesis(tokens, candidate.cum_logprob, finished=True)
            if len(finished) == width:
                scores = [h.score(penalty) for h in finished]
                worst = min(scores)
                if hypothesis.score(penalty) < worst:
                    if config.early_stopping:
                        break  # enough hypotheses, and this one is worse: the search is over
                    continue
                del finished[scores.index(worst)]
            finished.append(hypothesis)
        else:
            live.append(Hypothesis(tokens, candidate.cum_logprob))
            parents.append(candidate.parent)
        if len(live) >= width:
            break
    length = state.length + 1
    early = _stops_early(finished, candidates, config, length, max_new_tokens)
    done = early or length >= max_new_tokens or not live
    if not live:  # every continuation ended: keep the shape, nothing runs again
        live, parents = [Hypothesis(state.live[0].tokens + (0,), -math.inf)], [0]
    padded = _padded(tuple(live), width)
    parents += [parents[0]] * (width - len(parents))
    results: tuple[Hypothesis, ...] = ()
    if done:
        # Ended by length: the live beams compete with the hypotheses (not after an early stop).
        pool = finished if early else [*finished, *live]
        pool = [h for h in pool if h.cum_logprob > -math.inf]
        ranked = sorted(pool, key=lambda h: h.score(penalty), reverse=True)  # stable: ties keep order
        results = tuple(ranked[: config.num_return_sequences])
    return BeamStep(BeamState(padded, tuple(finished), done, results), tuple(parents))


def _stops_early(
    finished: list[Hypothesis], candidates: Sequence[Candidate], config: BeamConfig, length: int, max_new_tokens: int
) -> bool:
    """Whether W kept hypotheses end the search before ``max_new_tokens`` (``early_stopping``)."""
    if len(finished) < config.beam_width:
        return False
    if config.early_stopping == EARLY_STOP:
        return True
    penalty = config.length_penalty
    if config.early_stopping != EARLY_STOP_HEURISTIC and penalty > 0:
        length = max_new_tokens  # "never": a longer beam could still score better, up to the longest
    best = candidates[0].cum_logprob if candidates else -math.inf
    return min(h.score(penalty) for h in finished) >= length_penalized(best, length, penalty)


def _padded(live: tuple[Hypothesis, ...], width: int) -> tuple[Hypothesis, ...]:
    pad = Hypothesis(live[0].tokens, -math.inf)
    return live + (pad,) * (width - len(live))
