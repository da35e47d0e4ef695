"""The executor state machines the stateful tests share (DESIGN.md §3): their traffic rules, and
the machine of arrivals, bursts, steps and cancellations that the policy and priority tests run.

:class:`TrafficRules` (over :class:`TrafficState`): a subclass's ``initialize`` sets ``self.setting`` (the
:class:`~tests.helpers.strategies.Setting` whose pool the prompts are drawn for) and ``self.checker``
(an :class:`~tests.helpers.invariants.ExecutorChecker`); the rules then submit fresh prompts drawn
against every prompt seen so far (shared prefixes, extensions, beams, drafts:
:func:`~tests.helpers.strategies.request_specs`), identical repeats of earlier ones, and cancel
any request submitted.
"""

from __future__ import annotations

import itertools

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tests.helpers.factories import make_sim_executor
from tests.helpers.invariants import ExecutorChecker
from tests.helpers.strategies import Prompt, RequestSpec, Setting, kv_settings, request_specs


class TrafficState(RuleBasedStateMachine):
    """What a machine that submits requests keeps: its setting, its checker, the prompts seen and
    the next request id; ``_submit`` builds and submits a request, ``_request`` is where a subclass
    draws more of one (after its spec, so the draws of the rules themselves stay in the same order)."""

    def __init__(self) -> None:
        super().__init__()
        self.setting: Setting | None = None
        self.checker: ExecutorChecker | None = None
        self.earlier: list[Prompt] = []
        self.ids = itertools.count()

    def _request(self, spec: RequestSpec, data) -> LlmRequest:
        """The request submitted for ``spec``: built with the next id."""
        return spec.build(next(self.ids))

    def _submit(self, spec: RequestSpec, data) -> None:
        self.earlier.append(spec.prompt)
        self.checker.submit(self._request(spec, data))


class TrafficRules(TrafficState):
    """``arrive``, ``arrive_identical`` and ``cancel``."""

    @rule(data=st.data())
    def arrive(self, data) -> None:
        self._submit(data.draw(request_specs(self.setting, tuple(self.earlier)), label="request"), data)

    @rule(data=st.data())
    def arrive_identical(self, data) -> None:
        if not self.earlier:
            return self.arrive(data)
        prompt = data.draw(st.sampled_from(self.earlier), label="repeat of")
        self._submit(RequestSpec(prompt, max_new_tokens=data.draw(st.integers(1, 4), label="max_new_tokens")), data)

    @rule(data=st.data())
    def cancel(self, data) -> None:
        if not self.checker.submitted:
            return
        request_id = data.draw(st.sampled_from(sorted(self.checker.submitted)), label="cancel")
        self.checker.cancel(request_id)


class ExecutorMachine(TrafficRules):
    """Arrivals, bursts, steps and cancellations against one executor; invariants after every step."""

    policy = "recheck"
    overlap = False  # the overlap scheduler over an engine that completes later

    @initialize(setting=kv_settings(max_blocks=24))
    def build(self, setting: Setting) -> None:
        self.setting = setting
        self.checker = ExecutorChecker(make_sim_executor(setting.config(self.policy), overlap=self.overlap))

    @rule(data=st.data(), size=st.integers(2, 6))
    def burst(self, data, size: int) -> None:
        for _ in range(size):
            self.arrive(data)

    @rule()
    def step(self) -> None:
        self.checker.step()

    @rule(steps=st.integers(2, 12))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.checker.step()

    def teardown(self) -> None:
        if self.checker is None:
            return
        self.checker.drain()
        for request_id, response in self.checker.final.items():
            error = response.error or ""
            # by design a request fails only when it could never be served, or (policies
            # without safety) when its batch overshot
            assert not error or error.startswith(InvalidRequestError.__name__) or "max_num_tokens" in error, (
                f"request {request_id} failed: {error}"
            )
            if self.policy in ("recheck", "claim"):
                assert "should be less than or equal to max_num_tokens" not in error, error
        requests = self.checker.submitted.values()
        pool = self.checker.executor.kv_cache_manager.pool
        for happened, what in (
            (self.checker.num_budget_deferrals, "budget deferrals"),
            (self.checker.num_capacity_deferrals, "capacity deferrals"),
            (any(r.counters.pauses for r in requests), "a request paused"),
            (any(r.is_cancelled for r in requests), "a request cancelled"),
            (pool.num_evictions, "blocks evicted"),
            (pool.num_offloads, "blocks offloaded"),
            (pool.num_onboards, "blocks onboarded"),
            (any(r.error and "max_num_tokens (" in r.error for r in requests), "a batch overshot"),
        ):
            if happened:
                event(f"{self.policy}: {what}")
