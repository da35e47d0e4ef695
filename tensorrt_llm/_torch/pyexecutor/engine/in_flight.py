"""What a forward built in flight could not know, put in on the device at launch (overlap).

Under the overlap scheduler forward n+1 is built while forward n runs (``ForwardInputs``: in-flight
inputs, engine-drafted slots, a speculative request laid out as if n accepted every draft it
verifies). The CUDA engine completes n+1 from n's picks on the device, before n+1 runs, and never
reads a value back::

    host, at launch     InFlightStep(...): every index the device needs, planned in numpy and packed
                        in ONE int64 array, copied once through the staging buffers
                          fill     n+1's in-flight input rows, and where their tokens are in n's picks
                          move     the rows of each request that verified drafts in n: the KV slot
                                   of every position they may move back to (from its block table)
                          drafts   each engine-drafted request's history row, the tokens the host
                                   uploads into it, its known length, its slots
                          verify   every sampling row's target rows (sampling row, then after each
                                   draft) and where its drafts are (proposed here, or the host's)
    device, before n+1  step(ids, positions, slots, seq_lens), over the forward's own tensors (a
                        decode graph's static buffers, or the eager forward's):
                          accept   n's verification: how many drafts each of n's sampling rows
                                   accepted, and the token after them (a row without drafts
                                   accepts none: its run is its pick)
                          drafts   history += the host's uploads and n's run; the proposer over it
                                   -> the drafts, into n+1's slots (PAD past each count)
                          fill     each in-flight input <- its request's token after its run in n
                          move     a request that verified k drafts in n and accepted a: its rows
                                   back by k - a (positions, KV slots, attended lengths)
    device, after n+1   nothing: step.verify(tokens) -> DevicePicks, n+1's picks and where its
                        verification is planned; n+2's launch accepts them (above)

What a drafting step costs the host is launches, not arithmetic (a small model's step is
host-bound). For the n-gram proposer on CUDA all of "before n+1" is ONE Triton kernel
(``speculative.triton_drafting.complete_in_flight``): a drafting launch costs one upload and one
kernel, as a plain launch in flight costs one upload and two ops (its fill), and the drafts come
back in the picks' one copy. Any other proposer, and the CPU, run the torch form: the acceptance
(``DevicePicks.accept``, six ops), ``DraftProposer.propose_batch`` over the gathered histories,
two ops for the fill and eight for the move. Nothing synchronises with the host. The CPU tests
``test_device_drafting.py`` count them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from tensorrt_llm._torch.pyexecutor.engine.inputs import PAD_TOKEN_ID, ForwardInputs
from tensorrt_llm._torch.pyexecutor.engine.logit_rows import DraftSpan
from tensorrt_llm._torch.speculative.device_drafting import TokenHistories
from tensorrt_llm._torch.speculative.device_verification import accept_on_device, move_back_, positions_after_acceptance
from tensorrt_llm._torch.speculative.proposer import DraftProposer

__all__ = ["DevicePicks", "Drafting", "InFlightStep", "Proposed", "Verification", "drafting_for"]

logger = logging.getLogger(__name__)

ToDevice = Callable[[np.ndarray], torch.Tensor]


class Verification(NamedTuple):
    """Where a launch's verification is planned, on the device: ``plan`` (its uploaded int64
    array) holds the (M, W) target rows of its sampling requests from ``target_at`` and, from
    ``where_at``, (M, W - 1) indices into ``plan`` itself of the drafts each verified (the engine's
    proposals and the host's drafts are in it too; past a request's count, a -1 in it)."""

    plan: torch.Tensor
    target_at: int
    where_at: int
    num: int  # M
    width: int  # W


class DevicePicks:
    """A launch's picks on the device, for the next launch: ``tokens`` (one per logit row), the
    sampling request ``rid``'s at ``tokens[index[rid]]``, and the launch's ``verification`` (None:
    it verified no drafts). The acceptance is not computed when the forward ends but where the next
    launch needs it: in the fused kernel (``triton_drafting``), or in torch by :meth:`accept`."""

    __slots__ = ("index", "tokens", "verification", "_accepted")

    def __init__(self, index: dict[int, int], tokens: torch.Tensor, verification: Verification | None) -> None:
        self.index = index
        self.tokens = tokens
        self.verification = verification
        self._accepted = None

    def accept(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(bonus (M,), runs (M, W), accepted (M,))`` in torch (once; launched on first call):
        sampling request ``m``'s token after the drafts it accepted, ``runs[m, :accepted[m] + 1]``
        what it got (its accepted drafts, then that token). Without a verification: the picks,
        None, None (every request got its pick alone)."""
        if self.verification is None:
            return self.tokens, None, None
        if self._accepted is None:
            plan, target_at, where_at, num, width = self.verification
            target_rows = plan[target_at : target_at + num * width].view(num, width)
            drafts = plan.index_select(0, plan[where_at : where_at + num * (width - 1)]).view(num, width - 1)
            runs, accepted = accept_on_device(self.tokens, target_rows, drafts)  # (M, W), (M,)
            self._accepted = runs.gather(1, accepted[:, None]).view(-1), runs, accepted
        return self._accepted


