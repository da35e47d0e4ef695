"""``Response``: what one iteration tells a request's submitter, and the callback it goes to.

A value beneath the iteration that builds it and the executors that deliver it
(``executor.client`` names it in the interface every executor implements).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


class Response(NamedTuple):
    """What changed for one request: new tokens, and whether it is over (and how).

    A tuple: one is built per request per iteration, and a frozen dataclass costs several
    times as much to build.
    """

    request_id: int
    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None
    cancelled: bool = False
    # Beam search: the returned beams, best first (``beam_search.Hypothesis``), on the final
    # response only; ``new_token_ids`` then holds the best one's tokens (nothing was sent before).
    beams: tuple | None = None
    # On the response that carries a request's first token (and on a beam search's one
    # response): the prompt tokens whose KV came from the prefix cache (its
    # ``prepopulated_prompt_len``, what the Prometheus prefix-hit counter adds up); None on the others.
    cached_tokens: int | None = None


ResponseCallback = Callable[[LlmRequest, Response], None]
