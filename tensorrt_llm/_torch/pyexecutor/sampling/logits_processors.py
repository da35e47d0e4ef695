"""What happens to one request's logits row between the forward and the draw, on the host.

Each function works in place on a float64 CPU row ``(vocab,)`` and reads the request; none
keeps state. The host sampler (``TorchSampler``'s float64 path: the reference of the engine's
device pass, ``engine.sampling_pass.process_logits``, which does the same arithmetic batched)
calls them in this order (vLLM's): penalties, ``min_tokens``, then the grammar mask
(``guided_decoder``), then temperature / top-k / top-p in the sampler itself.
Log-probabilities are read from the raw row, before any of them (:func:`token_logprob`); a
prompt's from its chunks' rows (:func:`record_prompt_logprobs`).
"""

from __future__ import annotations

import numpy as np
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig, TokenLogprob


def _ids(tokens) -> torch.Tensor:
    """Token ids as a tensor (placeholders of forwards in flight, which are negative, left out)."""
    ids = torch.from_numpy(np.frombuffer(tokens, dtype=np.int64).copy()) if len(tokens) else torch.empty(0, dtype=torch.int64)
    return ids[ids >= 0]


def apply_penalties(logits: torch.Tensor, config: SamplingConfig, request: LlmRequest) -> None:
    """Repetition penalty over the prompt and the output; frequency and presence penalties over the
    output only (OpenAI's definition: they discourage repeating what the model itself said)."""
    if config.repetition_penalty != 1.0:
        seen = torch.unique(_ids(request.tokens))
        seen = seen[seen < logits.numel()]
        values = logits[seen]
        penalty = config.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if config.frequency_penalty or config.presence_penalty:
        output = _ids(request.tokens[request.orig_prompt_len :])
        output = output[output < logits.numel()]
        if output.numel():
            counts = torch.bincount(output, minlength=logits.numel()).to(logits.dtype)
            logits -= counts * config.frequency_penalty + (counts > 0).to(logits.dtype) * config.presence_penalty


def forbid_end_before_min_tokens(logits: torch.Tensor, config: SamplingConfig, request: LlmRequest) -> None:
    """Until ``min_tokens`` tokens are out, the ids that would end the request cannot be drawn."""
    if request.num_generated_tokens >= config.min_tokens:
        return
    ends = [t for t in (request.end_id, *request.stop_token_ids) if t is not None and 0 <= t < logits.numel()]
    if ends:
        logits[ends] = float("-inf")


def token_logprob(raw_logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the raw row (float64 log-softmax) and the ``top`` most
    likely ids with theirs."""
    return token_logprobs(raw_logits.unsqueeze(0), [token], top)[0]


def token_logprobs(raw_logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """:func:`token_logprob` of each row of ``raw_logits`` ``(n, vocab)`` for the token at the same index."""
    logprobs = torch.log_softmax(raw_logits.to("cpu", torch.float64), dim=-1)  # (n, vocab)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)  # (n, top)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


def record_prompt_logprobs(request: LlmRequest, start: int, rows: torch.Tensor) -> None:
    """Fill ``request.py_prompt_logprobs`` from a context chunk's logits: row ``i`` is position
    ``start + i``, whose logits predict prompt token ``start + i + 1``. Positions past the
    original prompt (a request recomputing its output after a pause) are not prompt positions."""
    prompt_len = request.orig_prompt_len
    if len(request.py_prompt_logprobs) != prompt_len:
        request.py_prompt_logprobs = [None] * prompt_len
    count = min(len(rows), prompt_len - 1 - start)
    if count <= 0:
        return
    targets = request.tokens[start + 1 : start + 1 + count].tolist()
    entries = token_logprobs(rows[:count], targets, request.sampling_config.prompt_logprobs)
    request.py_prompt_logprobs[start + 1 : start + 1 + count] = entries