class Proposed(NamedTuple):
    """The drafts a launch proposed on the device for its engine-drafted steps."""

    position: dict[int, int]  # request id -> its row below
    width: int  # K
    values: torch.Tensor  # (E * K + E,) int64: the (E, K) drafts, -1 past each count, then the (E,) counts


@dataclass(slots=True)
class Drafting:
    """How an engine drafts the steps built in flight: the requests' token histories, the proposer,
    and whether the proposal runs as one fused kernel (``fused``: the proposer is n-gram lookup,
    ``max_matching_ngram_size`` its N, on CUDA with Triton) or in torch (``propose_batch``)."""

    histories: TokenHistories
    proposer: DraftProposer
    ngram_size: int | None = None  # set: the fused kernel

    @property
    def fused(self) -> bool:
        return self.ngram_size is not None

    def warm_up(self) -> None:
        """Compile the fused kernel's variants now (``triton_drafting.warm_up``); where that fails,
        draft with the proposer's torch form from here on (logged), which gives the same drafts."""
        if not self.fused:
            return
        from tensorrt_llm._torch.speculative.triton_drafting import warm_up

        try:
            warm_up(self.histories.tokens.device, self.proposer.max_draft_len, self.ngram_size, PAD_TOKEN_ID)
        except Exception:  # a compiler that refuses the kernel: the torch form is slower, not wrong
            logger.exception("the fused in-flight kernel (n-gram drafts) does not compile here: "
                             "drafting in torch instead")
            self.ngram_size = None


