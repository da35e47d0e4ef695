"""Everything a launch puts into a forward built in flight, in one Triton kernel (n-gram drafts).

Under the overlap scheduler forward n+1 is built while n runs (``engine.in_flight``). Before n+1
runs, the device must (1) verify n: how many of the drafts n checked its picks accept, and the
token after them; (2) fill n+1's in-flight inputs with those tokens; (3) move n+1's rows back over
the slots n did not accept; (4) draft n+1 from each request's real history. In torch that is some
twenty small kernels around the drafting (``device_verification``, ``device_drafting``), each
launched from Python; a step of a small model is host-bound, so on the GPU those launches cost
more than the forward they serve. This kernel does all four in one launch. Program ``p`` does the
``p``-th item of each list the host planned (``engine.in_flight.InFlightStep``), where it has one::

    0. acceptance of a sampling request m of n (done wherever it is needed: a few loads):
         targets t_0..t_(W-1) = n's picks at its target rows, drafts d_1..d_(W-1) where n's plan has them
         accepted a = leading run of d_(j+1) == t_j;  bonus = t_a;  run = t_0 .. t_a
       (n without drafts: a = 0, the run its pick alone)
    1. fill   in-flight input p       ids[row] <- the bonus of its request in n
    2. move   moved row p             position <- base + a; KV slot <- candidates[a]; its decode
                                      sequence's attended length <- base + a + 1
    3. draft  drafting request p      its history row gets the host's uploads, then the run at
                                      ``known``; then the longest match among positions e <= length - 2
                                      of its last N tokens (the latest among the longest:
                                      ``propose_ngram_drafts``' choice); the tokens after it, at most
                                      ``room`` and K, -1 past the count, into the plan's proposals and
                                      counts and into the forward's ids (PAD past the count)

Everything it reads comes from two int64 arrays: this launch's plan (uploaded once) and the
previous launch's plan (its target rows and where its drafts are: the drafts it proposed sit in it
too), plus the previous picks. Offsets into them are arguments, so no index array has a tensor
of its own; nothing is read back. ``W`` (the previous verification's width) is an argument, so the
kernel compiles twice per engine (with and without a previous verification), at warm-up.

Row stores (3) and the loads after them are ordered by a barrier: a program's threads see each
other's global writes after it. ``tests/helpers/interpreted_drafting.py`` holds the kernel to the
torch path under Triton's interpreter; ``test_speculative_cuda.py`` on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["InFlightColumns", "complete_in_flight", "warm_up"]

_BLOCK = 512  # positions matched per loop step


@triton.jit
def _acceptance(PREV, TOKENS, target_at, where_at, m, width, j, VERIFIED: tl.constexpr):
    """(accepted, targets over ``j``) of the previous launch's sampling request ``m`` (step 0)."""
    if VERIFIED:
        rows = tl.load(PREV + target_at + m * width + j, mask=j < width, other=0)
        targets = tl.load(TOKENS + rows, mask=j < width, other=-1)
        where = tl.load(PREV + where_at + m * (width - 1) + j, mask=j < width - 1, other=0)
        drafts = tl.load(PREV + where, mask=j < width - 1, other=-1)
        # the first j whose draft is not the target before it; padding (-1) never matches a pick
        accepted = tl.min(tl.where((drafts != targets) | (j >= width - 1), j, width - 1), axis=0).to(tl.int64)
    else:
        targets = tl.load(TOKENS + m + j, mask=j < 1, other=-1)
        accepted = tl.full([], 0, tl.int64)
    return accepted, targets


@triton.jit(do_not_specialize=[
    "hist_stride", "target_at", "where_at", "width", "num_fill", "fill_rows_at", "fill_source_at", "num_move",
    "move_rows_at", "move_sequences_at", "move_owners_at", "move_base_at", "move_slots_at", "move_width",
    "num_entries", "rows_at", "known_at", "source_at", "room_at", "first_at", "upload_start_at", "upload_count_at",
    "upload_offset_at", "drafts_at", "counts_at"],
    do_not_specialize_on_alignment=["HIST", "PLAN", "PREV", "TOKENS", "IDS", "POSITIONS", "SLOTS", "SEQ_LENS"])
