"""The n-gram drafter (prompt lookup; upstream's ``NGram`` decoding mode), on token ids alone.

A request's next tokens are guessed from its own sequence: the longest suffix of at most
``max_matching_ngram_size`` tokens that occurred earlier in the sequence is looked up, and the
tokens that followed its most recent earlier occurrence are proposed::

    tokens:  ... a b c x y z ... p q a b c          suffix "a b c" (n = 3) occurred before
                     └───────┘                       its continuation "x y z ..." is the draft

No second model runs: a wrong guess costs only the positions the target model verified in
vain. Outputs never depend on the drafts (the target's greedy picks decide every token), only
how many tokens one forward yields. Nothing here knows requests or the executor; the executor's
``Drafter`` (``pyexecutor.sampling.drafter``) decides for which requests and how many to propose.

:func:`propose_ngram_drafts` is the reference, on one sequence in numpy. :class:`NGramProposer`
(a ``proposer.DraftProposer``) proposes with it on the host and, for a batch of sequences on
an engine's device, with ``device_drafting.propose_ngram_batch``: the same rule in torch, tested
against this one (the CUDA engine runs it as one Triton kernel, ``triton_drafting``, tested the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    import torch

__all__ = ["NGramProposer", "propose_ngram_drafts"]


def propose_ngram_drafts(tokens: np.ndarray, max_draft_len: int, max_matching_ngram_size: int) -> list[int]:
    """Up to ``max_draft_len`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` (1-D integer array; at most ``max_matching_ngram_size`` long)
    found earlier in it; empty when no suffix of even one token recurs.

    Longer suffixes are tried first: a longer match predicts better. Among occurrences of the
    chosen suffix, the most recent wins (text that repeats tends to repeat its latest form).
    The proposal may be shorter than ``max_draft_len`` where the sequence ends first.
    """
    length = tokens.shape[0]
    if max_draft_len < 1 or length < 2:
        return []
    for n in range(min(max_matching_ngram_size, length - 1), 0, -1):
        suffix = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every occurrence before the suffix itself
        windows = sliding_window_view(tokens[: length - 1], n)  # (length - n, n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the continuation of the latest occurrence
            return tokens[start : start + max_draft_len].tolist()
    return []


@dataclass(frozen=True, slots=True)
class NGramProposer:
    """Prompt lookup as a ``DraftProposer``: up to ``max_draft_len`` drafts from the longest
    recurring suffix of at most ``max_matching_ngram_size`` tokens."""

    max_draft_len: int
    max_matching_ngram_size: int

    def propose(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        return propose_ngram_drafts(tokens, min(max_drafts, self.max_draft_len), self.max_matching_ngram_size)

    def propose_batch(
        self, history: torch.Tensor, lengths: torch.Tensor, room: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # torch only where a batch is drafted on an engine's device: the host's executor, the
        # replay and the simulated engine import none
        from tensorrt_llm._torch.speculative.device_drafting import propose_ngram_batch

        return propose_ngram_batch(history, lengths, room, self.max_draft_len, self.max_matching_ngram_size)
