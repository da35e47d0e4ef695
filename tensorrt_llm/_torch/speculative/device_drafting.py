"""Drafting on the engine's device, from the tokens the model produced, for forwards built in flight.

Under the overlap scheduler a speculative request is in forward n+1 before forward n's tokens
reach the host. Drafting n+1 on the host from the request's tokens would have to guess n's
(the drafts n verifies, as if all accepted); after one wrong guess every later draft continues
it, and acceptance collapses. So the host only reserves n+1's draft slots (placeholders) and the
engine fills them when n+1 is launched, from tokens that are real::

    host      tokens  ... t  | P P P P        known: everything up to t; n's tokens in flight
              TokenHistories.place: which row is the request's, and the tokens the device does not
              have yet (a new request's whole sequence once, then the few n-1 produced, which the
              device appended already: the same values); shipped in the launch's one array
    device    the uploads, then n's accepted run (its accepted drafts, then the bonus; one token
              without drafts: engine.in_flight.DevicePicks) appended ─► the request's real history
              the proposal over it ─► n+1's drafts, into its draft slots

The host learns which drafts n+1 verified when n+1 completes: they come back with its tokens.

Two forms of the device side, the same drafts: for the n-gram proposer on CUDA, one Triton kernel
does all of it (``triton_drafting``); for any proposer, and on the CPU, torch does it in steps
(:meth:`TokenHistories.write` of the uploads and of the run, :meth:`TokenHistories.gather`, then
``DraftProposer.propose_batch``; for n-gram lookup :func:`propose_ngram_batch`,
``ngram.propose_ngram_drafts`` for a batch of sequences in a fixed number of torch kernels without
reading anything back: the tests hold it to the numpy reference). :class:`TokenHistories` keeps
each drafting request's tokens in a row of one device buffer; which row is whose, and how much of
each the device has, is host bookkeeping.
"""

from __future__ import annotations

from array import array
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
    """Where a launch's drafting requests' histories are, and what the host writes into them first:
    request ``e`` gets ``upload_count[e]`` tokens from column ``upload_start[e]`` of its row, the
    next ones of ``upload_tokens`` (entry after entry)."""

    rows: np.ndarray  # (E,) int64 each request's row
    upload_start: np.ndarray  # (E,) int64 first column the host writes
    upload_count: np.ndarray  # (E,) int64 tokens it writes there
    upload_tokens: np.ndarray  # (U,) int64 those tokens, entry after entry

    def upload_index(self, width: int) -> np.ndarray:
        """The flat positions (row * ``width`` + column) of ``upload_tokens``, (U,) int64."""
        counts = self.upload_count
        before = np.cumsum(counts) - counts  # each entry's first token in upload_tokens
        return np.repeat(self.rows * width + self.upload_start - before, counts) + np.arange(int(counts.sum()))


class TokenHistories:
    """Each drafting request's tokens, one row per request of a (rows, ``width``) int32 buffer on
    ``device``.

    Row ``r`` of request ``x`` holds ``x``'s tokens from position 0 up to what the host uploaded
    (``place``) or the device appended after it; past that, anything. The host remembers, per
    request, its row and how many of its tokens it uploaded: at each launch it uploads only the
    ones it learnt since (the few the forward before produced, which the device appended already:
    the same values). A request whose tokens may have changed (it starts over as context) is
    forgotten and uploaded whole again. Rows are reused in least-recently-placed order among
    requests not in the current launch, and the buffer grows (doubling) only when one launch
    needs more rows than it has. The buffer is written on the device by whoever drafts
    (``torch_engine``'s in-flight step, or ``triton_drafting``'s kernel): this class keeps the host's
    side and the torch forms of its writes.
    """

    def __init__(self, device: torch.device | str, width: int, rows: int = 8) -> None:
        self.width = width
        self.tokens = torch.zeros((max(1, rows), width), dtype=torch.int32, device=device)
        self._placed: dict[int, list[int]] = {}  # request id -> [row, tokens uploaded]; oldest first
        self._free = list(range(self.tokens.shape[0] - 1, -1, -1))  # rows nobody holds (popped from the end)

    def forget(self, request_id: int) -> None:
        """``request_id``'s tokens are to be uploaded whole at its next placement."""
        entry = self._placed.pop(request_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def place(self, request_ids: Sequence[int], sequences: Sequence[Sequence[int]], known: Sequence[int]) -> HistoryPlacement:
        """Rows for these requests (distinct ids), and the uploads that bring each row up to its
        ``known`` first tokens of ``sequences`` (what the host has; the device appends the rest).
        The usual launch uploads a few tokens per request: one dict lookup and one slice each."""
        placed = self._placed
        count = len(request_ids)
        rows = np.empty(count, dtype=np.int64)
        start = np.zeros(count, dtype=np.int64)
        length = np.zeros(count, dtype=np.int64)
        tokens = array("q")
        current: set[int] | None = None  # the launch's ids, made only if a row must be taken back
        for i, (request_id, sequence, known_len) in enumerate(zip(request_ids, sequences, known)):
            entry = placed.pop(request_id, None)
            if entry is None:
                if not self._free and current is None:
                    current = set(request_ids)
                entry = [self._free_row(current), 0]
            elif entry[1] > known_len:  # fewer tokens than it uploaded: they changed, upload them whole
                entry[1] = 0
            uploaded = entry[1]
            if uploaded < known_len:
                start[i] = uploaded
                length[i] = known_len - uploaded
                tokens.extend(sequence[uploaded:known_len])
                entry[1] = known_len
            placed[request_id] = entry  # newest last
            rows[i] = entry[0]
        return HistoryPlacement(rows, start, length, np.frombuffer(tokens, dtype=np.int64) if tokens else _NO_TOKENS)

    def _free_row(self, current: set[int] | None) -> int:
        """A row nobody holds, else the oldest one held by a request outside ``current``, else a new one."""
        if self._free:
            return self._free.pop()
        for request_id, (row, _) in self._placed.items():
            if request_id not in current:
                del self._placed[request_id]
                return row
        rows = self.tokens.shape[0]
        self.tokens = torch.cat((self.tokens, torch.zeros_like(self.tokens)))
        self._free = list(range(2 * rows - 1, rows, -1))
        return rows

    def write(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """On the device: ``tokens`` (any integer dtype) at the flat positions ``index`` (the
        placement's uploads: ``HistoryPlacement.upload_index``; or a run to append)."""
        self.tokens.view(-1).index_copy_(0, index.reshape(-1), tokens.reshape(-1).to(torch.int32))

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The rows' first ``width`` columns, (E, width) int64 (what ``propose_batch`` reads)."""
        return self.tokens[:, :width].index_select(0, rows).to(torch.int64)


_NO_TOKENS = np.empty(0, dtype=np.int64)