def _in_flight_kernel(
    HIST, hist_stride, PLAN, PREV, TOKENS, IDS, POSITIONS, SLOTS, SEQ_LENS,
    target_at, where_at, width,
    num_fill, fill_rows_at, fill_source_at,
    num_move, move_rows_at, move_sequences_at, move_owners_at, move_base_at, move_slots_at, move_width,
    num_entries, rows_at, known_at, source_at, room_at, first_at, upload_start_at, upload_count_at, upload_offset_at,
    drafts_at, counts_at,
    N: tl.constexpr, N_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr,
    VERIFIED: tl.constexpr, BLOCK: tl.constexpr, PAD_ID: tl.constexpr,
):
    p = tl.program_id(0)
    j = tl.arange(0, W_PAD)

    # 1. fill
    if p < num_fill:
        m = tl.load(PLAN + fill_source_at + p)
        accepted, targets = _acceptance(PREV, TOKENS, target_at, where_at, m, width, j, VERIFIED)
        bonus = tl.sum(tl.where(j == accepted, targets, 0), axis=0)
        tl.store(IDS + tl.load(PLAN + fill_rows_at + p), bonus)

    # 2. move
    if p < num_move:
        m = tl.load(PLAN + move_owners_at + p)
        accepted, _ = _acceptance(PREV, TOKENS, target_at, where_at, m, width, j, VERIFIED)
        row = tl.load(PLAN + move_rows_at + p)
        moved = tl.load(PLAN + move_base_at + p) + accepted
        tl.store(POSITIONS + row, moved)
        tl.store(SLOTS + row, tl.load(PLAN + move_slots_at + p * move_width + accepted))
        sequence = tl.load(PLAN + move_sequences_at + p)
        tl.store(SEQ_LENS + sequence, (moved + 1).to(SEQ_LENS.dtype.element_ty))

    # 3. draft
    if p < num_entries:
        row = tl.load(PLAN + rows_at + p)
        known = tl.load(PLAN + known_at + p)
        m = tl.load(PLAN + source_at + p)
        room = tl.load(PLAN + room_at + p)
        first = tl.load(PLAN + first_at + p)
        line = HIST + row * hist_stride
        upload_start = tl.load(PLAN + upload_start_at + p)
        upload_count = tl.load(PLAN + upload_count_at + p)
        upload_offset = tl.load(PLAN + upload_offset_at + p)
        for u in range(0, upload_count, BLOCK):
            columns = u + tl.arange(0, BLOCK)
            inside = columns < upload_count
            tokens = tl.load(PLAN + upload_offset + columns, mask=inside)
            tl.store(line + upload_start + columns, tokens.to(tl.int32), mask=inside)
        accepted, run = _acceptance(PREV, TOKENS, target_at, where_at, m, width, j, VERIFIED)
        run_length = accepted + 1
        tl.store(line + known + j, run.to(tl.int32), mask=j < run_length)
        length = known + run_length
        tl.debug_barrier()  # the stores above before any load below

        # the last N tokens, backwards (-1 before the row's start: no token is negative)
        back = tl.arange(0, N_PAD)
        last = tl.load(line + length - 1 - back, mask=(back < N) & (length - 1 - back >= 0), other=-1)

        # the longest match ending at a position e <= length - 2, the latest among the longest:
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

        k = tl.arange(0, K_PAD)
        column = best % 4294967296 + 1 + k
        valid = (best >= 0) & (k < K) & (k < room) & (column < length)
        drafts = tl.load(line + column, mask=valid, other=-1).to(tl.int64)
        tl.store(PLAN + drafts_at + p * K + k, drafts, mask=k < K)
        tl.store(PLAN + counts_at + p, tl.sum(valid.to(tl.int64), axis=0))
        tl.store(IDS + first + k, tl.where(valid, drafts, PAD_ID), mask=k < room)


class InFlightColumns(NamedTuple):
    """Where a launch's lists start in its plan (``at``: column name -> offset) and how long they
    are, as :func:`complete_in_flight` reads them; a list with no items may have no column."""

    num_fill: int
    num_move: int
    move_width: int  # candidate slots per moved row
    num_entries: int


