"""Drafting on the engine's device, from the tokens the model produced, for forwards built in flight.

Under the overlap scheduler a speculative request is in forward n+1 before forward n's tokens
reach the host. Drafting n+1 on the host from the request's tokens would have to guess n's
(the drafts n verifies, as if all accepted); after one wrong guess every later draft continues
it, and acceptance collapses. So the host only reserves n+1's draft slots (placeholders) and the
engine fills them when n+1 is launched, from tokens that are real::

    host      tokens  ... t  | P P P P        known: everything up to t; n's tokens in flight
              uploads the tokens the device does not have yet (TokenHistories.place: a new
              request's whole sequence once, then the few tokens of the forward before n)
    device    n's accepted run (its accepted drafts, then the bonus; one token without drafts,
              device_verification) appended after them ─► the request's real history
              propose_ngram_batch(history, lengths, room) ─► n+1's drafts, into its draft slots

The host learns which drafts n+1 verified when n+1 completes: they come back with its tokens.

:func:`propose_ngram_batch` is ``ngram.propose_ngram_drafts`` for a batch of sequences, in a
fixed number of torch kernels and without reading anything back (the tests hold it to the numpy
reference). :class:`TokenHistories` keeps each drafting request's tokens in a row of one device
buffer; which row is whose, and how much of each the device has, is host bookkeeping.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

__all__ = ["HistoryPlacement", "TokenHistories", "propose_ngram_batch"]


def propose_ngram_batch(
    history: torch.Tensor, lengths: torch.Tensor, room: torch.Tensor, max_draft_len: int, max_matching_ngram_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``propose_ngram_drafts`` for each row of ``history`` (S, L) int64 holding ``lengths[s]``
    tokens (then anything), at most ``room[s]`` drafts each. Returns ``(drafts, counts)``:
    (S, max_draft_len) int64 with -1 past each row's count, and (S,) int64.

    The reference tries suffix sizes n from the largest down and takes the latest window equal to
    the row's last n tokens that ends before its last token. The same in one pass: for every
    position e, ``run[e]`` counts how many tokens up to e equal the row's last tokens, backwards
    (capped at N = ``max_matching_ngram_size``); a window of n tokens ending at e matches iff
    ``run[e] >= n``. The largest run among positions ``e <= length - 2`` is the n the reference
    finds, its latest position the window it takes, and the drafts start right after it::

        row    1 2 3 7 8 9 1 2 3      length 9, last tokens (backwards) 3 2 1
        run    0 0 3 0 0 0 0 0 .      e = 2 ends "1 2 3": n = 3, drafts from e + 1 = 3: 7 8 9

    A fixed number of kernels (about 4N + 20) whatever the lengths, and nothing read back.
    """
    num_rows, width = history.shape
    device = history.device
    n_max = max_matching_ngram_size
    lengths = lengths.to(torch.int64)
    # padding before the row (-1, never a token) so that position e - j exists for every j < N
    padded = torch.nn.functional.pad(history, (n_max, 0), value=-1)  # (S, N + L)
    back = torch.arange(n_max, device=device)  # j: the row's j-th token from the end
    last = padded.gather(1, n_max + lengths[:, None] - 1 - back)  # (S, N)
    last = last.masked_fill(back[None, :] >= lengths[:, None], -2)  # past the row's start: matches nothing
    run = torch.zeros((num_rows, width), dtype=torch.int64, device=device)
    matching = torch.ones((num_rows, width), dtype=torch.bool, device=device)
    for j in range(n_max):
        matching &= padded[:, n_max - j : n_max - j + width] == last[:, j : j + 1]  # token e - j is the j-th from the end
        run += matching
    position = torch.arange(width, device=device)
    run = torch.where(position[None, :] <= lengths[:, None] - 2, run, 0)  # windows end before the last token
    best = run.amax(dim=1)  # (S,) the longest matching suffix, 0: none
    end = torch.where((run == best[:, None]) & (best[:, None] > 0), position[None, :], -1).amax(dim=1)  # (S,)
    start = end + 1
    columns = start[:, None] + torch.arange(max_draft_len, device=device)  # (S, K)
    valid = (end[:, None] >= 0) & (columns < lengths[:, None]) & (columns - start[:, None] < room[:, None])
    drafts = history.gather(1, columns.clamp(max=width - 1))
    drafts = torch.where(valid, drafts, -1)
    return drafts, valid.sum(dim=1)


