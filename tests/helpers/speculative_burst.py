"""A burst of requests far above ``max_concurrency`` for its whole life: the workload of the tests
that hold a speculative config there to plain decoding's work (batches, forwards, KV allocations,
device ops, host calls).

Its prompts repeat a short unit (prompt lookup finds drafts in them, and tiny-random's outputs
cycle); :func:`lengths_ending_together` gives each request a ``max_new_tokens`` such that all
finish in the same iteration, so no tail below the limit (where drafts are welcome) remains.
"""

from __future__ import annotations

import dataclasses

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import SpeculativeConfig
from tests.helpers import factories

__all__ = ["BUDGET", "MAX_CONCURRENCY", "MAX_TOKENS", "NUM_REQUESTS", "PROMPTS", "SPEC", "burst_model",
           "lengths_ending_together"]

NUM_REQUESTS, MAX_CONCURRENCY, PROMPT_LEN, BUDGET, MAX_TOKENS = 16, 4, 48, 112, 14
PROMPTS = [[(i * 7 + j % 6) % 400 + 1 for j in range(PROMPT_LEN)] for i in range(NUM_REQUESTS)]
SPEC = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=3, max_concurrency=MAX_CONCURRENCY)


def burst_model():
    """tiny-random in float32, served."""
    return factories.served_model(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32"))


def lengths_ending_together(first_token_steps: list[int]) -> list[int]:
    """Each request's max_new_tokens from the iteration its first token came in (plain decoding,
    ``MAX_TOKENS`` each): a request whose first token comes k steps after the first one's
    generates k fewer."""
    first = first_token_steps
    assert max(first) - min(first) >= 3, f"the burst must start generating over several iterations: {first}"
    return [MAX_TOKENS - (step - min(first)) for step in first]
