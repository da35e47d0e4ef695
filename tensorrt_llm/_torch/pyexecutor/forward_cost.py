"""The forward-pass cost of a request: the single source of truth for token accounting.

``forward_cost`` returns the number of positions ``_prepare_tp_inputs`` appends for a
request: for a context request, the chunk of prompt positions ``[start, start + chunk)``
the caller names (a chunk is a decision of the iteration, not a field of the request);
for a generation request, its next step. The scheduler's full-cost path, the
remaining_budget re-check, ``_prepare_tp_inputs`` itself, the replay's diagnosis and the
tests all call it; nothing else counts positions.

Positions per request (upstream's counts):

=====================================  ==============================================
context chunk                          ``min(chunk, prompt_len - start)``,
                                       plus the draft tokens on a last chunk
plain generation                       ``beam_width``
generation with draft tokens           ``1 + num_draft_tokens``
first-draft generation                 ``1 + max_draft_len``
=====================================  ==============================================

Under the overlap scheduler a speculative request whose previous forward is in flight has draft
*slots* (``IN_FLIGHT_TOKEN_ID`` entries of ``py_draft_tokens``) that the engine fills at launch:
they are draft tokens here, so such a step costs ``1 + slots`` whatever the engine finds.
"""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT


def forward_cost(request: LlmRequest, chunk: int = 0, start: int | None = None, *, reuse_can_shift: bool = False) -> int:
    """Positions ``request`` adds to the next forward.

    Context requests: :func:`context_cost` of the chunk of ``chunk`` prompt tokens from
    ``start`` (default: the request's ``context_current_position``). Generation requests
    ignore ``chunk`` and ``start``.
    """
    # Plain attribute reads, no properties: this runs for every request in every iteration.
    if request.state is _CONTEXT_INIT:
        return context_cost(request, chunk, request.context_current_position if start is None else start,
                            reuse_can_shift=reuse_can_shift)
    if request.is_first_draft:
        return 1 + request.max_draft_len
    if request.py_draft_tokens:
        return 1 + len(request.py_draft_tokens)
    return request.beam_width


def context_cost(request: LlmRequest, chunk: int, start: int, *, reuse_can_shift: bool = False) -> int:
    """Positions of a context chunk: ``chunk`` prompt tokens from ``start``, plus the drafts on
    a last chunk.

    With ``reuse_can_shift`` (a first chunk not yet allocated, block reuse on) the result is
    an upper bound over every reuse outcome: reuse only moves the window start forward and
    never lengthens it, but it can turn the chunk into the last one, which then carries the
    draft tokens. Without reuse materialising the bound is exact.
    """
    remaining = request.prompt_len - start
    size = chunk if chunk < remaining else remaining
    if request.py_draft_tokens and (reuse_can_shift or size >= remaining):
        return size + len(request.py_draft_tokens)
    return size
