"""When a request is over: the one stop rule every path that delivers tokens asks.

A request ends at the first delivered token that is its ``end_id`` or one of its
``stop_token_ids`` (kept: upstream returns it), or at the token that brings its sequence to
``max_total_len`` (prompt + ``max_new_tokens``). Tokens after that one are dropped.
"""

from __future__ import annotations

from typing import Sequence

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


def finish(request: LlmRequest, tokens: Sequence[int], length: int) -> tuple[int, bool]:
    """``(kept, finished)`` for ``tokens`` delivered after the first ``length`` tokens of
    ``request``'s sequence: how many of them it keeps, and whether the last kept one ends it."""
    end_id, stops = request.end_id, request.stop_token_ids
    room = request.max_total_len - length  # the token at index room - 1 reaches the limit
    if end_id is None and not stops:  # the usual request: only the length can end it
        return (max(room, 1), True) if room <= len(tokens) else (len(tokens), False)
    for index, token in enumerate(tokens):
        if token == end_id or token in stops or index + 1 >= room:
            return index + 1, True
    return len(tokens), False
