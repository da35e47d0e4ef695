"""The n-gram drafts of a launch's steps built in flight, in one Triton kernel.

``device_drafting.propose_ngram_batch`` states the rule in torch: some thirty kernels, each
launched from Python, plus the history's upload, append and gather around them. A step of a
small model is host-bound, so on the GPU those launches cost more than the forward they serve.
This kernel does the whole of it in one launch, one program per request::

    1. its row of the token histories gets the tokens the host uploads (columns [start, start + count))
       and the previous launch's run (the accepted drafts, then the token after them) at ``known``
    2. its length: known + run length; its last N tokens, backwards
    3. every position e <= length - 2: how many tokens up to e equal the last ones, backwards
       (at most N); the largest count wins, then the latest e (``propose_ngram_drafts``' choice)
    4. drafts: the tokens after e, at most ``room`` and ``K``, -1 past the count; written to the
       drafts and counts it returns and into the forward's input ids (PAD past the count)

Everything it reads per request comes from one int64 array the host uploads once per launch
(``engine.in_flight``): offsets into it are arguments, so no index array has a tensor of its own.
The run is read from the previous launch's picks on the device; nothing is read back.

Row stores (1) and the loads of (2)-(4) are ordered by a barrier between them: a program's threads
see each other's global writes after it. ``tests/helpers/interpreted_drafting.py`` holds the kernel
to the torch path under Triton's interpreter; ``test_speculative_cuda.py`` on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["propose_ngram_in_flight", "warm_up"]

_BLOCK = 512  # positions matched per loop step


@triton.jit(do_not_specialize=["hist_stride", "rows_at", "known_at", "source_at", "room_at", "first_at",
                               "upload_start_at", "upload_count_at", "upload_offset_at", "drafts_at", "counts_at",
                               "runs_stride"])
def _ngram_in_flight_kernel(
    HIST, hist_stride,
    PLAN, rows_at, known_at, source_at, room_at, first_at, upload_start_at, upload_count_at, upload_offset_at,
    drafts_at, counts_at,
    RUNS, runs_stride, ACCEPTED, IDS,
    N: tl.constexpr, N_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, RUN_PAD: tl.constexpr,
    HAS_RUNS: tl.constexpr, BLOCK: tl.constexpr, PAD_ID: tl.constexpr,
):
    e = tl.program_id(0)
    row = tl.load(PLAN + rows_at + e)
    known = tl.load(PLAN + known_at + e)
    source = tl.load(PLAN + source_at + e)
    room = tl.load(PLAN + room_at + e)
    first = tl.load(PLAN + first_at + e)
    line = HIST + row * hist_stride

    # 1. the host's uploads, then the previous launch's run
    upload_start = tl.load(PLAN + upload_start_at + e)
    upload_count = tl.load(PLAN + upload_count_at + e)
    upload_offset = tl.load(PLAN + upload_offset_at + e)
    for u in range(0, upload_count, BLOCK):
        columns = u + tl.arange(0, BLOCK)
        inside = columns < upload_count
        tokens = tl.load(PLAN + upload_offset + columns, mask=inside)
        tl.store(line + upload_start + columns, tokens.to(tl.int32), mask=inside)
    j = tl.arange(0, RUN_PAD)
    if HAS_RUNS:  # RUNS: (M, W) the picks at each request's target rows; its run is the first accepted + 1
        run_length = tl.load(ACCEPTED + source) + 1
        run = tl.load(RUNS + source * runs_stride + j, mask=j < run_length)
    else:  # RUNS: the previous launch's picks, one token each
        run_length = 1
        run = tl.load(RUNS + source + j, mask=j < 1)
    tl.store(line + known + j, run.to(tl.int32), mask=j < run_length)
    length = known + run_length
    tl.debug_barrier()  # the stores above before any load below

    # 2. the last N tokens, backwards (-1 before the row's start: no token is negative)
    back = tl.arange(0, N_PAD)
    last = tl.load(line + length - 1 - back, mask=(back < N) & (length - 1 - back >= 0), other=-1)

    # 3. the longest match ending at a position e <= length - 2, the latest among the longest:
    # score = count * 2^32 + e (positions are far below 2^32), -1 where nothing matches
    best = tl.full([], -1, tl.int64)
    for start in range(0, length - 1, BLOCK):
        position = start + tl.arange(0, BLOCK)
        matching = position <= length - 2
        count = tl.zeros([BLOCK], dtype=tl.int64)
        for b in tl.static_range(N):
            wanted = tl.sum(tl.where(back == b, last, 0), axis=0)  # the b-th token from the end
            at = position - b
            token = tl.load(line + at, mask=matching & (at >= 0), other=-1)
            matching = matching & (token == wanted)
            count += matching.to(tl.int64)
        score = tl.where(count > 0, count * 4294967296 + position, -1)
        best = tl.maximum(best, tl.max(score, axis=0))

    # 4. the drafts after it
    k = tl.arange(0, K_PAD)
    column = best % 4294967296 + 1 + k
    valid = (best >= 0) & (k < K) & (k < room) & (column < length)
    drafts = tl.load(line + column, mask=valid, other=-1).to(tl.int64)
    tl.store(PLAN + drafts_at + e * K + k, drafts, mask=k < K)
    tl.store(PLAN + counts_at + e, tl.sum(valid.to(tl.int64), axis=0))
    tl.store(IDS + first + k, tl.where(valid, drafts, PAD_ID), mask=k < room)


def propose_ngram_in_flight(
    histories: torch.Tensor, plan: torch.Tensor, at: dict[str, int], runs: torch.Tensor,
    accepted: torch.Tensor | None, ids: torch.Tensor, num_entries: int, max_draft_len: int,
    max_matching_ngram_size: int, pad_id: int,
) -> None:
    """One program per entry (request) of ``plan`` (int64, the launch's uploaded array; ``at``:
    where each column starts in it). Per entry it reads ``rows``, ``known``, ``source``, ``room``,
    ``first``, ``upload_start``, ``upload_count``, ``upload_offset`` (where its uploads are in
    ``plan``), and writes its drafts into ``proposals`` ((E, K), -1 past its count) and its count
    into ``counts``. ``histories`` (rows, width) int32 gets the uploads and each entry's run from
    ``runs``: the previous launch's (M, W) runs table with ``accepted`` (M,), or, with
    ``accepted`` None, its (M,) picks (a run of one token each). ``ids``: the forward's input ids,
    whose draft slots ``[first, first + room)`` get the drafts (``pad_id`` past each count)."""
    if num_entries == 0:
        return
    has_runs = accepted is not None
    run_width = runs.shape[1] if has_runs else 1
    _ngram_in_flight_kernel[(num_entries,)](
        histories, histories.stride(0),
        plan, at["rows"], at["known"], at["source"], at["room"], at["first"],
        at["upload_start"], at["upload_count"], at["upload_offset"], at["proposals"], at["counts"],
        runs, runs.stride(0) if has_runs else 1, accepted if has_runs else runs, ids,
        N=max_matching_ngram_size, N_PAD=max(2, triton.next_power_of_2(max_matching_ngram_size)),
        K=max_draft_len, K_PAD=max(2, triton.next_power_of_2(max_draft_len)),
        RUN_PAD=max(2, triton.next_power_of_2(run_width)), HAS_RUNS=has_runs, BLOCK=_BLOCK, PAD_ID=pad_id,
        num_warps=4,
    )


_COLUMNS = ("rows", "known", "source", "room", "first", "upload_start", "upload_count", "upload_offset", "counts",
            "proposals")


def warm_up(device: torch.device, max_draft_len: int, max_matching_ngram_size: int, pad_id: int) -> None:
    """Compile every variant a launch can ask for (runs of one token, and each power of two of
    run widths up to ``1 + max_draft_len``) now, on scratch tensors: a compile on the step path
    would hold a serving step for a second."""
    at = {name: i for i, name in enumerate(_COLUMNS)}
    plan = torch.zeros(len(_COLUMNS) + max_draft_len, dtype=torch.int64, device=device)  # one entry, row 0, no room
    histories = torch.zeros((1, max_draft_len + 8), dtype=torch.int32, device=device)
    ids = torch.zeros(max_draft_len + 1, dtype=torch.int64, device=device)
    picks = torch.zeros(1, dtype=torch.int64, device=device)
    propose_ngram_in_flight(histories, plan, at, picks, None, ids, 1, max_draft_len, max_matching_ngram_size, pad_id)
    width = 2
    while width // 2 < 1 + max_draft_len:
        runs = torch.zeros((1, width), dtype=torch.int64, device=device)
        propose_ngram_in_flight(histories, plan, at, runs, picks, ids, 1, max_draft_len, max_matching_ngram_size,
                                pad_id)
        width *= 2
