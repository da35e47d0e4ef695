"""``SequenceBlocks``: the blocks each started request holds, grown step by step.

One request's :class:`HeldBlocks`, tokens_per_block 4: a 10-token prompt (p), two tokens
generated (g: the newest has no KV yet) and one draft (d) for the next forward::

    position   0  1  2  3   4  5  6  7   8  9  10 11  12 13 14 15
    token      p  p  p  p   p  p  p  p   p  p  g  g   d  .  .  .
    block      [    B0   ]  [    B1   ]  [    B2   ]  [    B3   ]    table: their block ids
    committed  ├─ tree nodes ─────────┤                             num_committed = 2 blocks
    computed   ├─ KV written ───────────────────┤                   num_computed = 11 positions
    capacity   ├─ what the blocks hold ─────────────────────────┤   capacity = 16 positions

* Ownership: the request holds one pool reference per distinct block. ``blocks[:num_committed]``
  are prefix-tree nodes, maybe shared with other requests (a claimed prefix) and cached once
  released; the others are private until a commit makes their full, computed blocks nodes.
* Growth: a later chunk, or a generation step, needs positions up to its end (a generation
  step: the last token plus its drafts, :func:`generation_len`); :meth:`SequenceBlocks.grow`
  allocates the blocks that covers, all or nothing. A step of one beam without drafts (a plain
  request's, or a speculative one's that runs no drafts this iteration) needs a block once every
  ``tokens_per_block`` steps: ``step_room`` says, per one-beam request, up to where it needs none,
  so a batch finds the few steps that allocate with one lookup each.
* Beams (:mod:`.beam_tables`): from the first generation step, ``blocks`` is beam 0's table and
  ``beam_blocks`` the other beams' blocks not in it, each held once.
* Charged when: a first chunk's allocation takes the whole prompt (its chunk window aside); the
  blocks a request will hold at completion (``reserve``: ``max_total_len`` plus draft slots) minus
  those it holds are its share of :attr:`SequenceBlocks.reserved_blocks`, the running total the
  capacity scheduler keeps free for requests already started.

Nothing here claims prefixes or keys blocks (``prefix_reuse``); the pool owns the slots.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache.beam_tables import BeamTables
from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.kv_cache.values import StepNeed
from tensorrt_llm._torch.pyexecutor.llm_request import (
    IN_FLIGHT_TOKEN_ID,
    LlmRequest,
    LlmRequestState,
    num_in_flight_tokens,
)

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_ERROR = LlmRequestState.ERROR


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_tokens(request: LlmRequest, num_tokens: int, tokens_per_block: int) -> int:
    """Blocks a sequence of ``num_tokens`` positions holds, beams included."""
    blocks = -(-num_tokens // tokens_per_block)
    if request.beam_width > 1:  # beams share full prompt blocks and own everything after
        blocks += (request.beam_width - 1) * max(0, blocks - request.prompt_len // tokens_per_block)
    return blocks


def max_sequence_len(request: LlmRequest) -> int:
    """Positions a request may hold before it finishes, draft slots included."""
    return request.max_total_len + max(request.max_draft_len, request.num_draft_tokens)


def generation_len(request: LlmRequest) -> int:
    """Positions the sequence must hold for a generation request's next forward."""
    if request.beam_width > 1:  # each beam writes one position
        return len(request.tokens)
    return len(request.tokens) - 1 + forward_cost(request)  # the last token plus any drafts


@dataclass(slots=True)
class HeldBlocks:
    """The blocks one request holds (see the module docstring's map)."""

    blocks: list[KVBlock]
    num_committed: int  # blocks[:num_committed] are tree nodes
    num_computed: int  # tokens whose KV is written
    beam_blocks: list[KVBlock] = field(default_factory=list)  # private tails of beams 1..W-1
    stamp: int = 0  # allocation order
    reserve: int = 0  # blocks it holds at completion (draft slots as at allocation)
    plain: bool = False  # one beam and no draft slots: a generation step needs len(tokens) positions
    one_beam: bool = True  # its steps without drafts need len(tokens) positions (``step_room`` tracks capacity)
    capacity: int = 0  # positions ``blocks`` hold (len(blocks) * tokens_per_block)
    # block_id of each of ``blocks``, kept in step with it: a held block never changes slot,
    # so the table only changes where ``blocks`` does (append, commit to a canonical block).
    table: list[int] = field(init=False)
    beams: BeamTables | None = None  # beam search, from the first generation step: every beam's table

    def __post_init__(self) -> None:
        self.table = [block.block_id for block in self.blocks]

    @property
    def num_held(self) -> int:
        return len(self.blocks) + len(self.beam_blocks)


