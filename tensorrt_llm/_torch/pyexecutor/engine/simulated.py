"""A model engine without a model: everything but the arithmetic runs for real.

Scheduling, the KV manager (bookkeeping mode), the token-budget policy and
``_prepare_tp_inputs`` behave exactly as with :class:`TorchModelEngine`; the forward
itself only advances a :class:`VirtualClock` by a forward-time model's estimate, and
``synthetic_sampler.SyntheticSampler`` emits deterministic tokens that depend on the sequence
so far. The replay's ``sim`` engine and the executor-level tests use it. It imports no torch.

``LLM(..., simulated_engine=SimulatedEngineConfig(...))`` serves it in real time: each forward
sleeps (:class:`SleepingClock`) what :class:`LinearForwardTime` says the batch costs, so a
server, a client and a router see the latencies of a device they do not have (replicas behind
real HTTP on a small CPU machine).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput, ModelEngine
from tensorrt_llm._torch.pyexecutor.engine.inputs import ForwardInputs
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.speculative.proposer import DraftProposer


class TokenRule(Protocol):
    """The rule a synthetic sampler emits tokens by (``sampling.synthetic_sampler.SyntheticSampler``
    is one): the engine only calls it, so it names no sampler (the sampling package sits above
    the engine)."""

    def next_token(self, request: LlmRequest, last_token: int, position: int) -> int: ...


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


class SleepingClock:
    """Wall-clock seconds (``time.monotonic``) whose ``advance`` sleeps: the simulated engine's
    forward takes its cost in real time (the executor's loop and its clients wait for it)."""

    def __call__(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        time.sleep(seconds)  # releases the GIL: the server's event loop runs meanwhile


@dataclass(frozen=True, slots=True)
class SimulatedEngineConfig:
    """A forward without a model (``LLM(simulated_engine=...)``): the KV manager keeps books only,
    tokens come from ``SyntheticSampler``, and the forward takes, in real time,

        step_s + context_token_s * context positions + context_attention_s * (position, key) pairs
               + decode_token_s * decode positions + decode_kv_token_s * KV tokens decodes read

    (a context chunk's positions attend to its cached prefix and causally to each other: compute;
    a decode position reads its whole sequence from the cache: memory). The defaults are the order
    of a 12B model on one H200: a prefill of about 20,000 tokens/s, a decode step of about 10 ms
    at small batches, 160 KiB of KV a token read at about 5 TB/s.
    """

    step_s: float = 0.008  # every forward
    context_token_s: float = 5e-5  # each prompt position computed (a prefix-cache hit skips it)
    context_attention_s: float = 1e-9  # each (context position, key) pair of a chunk's attention
    decode_token_s: float = 1e-4  # each decode position (a row, a beam, a draft)
    decode_kv_token_s: float = 3e-8  # each KV token a decode position reads from the cache

    def __post_init__(self) -> None:
        for name in ("step_s", "context_token_s", "context_attention_s", "decode_token_s", "decode_kv_token_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"simulated_engine.{name} must be a finite number of seconds >= 0, got {value!r}")


class LinearForwardTime:
    """``forward_time_s`` of :class:`SimulatedModelEngine` by :class:`SimulatedEngineConfig`'s
    formula. A request still in context state is a chunk; any other is a decode."""

    __slots__ = ("config",)

    def __init__(self, config: SimulatedEngineConfig) -> None:
        self.config = config

    def __call__(self, inputs: ForwardInputs) -> float:
        c = self.config
        context = pairs = decode = read = 0
        for request, new, cached in zip(inputs.requests, inputs.num_new_tokens, inputs.num_cached_tokens):
            if request.is_context_init_state:
                context += new
                pairs += new * cached + new * (new + 1) // 2  # the prefix, then causal over the chunk
            else:
                decode += new
                read += new * (cached + 1)
        return (c.step_s + c.context_token_s * context + c.context_attention_s * pairs
                + c.decode_token_s * decode + c.decode_kv_token_s * read)


class SimulatedModelEngine(ModelEngine):
    """Runs ``_prepare_tp_inputs`` for real and charges ``forward_time_s(inputs)`` to the clock.

    With ``sampler`` (a :class:`SyntheticSampler`) the engine picks, as a model on a device
    would, the token that sampler will return for each request it can pick for
    (:meth:`ModelEngine.can_pick`), so the overlap scheduler can run it one forward ahead;
    ``asynchronous`` makes a forward run only when its result is asked for (see ``ModelEngine``).
    The forward's time is taken at launch, from the inputs as they were then. Drafts are all
    rejected, as the synthetic sampler rejects them: a speculative request's pick is the rule's
    token after its newest one, and the next forward moves back over every draft (``Picks``).
    With ``draft_proposer`` it fills the draft slots of steps built in flight on the host, as the
    torch engines do (``ForwardInputs.resolve``).
    """

    max_beam_width = 8
    supports_draft_tokens = True
    accepts_drafts = True

    def __init__(
        self,
        max_num_tokens: int,
        kv_cache_manager: KVCacheManager,
        *,
        vocab_size: int = 32000,
        clock: VirtualClock | None = None,
        forward_time_s: Callable[[ForwardInputs], float] | None = None,
        sampler: TokenRule | None = None,
        asynchronous: bool = False,
        draft_proposer: DraftProposer | None = None,
    ) -> None:
        super().__init__(max_num_tokens, kv_cache_manager, asynchronous=asynchronous, draft_proposer=draft_proposer)
        self._vocab_size = vocab_size
        self.clock = clock
        self.forward_time_s = forward_time_s
        self.sampler = sampler
        self.picks_tokens = sampler is not None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _host_forward(self, inputs: ForwardInputs) -> Callable[[], ForwardOutput]:
        seconds = 0.0
        if self.clock is not None and self.forward_time_s is not None:
            seconds = self.forward_time_s(inputs)  # now: it reads the requests' state
        requests, samples = inputs.requests, inputs.samples
        logits = {r.request_id: None for r, s in zip(requests, samples) if s}
        picks = []  # the requests the rule picks for, by index (an engine without a rule picks for none)
        if self.picks_tokens:
            picks = [(i, r) for i, (r, s) in enumerate(zip(requests, samples)) if s and self.can_pick(r)]
        any_drafts = any(inputs.num_drafts)

        def run() -> ForwardOutput:
            if seconds:
                self.clock.advance(seconds)
            drafts = inputs.verified_drafts() if any_drafts else None  # engine drafts: proposed by now
            if self.sampler is None:
                return ForwardOutput(logits=logits, verified_drafts=drafts)
            rule = self.sampler.next_token
            # the token after each sampling row (its position + 1), positions as resolved (overlap)
            greedy = {r.request_id: rule(r, inputs.sampling_input_id(i), inputs.sampling_position(i) + 1)
                      for i, r in picks}
            return ForwardOutput(logits=logits, greedy_tokens=greedy, verified_drafts=drafts)

        return run

    def _run(self, inputs: ForwardInputs) -> ForwardOutput:
        return self._host_forward(inputs)()