_FILL = ("fill_rows", "fill_source")
_MOVE = ("move_rows", "move_sequences", "move_owners", "move_base", "move_slots")
_DRAFT = ("rows", "known", "source", "room", "first", "upload_start", "upload_count", "upload_offset", "proposals",
          "counts")


def complete_in_flight(
    histories: torch.Tensor, plan: torch.Tensor, at: dict[str, int], sizes: InFlightColumns,
    previous: tuple[torch.Tensor, int, int, int] | None, tokens: torch.Tensor,
    ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor | None,
    max_draft_len: int, max_matching_ngram_size: int, pad_id: int,
) -> None:
    """One launch's in-flight work (module docstring) over the forward's ``ids``, ``positions``,
    KV ``slots`` (by flat row) and attended lengths ``seq_lens`` (by decode sequence; None: no
    row moves). ``plan``: the launch's uploaded int64 array, ``at`` its columns (fill, move and
    drafting lists, ``proposals`` (E, K) and ``counts`` (E,) written here); ``previous``: the
    previous launch's plan and where its ``target_rows`` (M, W) and ``draft_where`` (M, W - 1,
    absolute indices into that plan) start, and W; None when it verified no drafts. ``tokens``:
    the previous launch's picks, one per logit row. ``histories`` (rows, width) int32."""
    grid = max(sizes.num_fill, sizes.num_move, sizes.num_entries)
    if grid == 0:
        return
    verified = previous is not None
    prev, target_at, where_at, width = previous if verified else (plan, 0, 0, 1)
    offset = [at.get(name, 0) for name in _FILL + _MOVE + _DRAFT]
    _in_flight_kernel[(grid,)](
        histories, histories.stride(0), plan, prev, tokens, ids, positions, slots,
        seq_lens if seq_lens is not None else positions,
        target_at, where_at, width,
        sizes.num_fill, *offset[:2],
        sizes.num_move, *offset[2:7], sizes.move_width,
        sizes.num_entries, *offset[7:],
        N=max_matching_ngram_size, N_PAD=max(2, triton.next_power_of_2(max_matching_ngram_size)),
        K=max_draft_len, K_PAD=max(2, triton.next_power_of_2(max_draft_len)),
        W_PAD=max(2, triton.next_power_of_2(1 + max_draft_len)), VERIFIED=verified, BLOCK=_BLOCK, PAD_ID=pad_id,
        num_warps=4,
    )


def warm_up(device: torch.device, max_draft_len: int, max_matching_ngram_size: int, pad_id: int) -> None:
    """Compile both variants a launch can ask for (after a launch that verified drafts, and after
    one that did not) now, on scratch tensors: a compile on the step path would hold a serving step
    for a second."""
    names = _FILL + _MOVE[:-1] + _DRAFT[:-2]
    at = {name: i for i, name in enumerate(names)}  # one entry of each list, zeros: row 0, no room
    at["move_slots"] = len(names)
    at["proposals"] = len(names) + 2
    at["counts"] = at["proposals"] + max_draft_len
    plan = torch.zeros(at["counts"] + 1, dtype=torch.int64, device=device)
    histories = torch.zeros((1, max_draft_len + 8), dtype=torch.int32, device=device)
    ids = torch.zeros(max_draft_len + 1, dtype=torch.int64, device=device)
    positions, slots = torch.zeros_like(ids), torch.zeros_like(ids)
    seq_lens = torch.ones(max_draft_len + 1, dtype=torch.int32, device=device)
    tokens = torch.zeros(1, dtype=torch.int64, device=device)
    # the previous plan: target rows (1, 2) of zeros, then where its one draft is: the -1 after them
    previous = torch.tensor([0, 0, 3, -1], dtype=torch.int64, device=device)
    sizes = InFlightColumns(1, 1, 2, 1)
    for before in (None, (previous, 0, 2, 2)):
        complete_in_flight(histories, plan, at, sizes, before, tokens, ids, positions, slots, seq_lens, max_draft_len,
                           max_matching_ngram_size, pad_id)
