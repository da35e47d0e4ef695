"""A model engine without a model: everything but the arithmetic runs for real.

Scheduling, the KV manager (bookkeeping mode), the token-budget policy and
``_prepare_tp_inputs`` behave exactly as with :class:`TorchModelEngine`; the forward
itself only advances a :class:`VirtualClock` by a forward-time model's estimate, and
:class:`SyntheticSampler` emits deterministic tokens that depend on the sequence so far. The replay's ``sim`` engine and the
executor-level tests use it.
"""

from __future__ import annotations

from typing import Callable

from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput, ModelEngine, TpInputs
from tensorrt_llm._torch.pyexecutor.sampler import Sampler


class VirtualClock:
    """Seconds that pass only when someone says so; callable like ``time.monotonic``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class SimulatedModelEngine(ModelEngine):
    """Runs ``_prepare_tp_inputs`` for real and charges ``forward_time_s(inputs)`` to the clock."""

    max_beam_width = 8
    supports_draft_tokens = True

    def __init__(
        self,
        max_num_tokens: int,
        kv_cache_manager: KVCacheManager,
        *,
        vocab_size: int = 32000,
        clock: VirtualClock | None = None,
        forward_time_s: Callable[[TpInputs], float] | None = None,
    ) -> None:
        super().__init__(max_num_tokens, kv_cache_manager)
        self._vocab_size = vocab_size
        self.clock = clock
        self.forward_time_s = forward_time_s

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _run(self, inputs: TpInputs) -> ForwardOutput:
        if self.clock is not None and self.forward_time_s is not None:
            self.clock.advance(self.forward_time_s(inputs))
        return ForwardOutput(logits={r.request_id: None for r, s in zip(inputs.requests, inputs.samples) if s})


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

    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int]:
        tokens = request.tokens
        position = len(tokens)
        token = 1 + (tokens[-1] * 1_000_003 + position * 7919) % (self.vocab_size - 1)
        while token == request.end_id or token in request.stop_token_ids:
            token = 1 + token % (self.vocab_size - 1)
        return [token]

    def sample_batch(self, requests: list[LlmRequest], output: ForwardOutput) -> list[list[int]]:
        modulus = self.vocab_size - 1
        batch = [[1 + (r.tokens[-1] * 1_000_003 + len(r.tokens) * 7919) % modulus] for r in requests]
        for request, tokens in zip(requests, batch):  # the rare request with a stop condition
            if request.end_id is not None or request.stop_token_ids:
                tokens[0] = self.sample(request, output)[0]
        return batch