def drafting_for(proposer: DraftProposer, device: torch.device, width: int) -> Drafting:
    """The drafting of an engine on ``device`` whose histories hold up to ``width`` tokens: the
    fused kernel for the n-gram proposer on CUDA where Triton is installed, else the proposer's
    torch form."""
    from tensorrt_llm._torch.attention_backend.kernels import has_triton
    from tensorrt_llm._torch.speculative.ngram import NGramProposer

    fused = isinstance(proposer, NGramProposer) and device.type == "cuda" and has_triton()
    return Drafting(TokenHistories(device, width), proposer, proposer.max_matching_ngram_size if fused else None)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without the loop, int64."""
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)


class _Packed:
    """Named int64 columns packed into one host array: one upload, then views on the device (each
    made when first asked: the fused kernel reads offsets and asks for none). Columns are kept as
    one Python list until :meth:`array`: a launch plans a few dozen values, where a NumPy call
    apiece would cost more than the values."""

    __slots__ = ("_flat", "at", "device", "_views")

    def __init__(self) -> None:
        self._flat: list[int] = []
        self.at: dict[str, tuple[int, tuple[int, ...]]] = {}  # name -> (offset, shape)
        self.device: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return len(self._flat)

    def add(self, name: str, values, shape: tuple[int, ...] | None = None) -> None:
        """``values``: a NumPy array (its shape), or a flat list of ints of ``shape`` (default: its length)."""
        if isinstance(values, np.ndarray):
            shape = values.shape
            values = values.ravel().tolist()
        elif shape is None:
            shape = (len(values),)
        self.at[name] = (len(self._flat), shape)
        self._flat += values

    def offset(self, name: str) -> int:
        return self.at[name][0]

    def array(self) -> np.ndarray:
        return np.array(self._flat, dtype=np.int64)

    def upload(self, device: torch.Tensor) -> None:
        """``device``: :meth:`array` on the device."""
        self.device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            at, shape = self.at[name]
            view = self.device[at : at + math.prod(shape)]
            if len(shape) > 1:
                view = view.view(shape)
            self._views[name] = view
        return view


class InFlightStep:
    """One launch's in-flight work (module docstring): planned on the host when made, uploaded by
    :meth:`upload`, applied to the forward's tensors by calling it, and verified by :meth:`verify`
    once the forward's picks exist. ``proposed``: the drafts proposed by the call (None: no step
    is engine-drafted)."""

    def __init__(
        self, inputs: ForwardInputs, picks: DevicePicks | None, *, new: list[int], positions: np.ndarray,
        rows_are_sequences: bool, tokens_per_block: int, drafting: Drafting | None, sampling: list[int],
        drafts: list[DraftSpan], verified: dict[int, list[int]] | None, logit_rows: list[int] | None = None,
    ) -> None:
        """``new``: the attention batch's rows per sequence; ``positions``: the forward's (as
        built); ``rows_are_sequences``: the forward's attended lengths are per flat row (a decode
        graph), else per decode sequence of the eager plan. ``sampling``, ``drafts``: the logit
        layout's sampling requests and draft spans; ``verified``: the host's drafts.
        ``logit_rows``: the layout's rows, to ship in the same array (None: every row, in order)."""
        if (inputs.in_flight or inputs.engine_drafts) and picks is None:
            raise RuntimeError("a forward has in-flight inputs but no forward was launched before it")
        self._picks = picks
        self._drafting = drafting
        self._plan = plan = _Packed()
        self.proposed: Proposed | None = None
        self._index = dict(zip(sampling, range(len(sampling))))
        self._num_fill = len(inputs.in_flight)
        self._plan_fill(inputs)
        self._moves = self._plan_moves(inputs, new, positions, rows_are_sequences, tokens_per_block)  # rows, width
        self._entries = self._plan_drafts(inputs)
        self._verify_shape = self._plan_verification(drafts, verified or {})
        if logit_rows is not None:
            plan.add("logit_rows", logit_rows)
        self._array = plan.array() if plan.at else None

    # ---- host: the plan ------------------------------------------------------------------
    def _source(self, request_id: int) -> int:
        index = self._picks.index.get(request_id)
        if index is None:
            raise RuntimeError(f"request {request_id} is in flight but the forward before did not sample it")
        return index

    def _plan_fill(self, inputs: ForwardInputs) -> None:
        """Each in-flight input's flat row and its request's place in the previous picks."""
        if not inputs.in_flight:
            return
        requests = inputs.requests
        self._plan.add("fill_rows", [flat for flat, _ in inputs.in_flight])
        self._plan.add("fill_source", [self._source(requests[i].request_id) for _, i in inputs.in_flight])

    def _plan_moves(self, inputs: ForwardInputs, new: list[int], positions: np.ndarray, rows_are_sequences: bool,
                    tokens_per_block: int) -> tuple[int, int]:
        """The rows of each in-flight request whose forward in flight has draft slots (it is laid
        out as if that forward accepted them all), and for each row its position if that forward
        accepts none and its KV slot for every count it may accept
        (``device_verification.positions_after_acceptance``). Returns (rows, candidates per row)."""
        slots = inputs.in_flight_slots
        moved = [(flat, inputs.num_new_tokens[i], slots[i], self._source(inputs.requests[i].request_id), i)
                 for flat, i in inputs.in_flight if slots.get(i, 0) > 0]
        if not moved:
            return 0, 0
        if self._picks.verification is None:
            raise RuntimeError("a forward is built on drafts in flight, but the forward before verified none")
        tables = inputs.block_tables
        width = 1 + max(column[2] for column in moved)  # candidates per row: every count accepted, 0 .. max
        rows, owners, bases, candidates = [], [], [], []
        for flat, count, verified, owner, i in moved:
            base, slots_of = positions_after_acceptance(positions[flat : flat + count].tolist(), verified,
                                                        tables[i], width, tokens_per_block)
            rows += range(flat, flat + count)
            owners += [owner] * count
            bases += base
            candidates += slots_of
        plan = self._plan
        plan.add("move_rows", rows)
        if rows_are_sequences:
            plan.add("move_sequences", rows)
        else:  # each row is a decode sequence of its own: its place among the eager plan's decodes
            decode_of, flat, decodes = {}, 0, 0
            for count in new:
                if count == 1:
                    decode_of[flat] = decodes
                    decodes += 1
                flat += count
            plan.add("move_sequences", [decode_of[row] for row in rows])
        plan.add("move_owners", owners)
        plan.add("move_base", bases)
        plan.add("move_slots", candidates, (len(rows), width))
        return len(rows), width

    def _plan_drafts(self, inputs: ForwardInputs) -> list[int]:
        """Each engine-drafted step's history row, what the host uploads into it, its known length,
        its place in the previous picks, its slots and its first slot's flat row. Returns their
        request ids."""
        entries = inputs.engine_drafts
        if not entries:
            return []
        drafting = self._drafting
        if drafting is None:
            raise RuntimeError("a step has draft slots for the engine to fill, but the engine has no draft_proposer")
        requests = [inputs.requests[e.index] for e in entries]
        ids = [r.request_id for r in requests]
        known = [e.known for e in entries]
        room = [e.slots for e in entries]
        first = [e.first_row for e in entries]
        histories = drafting.histories
        placement = histories.place(ids, [r.tokens for r in requests], known)
        plan = self._plan
        plan.add("rows", placement.rows)
        plan.add("known", known)
        plan.add("source", [self._source(rid) for rid in ids])
        plan.add("room", room)
        plan.add("first", first)
        if drafting.fused:  # the kernel reads the uploads entry by entry
            counts = placement.upload_count.tolist()
            plan.add("upload_start", placement.upload_start)
            plan.add("upload_count", counts)
            offsets, offset = [], plan.size + len(entries)  # the tokens follow the offsets
            for count in counts:
                offsets.append(offset)
                offset += count
            plan.add("upload_offset", offsets)
            plan.add("upload_tokens", placement.upload_tokens)
        else:
            if placement.upload_tokens.size:
                plan.add("upload_index", placement.upload_index(histories.width))
                plan.add("upload_tokens", placement.upload_tokens)
            verification = self._picks.verification
            width = verification.width if verification is not None else 1
            known_ = np.asarray(known, dtype=np.int64)
            plan.add("append_index", (placement.rows * histories.width + known_)[:, None] + np.arange(width))
            self._longest = min(int(known_.max()) + width, histories.width)
            plan.add("draft_rows", _ranges(np.asarray(first, dtype=np.int64), np.asarray(room, dtype=np.int64)))
            plan.add("draft_taken", _ranges(np.arange(len(entries)) * drafting.proposer.max_draft_len,
                                            np.asarray(room, dtype=np.int64)))
        width = drafting.proposer.max_draft_len
        plan.add("proposals", [-1] * (len(entries) * width), (len(entries), width))
        plan.add("counts", [0] * len(entries))
        return ids

    def _plan_verification(self, drafts: list[DraftSpan], verified: dict[int, list[int]]) -> tuple[int, int] | None:
        """For every sampling request, its target rows (its sampling row, then its draft rows,
        padded by repeating the last) and where each of its drafts is in this plan: among the
        drafts proposed here (E rows of K), else among the host's (``verified``), else at a -1
        (its count is over). Returns the (M, W) shape, or None (no drafts: the picks are the
        tokens as they are)."""
        if not drafts:
            return None
        num, width = len(self._index), 1 + max(count for *_, count in drafts)
        plan = self._plan
        target_rows = [m for m in range(num) for _ in range(width)]  # (M, W) flat: the sampling row alone
        none = plan.size + num * width + num * (width - 1)  # the host's drafts follow: a -1, then theirs
        where = [none] * (num * (width - 1))  # (M, W - 1) flat
        per_entry = self._drafting.proposer.max_draft_len if self._entries else 0
        proposals = plan.offset("proposals") if self._entries else 0
        position = dict(zip(self._entries, range(len(self._entries))))
        host: list[int] = [-1]
        for rid, index, first, count in drafts:
            at = index * width + 1
            target_rows[at : at + width - 1] = [first + min(j, count - 1) for j in range(width - 1)]
            at = index * (width - 1)
            e = position.get(rid)
            if e is not None:
                where[at : at + count] = range(proposals + e * per_entry, proposals + e * per_entry + count)
            else:
                own = list(verified.get(rid, ())[:count])
                where[at : at + len(own)] = range(none + len(host), none + len(host) + len(own))
                host += own
        plan.add("target_rows", target_rows, (num, width))
        plan.add("draft_where", where, (num, width - 1))
        plan.add("host_drafts", host)
        return num, width

    @property
    def logit_rows(self) -> torch.Tensor | None:
        """The forward's logit rows on the device (after :meth:`upload`), None if not shipped."""
        return self._plan["logit_rows"] if "logit_rows" in self._plan.at else None

    # ---- device ------------------------------------------------------------------------
    def upload(self, to_device: ToDevice) -> None:
        """The plan to the device, in one copy (inside the staging's ``step()``)."""
        if self._array is not None:
            self._plan.upload(to_device(self._array))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 seq_lens: torch.Tensor | None) -> None:
        """Write what the forward could not know over its ``ids``, ``positions``, KV ``slots`` (by
        flat row) and attended lengths ``seq_lens`` (by the sequences the plan was made for): in
        one kernel where the drafting is fused (``triton_drafting.complete_in_flight``), else in
        torch (the previous launch's acceptance first, ``DevicePicks.accept``)."""
        plan, picks, drafting = self._plan, self._picks, self._drafting
        if self._entries:
            self.proposed = Proposed(dict(zip(self._entries, range(len(self._entries)))),
                                     drafting.proposer.max_draft_len, self._proposed_values())
        if picks is None:  # the first launch: nothing in flight, nothing drafted
            return
        fused = drafting is not None and drafting.ngram_size is not None
        if fused and (self._entries or picks.verification is not None):  # a plain fill stays plain decoding's two ops
            self._complete_fused(ids, positions, slots, seq_lens)
            return
        bonus, runs, accepted = picks.accept()  # without a verification: the picks, launching nothing
        if self._entries:
            self._propose(ids, runs, accepted)
        if "fill_rows" in plan.at:
            ids.index_copy_(0, plan["fill_rows"], bonus.index_select(0, plan["fill_source"]))
        if self._moves[0]:
            move_back_(positions, slots, seq_lens, plan["move_rows"], plan["move_sequences"], plan["move_base"],
                       plan["move_slots"], accepted.index_select(0, plan["move_owners"]))

    def _proposed_values(self) -> torch.Tensor:
        """The proposals and their counts, adjacent in the plan: one view."""
        at = self._plan.offset("proposals")
        return self._plan.device[at : self._plan.offset("counts") + len(self._entries)]

    def _complete_fused(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        seq_lens: torch.Tensor | None) -> None:
        from tensorrt_llm._torch.speculative.triton_drafting import InFlightColumns, complete_in_flight

        plan, picks, drafting = self._plan, self._picks, self._drafting
        verification = picks.verification
        previous = None
        if verification is not None:
            previous = (verification.plan, verification.target_at, verification.where_at, verification.width)
        if seq_lens is None:  # no decode sequence: no row moves (the kernel wants an int32 column anyway)
            seq_lens = torch.ones(1, dtype=torch.int32, device=ids.device)
        sizes = InFlightColumns(self._num_fill, self._moves[0], self._moves[1], len(self._entries))
        complete_in_flight(drafting.histories.tokens, plan.device, {name: at for name, (at, _) in plan.at.items()},
                           sizes, previous, picks.tokens, ids, positions, slots, seq_lens,
                           drafting.proposer.max_draft_len, drafting.ngram_size, PAD_TOKEN_ID)

    def _propose(self, ids: torch.Tensor, runs: torch.Tensor | None, accepted: torch.Tensor | None) -> None:
        """The torch form of the drafting: the uploads and the previous launch's ``runs`` into the
        histories, ``propose_batch`` over them, the drafts into the forward's slots and the plan."""
        plan, drafting = self._plan, self._drafting
        histories = drafting.histories
        if "upload_index" in plan.at:
            histories.write(plan["upload_index"], plan["upload_tokens"])
        source = plan["source"]
        if runs is not None:
            histories.write(plan["append_index"], runs.index_select(0, source))
            lengths = plan["known"] + accepted.index_select(0, source) + 1
        else:
            histories.write(plan["append_index"], self._picks.tokens.index_select(0, source))
            lengths = plan["known"] + 1
        drafts, counts = drafting.proposer.propose_batch(histories.gather(plan["rows"], self._longest), lengths,
                                                         plan["room"])
        values = drafts.view(-1).index_select(0, plan["draft_taken"]).clamp(min=PAD_TOKEN_ID)
        ids.index_copy_(0, plan["draft_rows"], values)
        plan["proposals"].copy_(drafts)  # where the verification and the copy back read them
        plan["counts"].copy_(counts)

    def verify(self, tokens: torch.Tensor) -> DevicePicks:
        """What the next launch takes from this one: the forward's picks ``tokens`` (one per logit
        row, on the device) and where this plan's verification is; the acceptance itself is left to
        the next launch (``DevicePicks``). Launches nothing."""
        verification = None
        if self._verify_shape is not None:
            plan = self._plan
            verification = Verification(plan.device, plan.offset("target_rows"), plan.offset("draft_where"),
                                        *self._verify_shape)
        return DevicePicks(self._index, tokens, verification)
