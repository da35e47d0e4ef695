"""Greedy verification on the device, and moving a forward back over rejected drafts.

Under the overlap scheduler a speculative request is in forward n+1 before the host knows what
forward n accepted. The engine knows it on the device, from n's greedy picks and the drafts n
verified (``verification.accept_greedy``'s rule, for a batch at once)::

    request s, drafts d1..dk, targets t0..tk (the pick at its sampling row, then after each draft)
    match_j  = d_(j+1) == t_j                       j < k
    accepted = leading run of matches  (m)          bonus = t_m   run = t_0 .. t_m

and forward n+1, built on the host as if every draft slot were filled with an accepted draft, is
corrected before it runs: the request's first input becomes the bonus token and every one of its
positions moves back by the slots not accepted (``slots - m``; a step whose drafts the engine
proposed may hold fewer drafts than slots, ``device_drafting``), its KV slots and attended
lengths with them, from its block table. The KV that n wrote for rejected drafts sits past the
new positions and is overwritten when the sequence gets there; the host does the same to the
request's tokens when n completes (``completion.CompletionHandler._fill``).

Nothing here waits for the device or reads a value back: the engine launches these few small
kernels between two forwards (or before a graph replay), and the host never learns the
acceptance before ``CudaForward.result()`` brings the picks back as usual.
"""

from __future__ import annotations

import torch

__all__ = ["accept_on_device", "move_back_"]


def accept_on_device(
    tokens: torch.Tensor, target_rows: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of S requests: ``tokens`` (R,) the forward's picks; ``target_rows``
    (S, K+1) int64, each request's target rows in ``tokens`` (padded by repeating its last);
    ``drafts`` (S, K) int64, each request's drafts padded with -1 (no pick is negative, so
    padding never matches). Returns (targets (S, K+1), accepted (S,)): the picks at each
    request's target rows, and how many of its drafts it accepts; its run (the accepted drafts,
    then the token after them) is ``targets[s, :accepted[s] + 1]``."""
    num_requests, width = target_rows.shape
    targets = tokens.index_select(0, target_rows.reshape(-1)).view(num_requests, width)  # (S, K+1)
    matches = (targets[:, :-1] == drafts).to(torch.int32)  # (S, K)
    accepted = matches.cumprod(dim=1).sum(dim=1)  # (S,) the leading run
    return targets, accepted


def move_back_(
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    sequences: torch.Tensor,
    back: torch.Tensor,
    tokens_per_block: int,
) -> None:
    """Move flat ``rows`` (X,) of a forward back by ``back`` (X,) positions, in place: their
    ``positions`` and KV ``slots`` (indexed by flat row), and the attended length in ``seq_lens``
    of their decode ``sequences`` (X,), whose ``block_tables`` (B, W) give the new slots."""
    moved = positions.index_select(0, rows) - back  # (X,)
    positions.index_copy_(0, rows, moved)
    seq_lens.index_copy_(0, sequences, (moved + 1).to(seq_lens.dtype))
    blocks = block_tables.index_select(0, sequences).gather(1, (moved // tokens_per_block)[:, None]).squeeze(1)  # (X,)
    slots.index_copy_(0, rows, blocks.to(torch.int64) * tokens_per_block + moved % tokens_per_block)