class HistoryPlacement(NamedTuple):
    """Where a launch's drafting requests' histories are, and what the host uploads first."""

    rows: np.ndarray  # (E,) int64 each request's row
    upload_index: np.ndarray  # (U,) int64 flat positions (row * width + column) the host writes
    upload_tokens: np.ndarray  # (U,) int32 the tokens written there


class TokenHistories:
    """Each drafting request's tokens, one row per request of a (rows, ``width``) int32 buffer on
    ``device``.

    Row ``r`` of request ``x`` holds ``x``'s tokens from position 0 up to what the host uploaded
    (``place``) or the device appended after it (``append``); past that, anything. The host
    remembers, per request, its row and how many of its tokens it uploaded. A request whose
    tokens may have changed (it starts over as context) is forgotten and uploaded whole again.
    Rows are reused in least-recently-placed order among requests not in the current launch,
    and the buffer grows (doubling) only when one launch needs more rows than it has.
    """

    def __init__(self, device: torch.device | str, width: int, rows: int = 8) -> None:
        self.width = width
        self.tokens = torch.zeros((max(1, rows), width), dtype=torch.int32, device=device)
        self._placed: dict[int, list[int]] = {}  # request id -> [row, tokens uploaded]; oldest first

    def forget(self, request_id: int) -> None:
        """``request_id``'s tokens are to be uploaded whole at its next placement."""
        self._placed.pop(request_id, None)

    def place(self, request_ids: Sequence[int], sequences: Sequence[Sequence[int]], known: Sequence[int]) -> HistoryPlacement:
        """Rows for these requests (distinct ids), and the uploads that bring each row up to its
        ``known`` first tokens of ``sequences`` (what the host has; the device appends the rest)."""
        placed = self._placed
        rows = np.empty(len(request_ids), dtype=np.int64)
        index: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        current = set(request_ids)
        for i, (request_id, sequence, length) in enumerate(zip(request_ids, sequences, known)):
            entry = placed.pop(request_id, None)
            if entry is None or entry[1] > length:
                entry = [self._free_row(current), 0]
            row, uploaded = entry
            if uploaded < length:
                index.append(row * self.width + np.arange(uploaded, length, dtype=np.int64))
                tokens.append(np.asarray(sequence[uploaded:length], dtype=np.int32))
                entry[1] = length
            placed[request_id] = entry  # newest last
            rows[i] = row
        if not index:
            return HistoryPlacement(rows, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32))
        return HistoryPlacement(rows, np.concatenate(index), np.concatenate(tokens))

    def _free_row(self, current: set[int]) -> int:
        """A row nobody holds, else the oldest one held by a request outside ``current``, else a new one."""
        used = {row for row, _ in self._placed.values()}
        if len(used) < self.tokens.shape[0]:
            return next(row for row in range(self.tokens.shape[0]) if row not in used)
        for request_id, (row, _) in self._placed.items():
            if request_id not in current:
                del self._placed[request_id]
                return row
        grown = torch.zeros_like(self.tokens)
        row = self.tokens.shape[0]
        self.tokens = torch.cat((self.tokens, grown))
        return row

    def upload(self, placement: HistoryPlacement, to_device) -> None:
        """Write the placement's uploads (``to_device``: how a host array reaches the device)."""
        if placement.upload_index.size:
            self.tokens.view(-1).index_copy_(0, to_device(placement.upload_index), to_device(placement.upload_tokens))

    def append(self, rows: torch.Tensor, known: torch.Tensor, runs: torch.Tensor, run_lengths: torch.Tensor) -> torch.Tensor:
        """On the device: row ``rows[e]`` gets ``runs[e, :run_lengths[e]]`` at ``known[e]``
        (columns past the run get its padding, past the row's end: never read). Returns the rows'
        lengths, ``known + run_lengths``. ``known`` + the run width must stay within ``width``."""
        width = runs.shape[1]
        columns = known[:, None] + torch.arange(width, device=known.device)  # (E, W)
        flat = rows[:, None] * self.width + columns
        self.tokens.view(-1).index_copy_(0, flat.reshape(-1), runs.reshape(-1).to(torch.int32))
        return known + run_lengths

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The rows' first ``width`` columns, (E, width) int64 (what ``propose_batch`` reads)."""
        return self.tokens.index_select(0, rows)[:, :width].to(torch.int64)
