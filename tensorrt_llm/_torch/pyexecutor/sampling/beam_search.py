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
them from the logits). The request holds :class:`BeamState` (``LlmRequest.py_beams``; the values
a request holds are in :mod:`..beam_state`, so that a request imports no sampler); the executor
applies each :class:`BeamStep` to it, and tells the KV manager which beam each new live beam
descends from (``BeamStep.parents``), so that its block tables follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

# The values a request holds live in a value module (a request imports no sampler); importable here as before.
from tensorrt_llm._torch.pyexecutor.beam_state import (
    EARLY_STOP,
    EARLY_STOP_HEURISTIC,
    EARLY_STOP_NEVER,
    BeamConfig,
    BeamState,
    Hypothesis,
    length_penalized,
    padded,
)

__all__ = [
    "EARLY_STOP", "EARLY_STOP_HEURISTIC", "EARLY_STOP_NEVER", "BeamConfig", "BeamState", "BeamStep", "Candidate",
    "Hypothesis", "advance", "length_penalized",
]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live beam extended by one token: ``parent`` indexes ``BeamState.live``."""

    parent: int
    token: int
    cum_logprob: float


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
    next_live = padded(tuple(live), width)
    parents += [parents[0]] * (width - len(parents))
    results: tuple[Hypothesis, ...] = ()
    if done:
        # Ended by length: the live beams compete with the hypotheses (not after an early stop).
        pool = finished if early else [*finished, *live]
        pool = [h for h in pool if h.cum_logprob > -math.inf]
        ranked = sorted(pool, key=lambda h: h.score(penalty), reverse=True)  # stable: ties keep order
        results = tuple(ranked[: config.num_return_sequences])
    return BeamStep(BeamState(next_live, tuple(finished), done, results), tuple(parents))


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
