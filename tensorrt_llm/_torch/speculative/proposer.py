"""``DraftProposer``: what guesses a request's next tokens from the tokens it has produced.

The executor's ``Drafter`` decides who speculates and how many drafts each step may verify; a
proposer only guesses. It is asked in two places, always with tokens the model produced (never
with drafts that are not verified yet)::

    host      Drafter.prepare_draft_tokens, a request whose tokens are all known:
              propose(tokens, max_drafts)                      one sequence, numpy
    engine    a forward built while the request's previous forward is still in flight (overlap):
              the engine appends what that forward produced to the request's history and calls
              propose_batch(history, lengths, room)            a batch of sequences, torch,
                                                               on the engine's device, no host sync

Both must propose the same drafts for the same tokens (``ngram.NGramProposer``'s two forms are
tested against each other), so a request's drafts never depend on where they were made. The CUDA
engine runs the n-gram proposer's batch form as one fused kernel (``triton_drafting``: the history
update and the proposal in one launch), held to the same reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["DraftProposer"]


class DraftProposer(Protocol):
    """Guesses up to ``max_draft_len`` tokens that follow a sequence."""

    max_draft_len: int

    def propose(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` guesses of the tokens after ``tokens`` (1-D int64, all known)."""
        ...

    def propose_batch(
        self, history: torch.Tensor, lengths: torch.Tensor, room: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for ``S`` sequences at once: ``history`` (S, L) int64 (row ``s`` holds its
        ``lengths[s]`` tokens, then anything), ``room`` (S,) int64 the most drafts each may get.
        Returns ``(drafts, counts)``: (S, max_draft_len) int64, -1 past each row's count, and
        (S,) int64. Runs on ``history``'s device and reads nothing back to the host."""
        ...
