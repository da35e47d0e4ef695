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
lengths with them. The host cannot know ``m``, but it knows every value it can take: for each row
it plans the position it gets if none is accepted and the KV slot, from the request's block
table, for each ``m`` (:func:`positions_after_acceptance`); the device picks by ``m``
(:func:`move_back_`: two gathers and three writes, whatever the tables). The KV that n wrote for
rejected drafts sits past the new positions and is overwritten when the sequence gets there; the
host does the same to the request's tokens when n completes (``completion.CompletionHandler._fill``).

Nothing here waits for the device or reads a value back: the engine launches these few small
kernels between two forwards (or before a graph replay), and the host never learns the
acceptance before ``CudaForward.result()`` brings the picks back as usual. These are the torch
forms (any proposer, and the CPU); for the n-gram proposer on CUDA the acceptance and the move
run inside the launch's one Triton kernel (``triton_drafting.complete_in_flight``), by the same
rules, and the tests hold the two to each other.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["accept_on_device", "move_back_", "positions_after_acceptance"]


def accept_on_device(
    tokens: torch.Tensor, target_rows: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of S requests: ``tokens`` (R,) the forward's picks; ``target_rows``
    (S, K+1) int64, each request's target rows in ``tokens`` (padded by repeating its last);
    ``drafts`` (S, K) int64, each request's drafts padded with -1 (no pick is negative, so
    padding never matches). Returns (targets (S, K+1), accepted (S,) int64): the picks at each
    request's target rows, and how many of its drafts it accepts; its run (the accepted drafts,
    then the token after them) is ``targets[s, :accepted[s] + 1]``."""
    num_requests, width = target_rows.shape
    targets = tokens.index_select(0, target_rows.reshape(-1)).view(num_requests, width)  # (S, K+1)
    accepted = (targets[:, :-1] == drafts).cumprod(dim=1).sum(dim=1)  # (S,) the leading run of matches
    return targets, accepted


def positions_after_acceptance(
    built: Sequence[int], slots: int, table: Sequence[int], width: int, tokens_per_block: int
) -> tuple[list[int], list[int]]:
    """On the host, for the rows of one request laid out as if the forward before accepted all
    ``slots`` of its drafts (``built``: their positions then): each row's position if it accepts
    none, and, row after row, its KV slot for each count ``a`` in ``0 .. width - 1`` it may accept
    (``width`` > ``slots``; past the row's own slots, the slot as built), read through its block
    ``table``. Plain Python: a request has a few rows, where a NumPy call apiece would cost more
    than the values."""
    base, candidates = [], []
    for position in built:
        first = position - slots
        base.append(first)
        for at in range(first, first + width):
            at = min(at, position)
            candidates.append(table[at // tokens_per_block] * tokens_per_block + at % tokens_per_block)
    return base, candidates


def move_back_(
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    sequences: torch.Tensor,
    base: torch.Tensor,
    candidates: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Move flat ``rows`` (X,) of a forward to where ``accepted`` (X,) drafts of the forward
    before leave them, in place: their ``positions`` and KV ``slots`` (indexed by flat row) and
    the attended length in ``seq_lens`` of their decode ``sequences`` (X,). ``base`` (X,),
    ``candidates`` (X, width): :func:`positions_after_acceptance`'s, row by row."""
    moved = base + accepted  # (X,)
    positions.index_copy_(0, rows, moved)
    seq_lens.index_copy_(0, sequences, (moved + 1).to(seq_lens.dtype))
    slots.index_copy_(0, rows, candidates.gather(1, accepted[:, None]).view(-1))