# What commits a forward's newly full, computed blocks to the prefix tree (``PrefixReuse.commit_blocks``).
CommitBlocks = Callable[[list[tuple[LlmRequest, HeldBlocks]]], None]


class SequenceBlocks:
    """Every started request's :class:`HeldBlocks`, by request id, and the totals kept beside them.

    ``held`` and ``step_room`` are read by the manager's per-request loops; only this class
    writes them. ``reserved_blocks``: the blocks every holder still needs to completion, summed.
    """

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.held: dict[int, HeldBlocks] = {}
        # request id -> the positions a generation step without drafts may reach with the blocks
        # it holds: a one-beam sequence's capacity (speculative or not: a step without drafts
        # needs what a plain one does), -1 for beam search (its every step allocates).
        self.step_room: dict[int, int] = {}
        self.reserved_blocks = 0
        self._stamps = itertools.count()

    # ---- queries --------------------------------------------------------------------
    def split_allocated(self, requests: Sequence[LlmRequest]) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """``requests`` that hold blocks and those that do not, each in the given order."""
        held = self.held
        allocated = [r for r in requests if r.request_id in held]
        if len(allocated) == len(requests):
            return allocated, []
        return allocated, [r for r in requests if r.request_id not in held]

    def num_held_blocks(self, request: LlmRequest) -> int:
        seq = self.held.get(request.request_id)
        return 0 if seq is None else seq.num_held

    def releasable_blocks(self, request: LlmRequest) -> int:
        """Blocks that freeing ``request`` now would make available: those it holds alone
        (a block another sequence or a claim also holds stays held)."""
        seq = self.held.get(request.request_id)
        if seq is None:
            return 0
        return sum(block.ref_count == 1 for block in (*seq.blocks, *seq.beam_blocks))

    def blocks_reserved_to_completion(self, started: Sequence[LlmRequest]) -> int:
        """The blocks requests that hold blocks still need to completion, summed; O(1) when
        ``started`` is every such request (:attr:`reserved_blocks`)."""
        if len(started) == len(self.held):  # distinct allocated requests: all of them
            return self.reserved_blocks
        held = self.held
        return sum(max(0, seq.reserve - seq.num_held) for seq in (held[r.request_id] for r in started))

    def step_needs(self, started: Sequence[LlmRequest]) -> list[StepNeed]:
        """Each request that holds blocks, in the order they started: the blocks its next forward
        still needs (a later chunk: its whole remaining prompt, the most a chunk can be) and the
        blocks it holds."""
        held, tpb = self.held, self.tokens_per_block
        needs = []
        for request in sorted(started, key=lambda r: held[r.request_id].stamp):
            seq = held[request.request_id]
            if request.state is _CONTEXT_INIT:
                needed_len = request.prompt_len + request.num_draft_tokens
            else:
                needed_len = generation_len(request)
            needs.append(StepNeed(request, max(0, blocks_for_tokens(request, needed_len, tpb) - seq.num_held), seq.num_held))
        return needs

    def beam_block_tables(self, request: LlmRequest) -> list[list[int]]:
        """One block table per beam of a beam-search request in generation (beam 0's is its
        block table); before its first generation step, and for one beam, ``[block_table]``."""
        seq = self.held[request.request_id]
        if seq.beams is None:
            return [list(seq.table)]
        return [seq.beams.table_ids(beam) for beam in range(seq.beams.beam_width)]

    # ---- growth ---------------------------------------------------------------------
    def start(self, request: LlmRequest, blocks: list[KVBlock], num_committed: int, num_computed: int,
              beam_blocks: list[KVBlock]) -> None:
        """A first chunk's blocks (held once each): ``blocks[:num_committed]`` claimed tree nodes."""
        seq = HeldBlocks(
            blocks=blocks,
            num_committed=num_committed,
            num_computed=num_computed,
            beam_blocks=beam_blocks,
            stamp=next(self._stamps),
            reserve=blocks_for_tokens(request, max_sequence_len(request), self.tokens_per_block),
            plain=request.beam_width == 1 and request.max_draft_len == 0,
            one_beam=request.beam_width == 1,
            capacity=len(blocks) * self.tokens_per_block,
        )
        self.held[request.request_id] = seq
        self.step_room[request.request_id] = seq.capacity if seq.one_beam else -1
        self.reserved_blocks += max(0, seq.reserve - seq.num_held)

    def grow_step(self, request: LlmRequest) -> bool:
        """Blocks for a generation request's next forward (drafts included), all or nothing."""
        seq = self.held[request.request_id]
        if request.beam_width > 1:  # every beam writes its next position in a block of its own
            return self._grow_beams(request, seq)
        # A request the drafter withdrew (Drafter.withdraw) is plain from now on: no trim.
        if not seq.plain and not request.max_draft_len:
            seq.plain = True
        return self.grow(request, generation_len(request), seq)

    def grow(self, request: LlmRequest, needed_len: int, seq: HeldBlocks | None = None) -> bool:
        """Blocks for ``needed_len`` positions, all or nothing (False, changing nothing, when they
        cannot be had). Every generation step that fills a block comes here: plain arithmetic,
        no calls but the pool's."""
        if seq is None:
            seq = self.held[request.request_id]
        tpb, blocks = self.tokens_per_block, seq.blocks
        shared = -(-needed_len // tpb) - len(blocks)
        if request.beam_width == 1:  # one table (blocks_for_tokens is the shared blocks)
            beam = 0
        else:
            beam = blocks_for_tokens(request, needed_len, tpb) - ceil_div(needed_len, tpb) - len(seq.beam_blocks)
        if shared <= 0 and beam <= 0:
            return True
        pool = self.pool
        if (shared if shared > 0 else 0) + (beam if beam > 0 else 0) > pool.available:
            return False
        before = seq.reserve - len(blocks) - len(seq.beam_blocks)  # blocks still to reserve, before and after
        if shared > 0:
            fresh = pool.allocate_many(shared)
            blocks += fresh
            seq.table += [block.block_id for block in fresh]
            seq.capacity = len(blocks) * tpb
            if seq.one_beam:
                self.step_room[request.request_id] = seq.capacity
        if beam > 0:
            seq.beam_blocks += pool.allocate_many(beam)
        after = seq.reserve - len(blocks) - len(seq.beam_blocks)
        self.reserved_blocks += (after if after > 0 else 0) - (before if before > 0 else 0)
        return True

    def _grow_beams(self, request: LlmRequest, seq: HeldBlocks) -> bool:
        """A beam-search generation step: every beam writes the position of its newest token, in
        a block of its own (see ``beam_tables``). The first step starts the beams on the prompt's
        blocks; the blocks set aside for the prompt's last partial block at allocation
        (:func:`blocks_for_tokens` counts one per extra beam) become the beams' copies of it. All
        or nothing: False, changing nothing, when the blocks cannot be had."""
        tpb = self.tokens_per_block
        position = len(request.tokens) - 1
        beams = seq.beams if seq.beams is not None else BeamTables(seq.blocks, request.beam_width)
        spare = seq.beam_blocks if seq.beams is None else []
        needed = beams.blocks_to_write(position, tpb)
        missing = max(0, needed - len(spare))
        if missing > self.pool.available:
            return False
        before = max(0, seq.reserve - seq.num_held)
        fresh = spare[:needed] + self.pool.allocate_many(missing)
        unused = spare[needed:]
        for source, copy in beams.make_writable(position, tpb, fresh):
            self.pool.copy(source, copy)
        seq.beams = beams
        self._sync_beams(seq)
        self.pool.release(unused)
        self.reserved_blocks += max(0, seq.reserve - seq.num_held) - before
        return True

    def _sync_beams(self, seq: HeldBlocks) -> None:
        """``blocks`` / ``table`` / ``capacity`` are beam 0's; ``beam_blocks`` the rest, each once."""
        seq.blocks = list(seq.beams.tables[0])
        seq.table = [block.block_id for block in seq.blocks]
        seq.capacity = len(seq.blocks) * self.tokens_per_block
        own = {id(block) for block in seq.blocks}
        seq.beam_blocks = [block for block in seq.beams.distinct() if id(block) not in own]

    def fork_beams(self, request: LlmRequest, parents: Sequence[int]) -> None:
        """After a beam-search step: new beam ``j`` continues old beam ``parents[j]``
        (``BeamStep.parents``). The blocks only dropped beams held go back to the pool; they
        were never committed to the prefix tree, so no cached block holds a dropped beam's tokens.
        Nothing to do before the request's beam tables exist (its first step forks from the prompt)."""
        seq = self.held.get(request.request_id)
        if seq is None or seq.beams is None:
            return
        before = max(0, seq.reserve - seq.num_held)
        dropped = seq.beams.fork(parents)
        if not dropped:
            return
        self._sync_beams(seq)
        self.pool.release(dropped)
        self.reserved_blocks += max(0, seq.reserve - seq.num_held) - before

    # ---- after a forward, and the end ------------------------------------------------
    def record_forward(self, scheduled: ScheduledRequests, commit_blocks: CommitBlocks | None) -> None:
        """Record the KV the forward of ``scheduled`` computed; hand the sequences whose blocks
        filled up to ``commit_blocks`` (None: reuse is off), in batch order; release the blocks
        that held only rejected drafts.

        A generation step fills a block once every ``tokens_per_block`` steps, so a few of a
        batch's sequences fill one in each forward: they are committed together (one keying
        pass), flushed before any trim so the pool sees commits and trims in batch order."""
        held, tpb = self.held, self.tokens_per_block
        for chunk in scheduled.context_chunks:
            seq = held.get(chunk.request.request_id)
            if seq is None or chunk.request.state is _ERROR:
                continue  # a request that finished in this forward computed its KV: record it
            seq.num_computed = chunk.end
            if commit_blocks is not None:
                commit_blocks([(chunk.request, seq)])
        filled: list[tuple[LlmRequest, HeldBlocks]] = []
        for request in scheduled.generation_requests:
            seq = held.get(request.request_id)
            if seq is None or request.state is _ERROR:
                continue
            # the newest sampled token has no KV yet; neither has a token still in flight
            # (overlap). The common case, nothing in flight, is told by the last token alone:
            # no call per request per iteration.
            tokens = request.tokens
            computed = len(tokens) - 1
            if tokens[-1] == IN_FLIGHT_TOKEN_ID:
                computed -= num_in_flight_tokens(tokens)
            seq.num_computed = computed
            if commit_blocks is not None and computed // tpb > seq.num_committed:  # a block filled up
                filled.append((request, seq))
            if not seq.plain and request.beam_width == 1 and seq.capacity >= len(tokens) + tpb:
                if filled:
                    commit_blocks(filled)
                    filled = []
                self._trim(request.request_id, seq, len(tokens))  # blocks that held only rejected drafts
        if filled:
            commit_blocks(filled)

    def _trim(self, request_id: int, seq: HeldBlocks, length: int) -> None:
        """Roll back draft slots: release the blocks past the first ``length`` positions.

        After a forward that verified drafts, the sequence's KV is valid up to ``num_computed``
        (its accepted tokens); the positions of rejected drafts hold KV that no later forward
        reads (it is written over when the sequence gets there). Blocks that hold nothing but
        such positions go back to the pool now. They were never committed: only full blocks of
        computed positions are, so no prefix-tree block ever holds a rejected token.
        """
        keep = ceil_div(length, self.tokens_per_block)
        before = max(0, seq.reserve - seq.num_held)
        rejected = seq.blocks[keep:]
        del seq.blocks[keep:]
        del seq.table[keep:]
        seq.capacity = keep * self.tokens_per_block
        self.step_room[request_id] = seq.capacity  # one beam: trimmed only after draft slots
        self.pool.release(rejected)
        self.reserved_blocks += max(0, seq.reserve - seq.num_held) - before

    def release(self, request: LlmRequest) -> None:
        """Every block ``request`` holds back to the pool, leaves first (they become the oldest in LRU)."""
        seq = self.held.pop(request.request_id)
        del self.step_room[request.request_id]
        self.reserved_blocks -= max(0, seq.reserve - seq.num_held)
        self.pool.release(seq.beam_blocks)
        self.pool.release(seq.blocks)

    def check(self) -> None:
        """Raise AssertionError unless every table, capacity, step room, beam table and the
        reserved total agree with the blocks held."""
        for request_id, seq in self.held.items():
            assert seq.table == [b.block_id for b in seq.blocks], f"request {request_id}: stale block table"
            assert seq.capacity == len(seq.blocks) * self.tokens_per_block, f"request {request_id}: stale capacity"
            assert self.step_room[request_id] == (seq.capacity if seq.one_beam else -1), f"request {request_id}: stale room"
            if seq.beams is not None:
                seq.beams.check()
                distinct = seq.beams.distinct()
                assert {id(b) for b in distinct} == {id(b) for b in (*seq.blocks, *seq.beam_blocks)} and len(
                    distinct) == seq.num_held, f"request {request_id}: beam tables out of step with its blocks"
        reserved = sum(max(0, seq.reserve - seq.num_held) for seq in self.held.values())
        assert self.reserved_blocks == reserved, f"reserved-blocks total {self.reserved_blocks} != {reserved}"
        assert self.step_room.keys() == self.held.keys(), "a step room without its sequence, or the reverse"
