"""Chaos testing: a model engine wrapper that injects faults into forwards (off by default).

``FaultInjectingEngine`` runs the wrapped engine and, on a fixed schedule of forwards
(:class:`FaultInjectionConfig`), makes the forward raise (the executor fails that batch and
serves on), gives one request NaN logits (the sampler refuses them and the executor fails that
request alone), or sleeps first (the loop stalls; ``/health`` reports it while it lasts). The
wrapper changes nothing else: input preparation, budget checks and KV accounting are the
wrapped engine's. It lets a test or an operator check that every request still ends, with
output or an error, and that health stays truthful.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm._torch.pyexecutor.errors import ExecutorError
from tensorrt_llm._torch.pyexecutor.engine.interface import DeferredForward, ForwardOutput, ModelEngine, PendingForward
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

logger = logging.getLogger(__name__)

FAULT_KINDS = ("forward_error", "nan_logits", "slow_forward")


class InjectedForwardError(ExecutorError):
    """The forward failed on purpose (fault injection)."""


class FaultInjectingEngine:
    """Wraps a :class:`ModelEngine`; the executor sees the same interface.

    ``faults_injected`` counts the faults actually injected per kind (a NaN fault scheduled
    for a forward in which no request samples is not injected). Written by the executor
    thread only; plain ints, so any thread may read them.
    """

    def __init__(self, engine: ModelEngine, config: FaultInjectionConfig, sleep=time.sleep) -> None:
        self.engine = engine
        self.config = config
        self.faults_injected = dict.fromkeys(FAULT_KINDS, 0)
        self._num_forwards = 0
        self._rng = random.Random(config.seed)
        self._sleep = sleep

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_beam_width(self) -> int:
        return self.engine.max_beam_width

    @property
    def supports_draft_tokens(self) -> bool:
        return self.engine.supports_draft_tokens

    @property
    def completes_asynchronously(self) -> bool:
        return self.engine.completes_asynchronously

    @property
    def proposes_drafts(self) -> bool:
        return self.engine.proposes_drafts

    @property
    def samples_on_device(self) -> bool:
        return self.engine.samples_on_device

    def can_pick(self, request) -> bool:
        return self.engine.can_pick(request)

    def forward(self, scheduled: ScheduledRequests) -> ForwardOutput:
        return self.forward_async(scheduled).result()

    def forward_async(self, scheduled: ScheduledRequests, token_masks=None) -> PendingForward:
        """Faults at launch (sleep, error); NaN logits when the forward's result is taken."""
        self._num_forwards += 1
        n, c = self._num_forwards, self.config
        if _due(n, c.slow_forward_every):
            self.faults_injected["slow_forward"] += 1
            logger.warning("fault injection: forward %d sleeps %.2f s", n, c.slow_forward_s)
            self._sleep(c.slow_forward_s)
        if _due(n, c.forward_error_every):
            self.faults_injected["forward_error"] += 1
            raise InjectedForwardError(f"fault injection: forward {n} failed (forward_error_every={c.forward_error_every})")
        pending = self.engine.forward_async(scheduled, token_masks) if token_masks else self.engine.forward_async(scheduled)
        if not _due(n, c.nan_logits_every):
            return pending

        def poisoned() -> ForwardOutput:
            output = pending.result()
            self._poison_one(output, n)
            return output

        wrapped = DeferredForward(poisoned, None)
        wrapped.num_tokens = pending.num_tokens
        return wrapped

    def _poison_one(self, output: ForwardOutput, n: int) -> None:
        rows = sorted(rid for rid, logits in output.logits.items() if logits is not None)
        if not rows:
            return  # nobody samples in this forward (or a simulated engine): nothing to poison
        victim = self._rng.choice(rows)
        output.logits[victim] = torch.full_like(output.logits[victim], float("nan"))
        if output.nonfinite is not None:  # an engine that checked on its device: it would have seen it
            output.nonfinite.add(victim)
        self.faults_injected["nan_logits"] += 1
        logger.warning("fault injection: forward %d gives request %d NaN logits", n, victim)


def _due(n: int, every: int) -> bool:
    return every > 0 and n % every == 0
