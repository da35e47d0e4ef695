"""``_prepare_tp_inputs``: one flat forward from a batch, the same for every engine.

:func:`prepare_tp_inputs` (upstream's name) appends each request's positions — a context
request's chunk as the batch carries it, a generation request's next step — checks each count
against :func:`forward_cost`, and checks the total against ``max_num_tokens`` the way upstream
asserts it, except that here it raises :class:`TokenBudgetExceeded`, which fails the batch
instead of killing the executor thread. :class:`ForwardInputs` holds the result; which rows of
the forward's logits belong to which request is :mod:`.logit_rows`' job. Nothing here needs
torch: the simulated engine and the replay run on it alone.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import SamplingColumns, sampling_columns
from tensorrt_llm._torch.pyexecutor.engine.logit_rows import (
    BeamSpan,
    DraftSpan,
    LogitRows,
    RowColumns,
    draft_targets,
    logit_layout,
)
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequest, num_in_flight_tokens
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager

__all__ = [
    "PAD_TOKEN_ID", "EngineDrafts", "ForwardInputs", "TpInputs", "prepare_tp_inputs",
    # the logit-row layout's names, importable here as before they had a module of their own
    "BeamSpan", "DraftSpan", "LogitRows", "draft_targets",
]

PAD_TOKEN_ID = 0  # fills first-draft slots before the drafter has proposed anything

#: How an engine proposes the drafts of requests built in flight, on the host: each request's known
#: tokens (a sequence of ints) and the most drafts it may get -> each one's drafts.
HostProposal = Callable[[list[Sequence[int]], list[int]], list[list[int]]]


class EngineDrafts(NamedTuple):
    """A generation step whose drafts the engine proposes when the forward is launched (its
    ``py_draft_tokens`` are ``IN_FLIGHT_TOKEN_ID`` slots: ``Drafter``)."""

    index: int  # the request's index in the forward
    first_row: int  # flat row of its first draft slot
    slots: int  # its draft slots: it gets at most as many drafts
    known: int  # its tokens known on the host when the forward was built (placeholders excluded)


def _special_step(request: LlmRequest) -> tuple[list[int], int, int]:
    """A generation step other than one beam without drafts: ``(input tokens, drafts verified,
    positions after the sampling row)``."""
    newest = request.tokens[-1]
    if request.is_first_draft:  # the drafts proposed so far, padded to max_draft_len
        drafts = request.py_draft_tokens[: request.max_draft_len]
        padding = [PAD_TOKEN_ID] * (request.max_draft_len - len(drafts))
        return [newest, *drafts, *padding], len(drafts), request.max_draft_len
    if request.py_draft_tokens:
        return [newest, *request.py_draft_tokens], len(request.py_draft_tokens), len(request.py_draft_tokens)
    # one position per beam: each beam's newest token (a request without beam state repeats its own);
    # its sampling row is beam 0's, the first
    state = request.py_beams
    return (state.last_tokens() if state is not None else [newest] * request.beam_width), 0, request.beam_width - 1


class ForwardInputs:
    """One flat forward. Request ``i`` owns ``input_ids[offsets[i]:offsets[i] + num_new_tokens[i]]``.

    ``requests``, ``num_new_tokens``, ``num_cached_tokens`` and ``samples`` (does request
    ``i`` produce a token this step) are filled as requests are added. The flat
    ``input_ids`` and ``position_ids`` and the ``block_tables`` are built on first use — a
    simulated engine never needs them, and a context chunk can be thousands of tokens — so
    they must be read before the KV manager allocates again (in the same iteration), or taken
    at launch by :meth:`materialize` when the forward runs later.

    ``in_flight``: ``(flat index, request index)`` of each generation input whose token a
    forward in flight is still sampling (overlap); :meth:`resolve` fills them in. A speculative
    request in flight is built as if that forward accepts every draft it verifies (its tokens end
    with one placeholder per draft slot and one for the token after them: ``in_flight_slots``
    counts the slots); :meth:`resolve` moves its positions back by the slots that forward did not
    fill with accepted drafts. ``engine_drafts``: the steps whose drafts the engine proposes at
    launch (:class:`EngineDrafts`), from the tokens the forward before produced.

    ``num_drafts``: per request, the draft tokens this forward verifies. A request's positions
    end with its drafts and then first-draft padding; its *sampling row* is its last position
    before them (it predicts the next token), and each draft position's row predicts the token
    after that draft (:meth:`logit_layout`)::

        generation, drafts d1 d2, first-draft padding to max_draft_len 4:
            input   t  d1  d2  PAD PAD          t: the newest token
            row     ^sampling  ^verify rows (one per draft; padding is never verified)
    """

    __slots__ = (
        "requests", "num_new_tokens", "num_cached_tokens", "samples", "total_num_tokens", "in_flight", "prompt_logits",
        "num_drafts", "in_flight_slots", "engine_drafts", "_proposed", "_trailing", "_sources", "_starts", "_stops", "_extras", "_beams",
        "_generation", "_tables", "_kv", "_input_ids", "_position_ids", "_block_tables", "_beam_tables", "token_masks",
    )

    def __init__(self, kv_cache_manager: KVCacheManager | None = None) -> None:
        self.requests: list[LlmRequest] = []
        self.num_new_tokens: list[int] = []
        self.num_cached_tokens: list[int] = []
        self.samples: list[bool] = []
        self.total_num_tokens = 0
        self.in_flight: list[tuple[int, int]] = []
        self.in_flight_slots: dict[int, int] = {}  # request index -> draft slots of its forward in flight (if any)
        self.engine_drafts: list[EngineDrafts] = []
        self._proposed: dict[int, list[int]] = {}  # request index -> the drafts the engine proposed (resolve)
        self.prompt_logits: set[int] = set()  # indices of context chunks whose every position gets logits
        self.num_drafts: list[int] = []  # per request: the draft rows it verifies (engine drafts: its slots)
        self._trailing: list[int] = []  # positions after each request's sampling row: drafts, then padding
        # Each request's input tokens, not copied yet: _sources[i][_starts[i]:_stops[i]], then _extras[i]
        # (a generation step's own list, or a chunk's prompt in the request's tokens followed by its drafts).
        self._sources: list[Sequence[int]] = []
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._extras: list[Sequence[int]] = []
        self._beams: list[int] = []
        self._generation: list[bool] = []  # a generation step (not a context chunk)
        self._tables: list[list[int] | None] = []  # None: the request's table in the KV manager
        self._kv = kv_cache_manager
        self._input_ids: list[int] | None = None
        self._position_ids: list[int] | None = None
        self._block_tables: list[list[int]] | None = None
        self._beam_tables: list[list[list[int]] | None] | None = None  # per request: its beams' tables, or None
        self.token_masks: Mapping[int, Sequence[int]] | None = None  # request id -> grammar bitmask (forward_async)

    def append(
        self, request: LlmRequest, token_ids: list[int], start: int, block_table: list[int] | None, samples: bool,
        beams: int = 1,
    ) -> None:
        """Consecutive positions from ``start``; with ``beams`` > 1 every beam is at ``start``.
        ``block_table`` None: the request's table in the KV manager, read on first use."""
        self._add(request, token_ids, 0, len(token_ids), (), start, block_table, samples, beams)

    def append_generation(self, requests: list[LlmRequest]) -> None:
        """The next step of each generation request: its newest token (one per beam), then
        its draft tokens, or first-draft padding up to ``max_draft_len``.

        Built column by column, as every request adds one entry to each column: the usual step
        (one beam, no drafts) is its newest token alone; :func:`_special_step` lays out the others."""
        n, first = len(requests), len(self.requests)
        steps = [[request.tokens[-1]] for request in requests]  # each one's input tokens
        drafts, trailing = [0] * n, [0] * n
        engine = []  # steps whose draft slots the engine fills at launch
        for index, request in enumerate(requests):
            if request.beam_width > 1 or request.is_first_draft or request.py_draft_tokens:
                steps[index], drafts[index], trailing[index] = _special_step(request)
                if drafts[index] and steps[index][1] == IN_FLIGHT_TOKEN_ID:
                    engine.append(index)
        counts = list(map(len, steps))
        in_flight = [index for index, token_ids in enumerate(steps) if token_ids[0] == IN_FLIGHT_TOKEN_ID]
        flat = list(accumulate(counts, initial=self.total_num_tokens)) if in_flight or engine else None
        if in_flight:  # their newest token is still being sampled (overlap): (flat index, request index)
            self.in_flight += [(flat[index], first + index) for index in in_flight]
            for index in in_flight:
                tokens = requests[index].tokens
                if len(tokens) > 1 and tokens[-2] == IN_FLIGHT_TOKEN_ID:  # its forward in flight has draft slots
                    self.in_flight_slots[first + index] = num_in_flight_tokens(tokens) - 1
        for index in engine:
            tokens = requests[index].tokens
            known = len(tokens) - num_in_flight_tokens(tokens)
            self.engine_drafts.append(EngineDrafts(first + index, flat[index] + 1, drafts[index], known))
        self._sources += steps
        self._starts += [0] * n
        self._stops += counts
        self._extras += [()] * n
        self.num_new_tokens += counts
        self.num_cached_tokens += [len(request.tokens) - 1 for request in requests]
        self.num_drafts += drafts
        self._trailing += trailing
        self._beams += [request.beam_width for request in requests]
        self._generation += [True] * n
        self.requests += requests
        self.samples += [True] * n
        self._tables += [None] * n
        self.total_num_tokens += sum(counts)
        self._input_ids = self._position_ids = self._block_tables = self._beam_tables = None

    def append_chunk(self, request: LlmRequest, start: int, stop: int, extra: list[int], samples: bool) -> None:
        """Prompt tokens ``[start, stop)`` of ``request`` followed by ``extra`` (draft tokens), not copied yet.
        A request that asks for prompt log-probabilities gets the logits of every position of it."""
        if request.sampling_config.prompt_logprobs is not None:
            self.prompt_logits.add(len(self.requests))
        self._add(request, request.tokens, start, stop, extra, start, None, samples, 1, len(extra))

    def _add(self, request, source, start, stop, extra, position, block_table, samples, beams, drafts=0) -> None:
        """One request's positions from ``position``: ``source[start:stop]``, then ``extra``."""
        count = stop - start + len(extra)
        self.num_drafts.append(drafts if samples else 0)
        self._trailing.append(drafts)
        self.requests.append(request)
        self.num_new_tokens.append(count)
        self.num_cached_tokens.append(position)
        self.samples.append(samples)
        self._sources.append(source)
        self._starts.append(start)
        self._stops.append(stop)
        self._extras.append(extra)
        self._beams.append(beams)
        self._generation.append(False)
        self._tables.append(block_table)
        self.total_num_tokens += count
        self._input_ids = self._position_ids = self._block_tables = self._beam_tables = None

    def resolve(
        self, tokens: Mapping[int, int], runs: Mapping[int, Sequence[int]] | None = None,
        propose: HostProposal | None = None,
    ) -> None:
        """Fill in what this forward could not know when it was built, on the host: each in-flight
        input takes the token the engine picked for its request in the previous forward
        (``tokens``: request id to token; for a request that verified drafts, the token after its
        accepted ones), and each engine-drafted step its drafts (``propose``, from the tokens the
        request produced; none without it).

        ``runs``: per request that verified drafts in the previous forward, what that forward gave
        it (its accepted drafts, then that token). It was laid out as if every draft slot were
        filled, so this request's positions move back by the slots its run left empty. A request
        with no pick (its previous forward failed) gets token 0: it has failed already, and this
        forward's output for it is dropped."""
        runs = runs or {}
        produced: dict[int, Sequence[int]] = {}  # request index -> the tokens the previous forward gave it
        for flat, index in self.in_flight:
            rid = self.requests[index].request_id
            token = tokens.get(rid)
            run = runs.get(rid) or (() if token is None else (token,))
            produced[index] = run
            token = run[-1] if run else 0
            self._sources[index][0] = token  # the generation step's own list
            if self._input_ids is not None:
                self._input_ids[flat] = token
            back = self.in_flight_slots.get(index, 0) + 1 - len(run) if run else 0
            if back:
                self.num_cached_tokens[index] -= back
                if self._position_ids is not None:  # built already (materialize): move its rows back
                    for row in range(flat, flat + self.num_new_tokens[index]):
                        self._position_ids[row] -= back
        if self.engine_drafts:
            self._propose(produced, propose)

    def _propose(self, produced: Mapping[int, Sequence[int]], propose: HostProposal | None) -> None:
        """Each engine-drafted step's drafts, from its request's known tokens and what the previous
        forward ``produced`` for it, written into its slots (``PAD_TOKEN_ID`` in the slots left over)."""
        histories = [[*self.requests[e.index].tokens[: e.known], *produced.get(e.index, ())] for e in self.engine_drafts]
        proposals = propose(histories, [e.slots for e in self.engine_drafts]) if propose is not None else None
        for i, entry in enumerate(self.engine_drafts):
            drafts = list(proposals[i][: entry.slots]) if proposals is not None else []
            self._proposed[entry.index] = drafts
            filled = drafts + [PAD_TOKEN_ID] * (entry.slots - len(drafts))
            self._sources[entry.index][1 : 1 + entry.slots] = filled
            if self._input_ids is not None:
                self._input_ids[entry.first_row : entry.first_row + entry.slots] = filled

    def verified_drafts(self) -> dict[int, list[int]]:
        """The draft tokens each request verifies in this forward, as its inputs hold them (what
        ``accept_greedy`` compares the target's picks with: ``ForwardOutput.verified_drafts``). An
        engine-drafted step's are there once :meth:`resolve` proposed them (a device engine's come
        back with the forward's tokens instead)."""
        drafts = {}
        engine = {e.index for e in self.engine_drafts}
        for index, (request, source, start, extra, count, samples) in enumerate(zip(
            self.requests, self._sources, self._starts, self._extras, self.num_drafts, self.samples
        )):
            if not count or not samples:
                continue
            if index in engine:
                if index in self._proposed:
                    drafts[request.request_id] = list(self._proposed[index])
            else:
                drafts[request.request_id] = list(extra[:count]) if extra else list(source[start + 1 : start + 1 + count])
        return drafts

    def sampling_position(self, index: int) -> int:
        """The position of request ``index``'s sampling row."""
        if self._beams[index] > 1:
            return self.num_cached_tokens[index]
        return self.num_cached_tokens[index] + self.num_new_tokens[index] - 1 - self._trailing[index]

    def sampling_input_id(self, index: int) -> int:
        """The input token at request ``index``'s sampling row (its last position before any
        draft or padding)."""
        source, stop = self._sources[index], self._stops[index]
        if self._extras[index] or self._trailing[index] == 0:
            return source[stop - 1]
        return source[stop - 1 - self._trailing[index]]

    def sampling_columns(self, vocab_size: int) -> SamplingColumns | None:
        """The sampling parameters of this forward's sampling rows, in logit-row order
        (:func:`.sampling_columns.sampling_columns`); None when every row is plain greedy. A
        penalized request whose newest token is in flight counts it from its input slot."""
        requests = [request for request, samples in zip(self.requests, self.samples) if samples]
        if not requests:
            return None
        return sampling_columns(requests, vocab_size, in_flight=self._in_flight_rows, token_masks=self.token_masks)

    def _in_flight_rows(self) -> dict[int, int]:
        """Sampling row -> flat slot of each in-flight input (asked only when some row is penalized)."""
        if not self.in_flight:
            return {}
        row_of = {index: row for row, index in enumerate(i for i, samples in enumerate(self.samples) if samples)}
        return {row_of[index]: flat for flat, index in self.in_flight}

    def materialize(self) -> None:
        """Build the flat inputs and copy the block tables now: a forward that runs after
        launch must not read request or KV state that has moved on since."""
        self.input_ids, self.position_ids  # noqa: B018 (built and kept)
        self._block_tables = [list(table) for table in self.block_tables]
        self._beam_tables = [None if t is None else [list(b) for b in t] for t in self.beam_block_tables]

    def logit_layout(self) -> LogitRows:
        """The flat rows whose logits this forward computes, and whose they are
        (:func:`.logit_rows.logit_layout`): sampling rows first, then prompt, draft and beam rows."""
        prompt_chunks = {}
        for index in self.prompt_logits:
            start = self._starts[index]
            prompt_chunks[index] = (start, self._stops[index] - start)
        return logit_layout(RowColumns(
            [request.request_id for request in self.requests], self.num_new_tokens, self.samples, self._trailing,
            self.num_drafts, self._beams, prompt_chunks,
        ))

    @property
    def input_ids(self) -> list[int]:
        if self._input_ids is None:
            ids: list[int] = []
            for source, start, stop, extra in zip(self._sources, self._starts, self._stops, self._extras):
                ids += source[start:stop]
                ids += extra
            self._input_ids = ids
        return self._input_ids

    @property
    def position_ids(self) -> list[int]:
        if self._position_ids is None:
            positions: list[int] = []
            for start, count, beams in zip(self.num_cached_tokens, self.num_new_tokens, self._beams):
                positions += [start] * beams if beams > 1 else range(start, start + count)
            self._position_ids = positions
        return self._position_ids

    @property
    def block_tables(self) -> list[list[int]]:
        if self._block_tables is None:
            self._block_tables = [
                table if table is not None else self._kv.block_table(request)
                for request, table in zip(self.requests, self._tables)
            ]
        return self._block_tables

    @property
    def has_beams(self) -> bool:
        """Whether some request runs several beams (each its own sequence to attention)."""
        return any(beams > 1 for beams in self._beams)

    @property
    def beam_block_tables(self) -> list[list[list[int]] | None]:
        """Per request: the block table of each of its beams (a beam-search request), else None."""
        if self._beam_tables is None:
            self._beam_tables = [
                self._kv.sequences.beam_block_tables(request) if beams > 1 else None
                for request, beams in zip(self.requests, self._beams)
            ]
        return self._beam_tables

    @property
    def has_verification_rows(self) -> bool:
        """Whether some generation step runs several positions (drafts, first-draft padding)."""
        return any(self._trailing[i] and self._beams[i] == 1 and self._generation[i] for i in range(len(self.requests)))

    def attention_batch(self) -> tuple[list[int], list[int], list[list[int]]]:
        """``(num_new_tokens, num_cached_tokens, block_tables)`` per *sequence* as attention sees
        them: a request's; for a beam-search request, one sequence per beam (one new token each,
        at the same position, over its own table); for a generation step with drafts (and
        first-draft padding), one sequence per position, each a decode of one token over the
        request's table (position ``j`` attends to ``[0, cached + j]``, what a chunk's causal
        mask gives it), so a verification step runs the decode kernel and its CUDA graphs. The
        flat rows are the same either way."""
        beams_here, rows_here = self.has_beams, self.has_verification_rows
        if not beams_here and not rows_here:
            return self.num_new_tokens, self.num_cached_tokens, self.block_tables
        new: list[int] = []
        cached: list[int] = []
        tables: list[list[int]] = []
        beam_tables_all = self.beam_block_tables if beams_here else [None] * len(self.requests)
        for n, c, table, beams, beam_tables, generation in zip(
            self.num_new_tokens, self.num_cached_tokens, self.block_tables, self._beams, beam_tables_all,
            self._generation,
        ):
            if beams > 1:
                if len(beam_tables) != beams:
                    raise ValueError(f"{len(beam_tables)} block tables for the {beams} beams of a request")
                new += [1] * beams
                cached += [c] * beams
                tables += beam_tables
            elif generation and n > 1:  # a verification step: one decode row per position
                new += [1] * n
                cached += range(c, c + n)
                tables += [table] * n
            else:
                new.append(n)
                cached.append(c)
                tables.append(table)
        return new, cached, tables


#: The name this class had first ("Tp" read as tensor parallel, which it is not); kept for outside users.
TpInputs = ForwardInputs


def prepare_tp_inputs(
    scheduled: ScheduledRequests, kv_cache_manager: KVCacheManager, max_num_tokens: int
) -> ForwardInputs:
    """Flat inputs for the batch (upstream's ``_prepare_tp_inputs``); raises TokenBudgetExceeded
    past ``max_num_tokens``."""
    inputs = ForwardInputs(kv_cache_manager)
    for chunk in scheduled.context_chunks:
        request = chunk.request
        last = chunk.is_last
        inputs.append_chunk(request, chunk.start, chunk.end, request.py_draft_tokens if last else (), samples=last)
    inputs.append_generation(scheduled.generation_requests)
    costs = [chunk.cost() for chunk in scheduled.context_chunks]
    costs += map(forward_cost, scheduled.generation_requests)
    assert costs == inputs.num_new_tokens, "position count drift from forward_cost"
    if inputs.total_num_tokens > max_num_tokens:
        raise TokenBudgetExceeded(inputs.total_num_tokens, max_num_tokens)
    return inputs
