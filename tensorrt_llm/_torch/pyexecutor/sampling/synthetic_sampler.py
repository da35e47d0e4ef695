"""``SyntheticSampler``: the simulated engine's tokens, deterministic and schedule-independent."""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler


class SyntheticSampler(Sampler):
    """One deterministic token per step, a function of the sequence so far: of the last token
    and the position (a Markov chain over tokens), so that a token lost, repeated or appended
    out of order changes everything generated after it. Like greedy decoding, equal
    sequences continue equally, whatever the request or the schedule.

    Never emits ``end_id`` or a stop token, so a request runs to ``max_new_tokens``
    (a trace's output length). Draft tokens are all rejected (the bonus token is kept).
    """

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def next_token(self, request: LlmRequest, last_token: int, position: int) -> int:
        """The token at ``position`` after ``last_token`` (the rule; also the engine's pick)."""
        token = 1 + (last_token * 1_000_003 + position * 7919) % (self.vocab_size - 1)
        while token == request.end_id or token in request.stop_token_ids:
            token = 1 + token % (self.vocab_size - 1)
        return token

    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int]:
        picked = output.greedy_tokens if output is not None else None
        if picked is not None and request.request_id in picked:  # the engine ran the rule (overlap)
            return [picked[request.request_id]]
        return [self.next_token(request, request.tokens[-1], len(request.tokens))]

    def sample_batch(self, requests: list[LlmRequest], output: ForwardOutput) -> list[list[int]]:
        if output is not None and output.greedy_tokens:
            return [self.sample(r, output) for r in requests]
        modulus = self.vocab_size - 1
        # next_token's rule inlined (a call per request costs the replay more than the rule);
        # requests with a stop condition go through next_token below
        batch = [[1 + (r.tokens[-1] * 1_000_003 + len(r.tokens) * 7919) % modulus] for r in requests]
        for request, tokens in zip(requests, batch):  # the rare request with a stop condition
            if request.end_id is not None or request.stop_token_ids:
                tokens[0] = self.sample(request, output)[0]
        return batch
