"""The logit-row layout (``engine.logit_rows``): sampling rows first, then prompt, draft and beam
rows, each run described by its spans; the same layout read from a real ``ForwardInputs``; and a
property over random batches (every span points at the rows its request owns)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs
from tensorrt_llm._torch.pyexecutor.engine.logit_rows import LogitRows, RowColumns, draft_targets, logit_layout
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

# The module docstring's picture: request 7 a whole 3-token prompt asking for prompt logprobs,
# request 8 a generation step verifying 2 drafts, request 9 a beam search of width 3.
PICTURE = RowColumns(
    request_ids=[7, 8, 9], num_new_tokens=[3, 3, 3], samples=[True, True, True], trailing=[0, 2, 2],
    num_drafts=[0, 2, 0], beams=[1, 1, 3], prompt_chunks={0: (0, 3)},
)
PICTURE_ROWS = LogitRows(
    rows=[2, 3, 6, 0, 1, 2, 4, 5, 7, 8], request_ids=[7, 8, 9], prompt_spans=[(7, 0, 3, 3)],
    drafts=[(8, 1, 6, 2)], beams=[(9, 2, 8, 2)],
)


def test_the_docstring_picture():
    assert logit_layout(PICTURE) == PICTURE_ROWS


def test_a_forward_of_the_picture_lays_out_the_same_rows():
    """The picture built for real: ``append_chunk`` and ``append_generation`` fill the columns."""
    prompt = make_request([11, 12, 13], request_id=7, sampling_config=SamplingConfig(prompt_logprobs=0))
    drafts = make_request([21, 22], request_id=8)
    beams = make_request([31, 32, 33, 34], request_id=9, beam_width=3)
    for request, newest in ((drafts, 23), (beams, 35)):
        request.complete_context_chunk(request.prompt_len)
        request.state = LlmRequestState.GENERATION_IN_PROGRESS
        request.add_new_token(newest)
    drafts.py_draft_tokens = [24, 25]
    inputs = ForwardInputs()
    inputs.append_chunk(prompt, 0, 3, (), samples=True)
    inputs.append_generation([drafts, beams])
    assert inputs.input_ids == [11, 12, 13, 23, 24, 25, 35, 35, 35]  # a beam search before its first step: one token
    assert inputs.logit_layout() == PICTURE_ROWS


def test_a_chunk_that_does_not_sample_has_prompt_rows_only():
    """An early chunk (not the prompt's last) produces no token: no sampling row, and its drafts,
    if it carried any, are not verified; its prompt rows still come after every sampling row."""
    columns = RowColumns(
        request_ids=[1, 2], num_new_tokens=[4, 1], samples=[False, True], trailing=[0, 0], num_drafts=[0, 0],
        beams=[1, 1], prompt_chunks={0: (8, 4)},
    )
    assert logit_layout(columns) == LogitRows([4, 0, 1, 2, 3], [2], [(1, 8, 1, 4)], [], [])


def test_first_draft_padding_is_never_a_row():
    """A first-draft step of 1 token, 1 draft and 3 padding positions: its sampling row is the
    token's, one draft row, and the padding is computed but never read."""
    columns = RowColumns([5], [5], [True], trailing=[4], num_drafts=[1], beams=[1], prompt_chunks={})
    assert logit_layout(columns) == LogitRows([0, 1], [5], [], [(5, 0, 1, 1)], [])


def test_draft_targets_read_each_verifying_requests_picks_in_row_order():
    picks = [100 + row for row in PICTURE_ROWS.rows]
    assert draft_targets(picks, PICTURE_ROWS.drafts) == {8: [103, 104, 105]}
    assert draft_targets(picks, []) is None


# ---- property: every span points at its own request's rows ---------------------------------------


@dataclass(frozen=True)
class Entry:
    """One request of a random forward, as the layout sees it."""

    n: int
    samples: bool
    trailing: int
    drafts: int
    beams: int
    prompt: tuple[int, int] | None  # (first prompt position, count)


@st.composite
def entries(draw) -> Entry:
    kind = draw(st.sampled_from(["chunk", "generation", "beam"]))
    if kind == "chunk":
        length, samples = draw(st.integers(1, 8)), draw(st.booleans())
        extra = draw(st.integers(0, 2)) if samples else 0  # a last chunk carries the drafts proposed so far
        prompt = (draw(st.integers(0, 50)), length) if draw(st.booleans()) else None
        return Entry(length + extra, samples, extra, extra, 1, prompt)
    if kind == "generation":
        drafts, padding = draw(st.integers(0, 3)), draw(st.integers(0, 2))
        return Entry(1 + drafts + padding, True, drafts + padding, drafts, 1, None)
    width = draw(st.integers(2, 4))
    return Entry(width, True, width - 1, 0, width, None)


@given(st.lists(entries(), min_size=1, max_size=8))
def test_every_span_points_at_its_own_requests_rows(batch):
    columns = RowColumns(
        request_ids=[100 + i for i in range(len(batch))], num_new_tokens=[e.n for e in batch],
        samples=[e.samples for e in batch], trailing=[e.trailing for e in batch],
        num_drafts=[e.drafts for e in batch], beams=[e.beams for e in batch],
        prompt_chunks={i: e.prompt for i, e in enumerate(batch) if e.prompt is not None},
    )
    layout = logit_layout(columns)
    starts = [sum(e.n for e in batch[:i]) for i in range(len(batch))]
    sampling = [i for i, e in enumerate(batch) if e.samples]
    # 1. the sampling rows, in order: each request's last position before its trailing ones
    assert layout.request_ids == [100 + i for i in sampling]
    assert layout.rows[: len(sampling)] == [starts[i] + batch[i].n - 1 - batch[i].trailing for i in sampling]
    # 2. prompt rows right after them, one span per asking chunk, its first positions in order
    next_row = len(sampling)
    assert [rid for rid, *_ in layout.prompt_spans] == [100 + i for i in sorted(columns.prompt_chunks)]
    for rid, start, first, count in layout.prompt_spans:
        i = rid - 100
        assert (start, count) == batch[i].prompt and first == next_row
        assert layout.rows[first : first + count] == list(range(starts[i], starts[i] + count))
        next_row += count
    # 3. draft rows, then 4. beam rows: the positions right after the request's sampling row
    assert [rid - 100 for rid, *_ in layout.drafts] == [i for i in sampling if batch[i].drafts]
    assert [rid - 100 for rid, *_ in layout.beams] == [i for i in sampling if batch[i].beams > 1]
    for spans in (layout.drafts, layout.beams):
        for rid, index, first, count in spans:
            assert layout.request_ids[index] == rid and first == next_row
            row = layout.rows[index]
            assert layout.rows[first : first + count] == list(range(row + 1, row + 1 + count))
            next_row += count
    assert len(layout.rows) == next_row
    # every row is one of its request's own positions
    owner = [i for i, e in enumerate(batch) for _ in range(e.n)]
    for rid, index, first, count in layout.drafts + layout.beams:
        assert {owner[r] for r in layout.rows[first : first + count]} == {rid - 100}
