"""The logit-row layout: which rows of a forward's logits belong to which request, and why.

A forward computes logits only for the flat positions someone reads. :func:`logit_layout` lists
them in four runs, always in this order, so that rows ``[0, len(request_ids))`` are the
*sampling rows* (one per request that produces a token this step: its last position before any
draft or padding, which predicts its next token) whatever follows::

    flat positions (the forward's inputs)   0  1  2 | 3  4  5 | 6  7  8
        request 7: a whole prompt, asking     p0 p1 p2 |          |
                   for prompt logprobs                 |          |
        request 8: generation, 2 drafts                | t  d1 d2 |
        request 9: beam search, width 3                |          | b0 b1 b2

    logit row     0  1  2 | 3  4  5 | 6  7 | 8  9
    flat position 2  3  6 | 0  1  2 | 4  5 | 7  8
                  sampling | prompt  | draft | beam (beams 1.. of each beam search)

    request_ids  [7, 8, 9]
    prompt_spans [(7, 0, 3, 3)]   PromptSpan: request id, first prompt position, first row, count
    drafts       [(8, 1, 6, 2)]   DraftSpan: request id, its sampling row, first draft row, count
    beams        [(9, 2, 8, 2)]   BeamSpan: request id, its sampling row (beam 0's), beam 1's row, count

The row after draft ``j`` predicts the token after it, so a verifying request's greedy picks,
read back in this order, are :func:`draft_targets`. Nothing here needs torch: the engine gathers
``hidden[rows]`` and hands each span's rows to whoever reads them.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

#: A context chunk's prompt rows among :attr:`LogitRows.rows`: (request id, the prompt position
#: of its first row, index of its first row, number of rows).
PromptSpan = tuple[int, int, int, int]

#: A request's draft rows among :attr:`LogitRows.rows`: (request id, index of its sampling row,
#: index of its first draft row, number of drafts).
DraftSpan = tuple[int, int, int, int]

#: A beam-search request's beam rows among :attr:`LogitRows.rows`: (request id, index of its
#: sampling row, which is beam 0's, index of beam 1's row, number of beams after beam 0).
BeamSpan = tuple[int, int, int, int]


class RowColumns(NamedTuple):
    """What decides the rows of each request of a forward: one entry per request, in forward
    order (the columns :class:`~.inputs.ForwardInputs` keeps as requests are appended)."""

    request_ids: Sequence[int]
    num_new_tokens: Sequence[int]  # its positions in the forward
    samples: Sequence[bool]  # it produces a token this step
    trailing: Sequence[int]  # its positions after its sampling row: drafts then padding, or beams 1..
    num_drafts: Sequence[int]  # the drafts it verifies (0 for a request that does not sample)
    beams: Sequence[int]  # its beam width (1: no beam search)
    prompt_chunks: Mapping[int, tuple[int, int]]  # request index -> (first prompt position, count): prompt logits


class LogitRows(NamedTuple):
    """The flat rows whose logits a forward computes, in order: the sampling rows (one per request
    that samples: ``request_ids``), the prompt rows (``prompt_spans``), the draft rows (``drafts``),
    then the rows of beams 1.. of each beam-search request in generation (``beams``)."""

    rows: list[int]
    request_ids: list[int]
    prompt_spans: list[PromptSpan]
    drafts: list[DraftSpan]
    beams: list[BeamSpan]


def logit_layout(columns: RowColumns) -> LogitRows:
    """The rows of a forward's logits, laid out as the module docstring draws them:

    1. each sampling request's sampling row (its last position before ``trailing`` ones);
    2. every position of each chunk in ``prompt_chunks``, one :data:`PromptSpan` each;
    3. for each sampling request that verifies drafts, the row of each draft (:data:`DraftSpan`);
    4. for each beam-search request, the rows of its beams after beam 0 (:data:`BeamSpan`).
    """
    rows: list[int] = []
    request_ids: list[int] = []
    prompt_spans: list[PromptSpan] = []
    offset = 0
    for index, (rid, n, samples, trailing) in enumerate(
        zip(columns.request_ids, columns.num_new_tokens, columns.samples, columns.trailing)
    ):
        offset += n
        if samples:
            rows.append(offset - 1 - trailing)
            request_ids.append(rid)
        if index in columns.prompt_chunks:
            start, count = columns.prompt_chunks[index]
            prompt_spans.append((rid, start, offset - n, count))  # its first flat position, for now
    first_row = len(rows)
    for i, (rid, start, first, count) in enumerate(prompt_spans):
        rows += range(first, first + count)
        prompt_spans[i] = (rid, start, first_row, count)
        first_row += count
    sampling = len(request_ids)
    drafts: list[DraftSpan] = []
    if any(columns.num_drafts):
        counts = [d for d, samples in zip(columns.num_drafts, columns.samples) if samples]
        for index, (row, rid, count) in enumerate(zip(rows[:sampling], request_ids, counts)):
            if count:
                drafts.append((rid, index, len(rows), count))
                rows.extend(range(row + 1, row + 1 + count))
    beams: list[BeamSpan] = []
    if any(width > 1 for width in columns.beams):
        widths = [w for w, samples in zip(columns.beams, columns.samples) if samples]
        for index, (row, rid, width) in enumerate(zip(rows[:sampling], request_ids, widths)):
            if width > 1:
                beams.append((rid, index, len(rows), width - 1))
                rows.extend(range(row + 1, row + width))
    return LogitRows(rows, request_ids, prompt_spans, drafts, beams)


def draft_targets(
    picks: list[int], spans: list[DraftSpan], verified: Mapping[int, Sequence[int]] | None = None
) -> dict[int, list[int]] | None:
    """Each verifying request's greedy picks (``picks``: one per row of :attr:`LogitRows.rows`, in
    order), at its sampling row, then after each draft (``ForwardOutput.draft_targets``). None: no drafts.

    ``verified``: the drafts each request verified, where they may be fewer than its draft rows
    (an engine that proposes drafts at launch fills a step's slots with as many as it finds):
    its picks then stop after its last draft."""
    if not spans:
        return None
    targets = {rid: [picks[index], *picks[first : first + count]] for rid, index, first, count in spans}
    if verified is not None:
        for rid, picks_after in targets.items():
            drafts = verified.get(rid)
            if drafts is not None and len(drafts) + 1 < len(picks_after):
                del picks_after[len(drafts) + 1 :]
    return targets
