"""The forward-pass cost of a request: the single source of truth for token accounting.

``forward_cost`` returns the number of positions ``_prepare_tp_inputs`` appends for a
request, given its current state. The remaining_budget re-check, the scheduler's
full-cost path, ``_prepare_tp_inputs`` itself and the tests all call it; nothing else
counts positions.

Positions per request (upstream's counts):

=====================================  ==============================================
context chunk                          ``min(context_chunk_size, prompt_len - pos)``,
                                       plus the draft tokens on a last chunk
plain generation                       ``beam_width``
generation with draft tokens           ``1 + num_draft_tokens``
first-draft generation                 ``1 + max_draft_len``
=====================================  ==============================================
"""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT


def forward_cost(request: LlmRequest, *, reuse_can_shift: bool = False) -> int:
    """Positions ``request`` adds to the next forward.

    With ``reuse_can_shift`` (a first chunk not yet allocated, block reuse on) the result
    is an upper bound over every reuse outcome: reuse only moves the window start forward
    and never lengthens it, but it can turn the chunk into the last one, which then
    carries the draft tokens. Without reuse materialising, the bound is exact.
    """
    # Plain attribute reads, no properties: this runs for every request in every iteration.
    if request.state is _CONTEXT_INIT:
        remaining = request.prompt_len - request.context_current_position
        chunk = min(request._context_chunk_size, remaining)
        if request.py_draft_tokens and (reuse_can_shift or chunk >= remaining):
            return chunk + len(request.py_draft_tokens)
        return chunk
    if request.is_first_draft:
        return 1 + request.max_draft_len
    if request.py_draft_tokens:
        return 1 + len(request.py_draft_tokens)
    return request.beam_width
