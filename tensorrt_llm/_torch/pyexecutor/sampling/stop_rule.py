"""When a request is over: the one stop rule every path that delivers tokens asks.

A request ends at the first delivered token that is its ``end_id`` or one of its
``stop_token_ids`` (kept: upstream returns it), or at the token that brings its sequence to
``max_total_len`` (prompt + ``max_new_tokens``). Tokens after that one are dropped.
"""

from __future__ import annotations

from typing import Sequence

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

# The answer "keep all n, go on" for the usual deliveries (one token, or a few with drafts),
# made once: this runs for every request in every iteration.
_GO_ON = tuple((n, False) for n in range(17))


def finish(request: LlmRequest, tokens: Sequence[int], length: int) -> tuple[int, bool]:
    """``(kept, finished)`` for ``tokens`` delivered after the first ``length`` tokens of
    ``request``'s sequence: how many of them it keeps, and whether the last kept one ends it."""
    # max_total_len without the property's call: the token at index room - 1 reaches the limit
    room = request.orig_prompt_len + request.max_new_tokens - length
    count = len(tokens)
    if request.end_id is None and not request.stop_token_ids:  # the usual request: only the length can end it
        if room > count:
            return _GO_ON[count] if count < 17 else (count, False)
        return (room if room > 1 else 1), True
    end_id, stops = request.end_id, request.stop_token_ids
    for index, token in enumerate(tokens):
        if token == end_id or token in stops or index + 1 >= room:
            return index + 1, True
    return count, False
