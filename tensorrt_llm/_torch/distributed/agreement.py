"""``DecisionAgreement``: the per-iteration check that every tensor-parallel rank decided the same.

It is a resource manager, registered after the KV cache manager, so the executor's own
lifecycle calls it at exactly the two points that matter:

* ``prepare_resources(prepared)`` runs after the KV manager allocated (re-check, claims,
  deferrals all done) and *before the forward*: the ranks compare the digest of their
  decisions here, so ranks that disagree stop before their model collectives could pair
  up wrongly. A mismatch raises :class:`RankDivergenceError` on every rank (each sees the
  same digests), naming the iteration and the first differing request.
* ``update_resources(scheduled)`` runs after sampling: the digest of the outcome (states,
  lengths, newest tokens, pool counters) is kept for the next iteration's first exchange,
  where the rank executor compares it.

The executor fails the batch on that error; :class:`RankExecutor` then raises it, so the
whole group stops. It costs one 64-bit all-gather per iteration while the ranks agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorrt_llm._torch.distributed.communicator import Communicator, Phase
from tensorrt_llm._torch.distributed.digest import Record, decision_records, digest, first_difference, outcome_records
from tensorrt_llm._torch.distributed.errors import RankDivergenceError

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

DECISION_AGREEMENT = "decision_agreement"


@dataclass(slots=True)
class AgreementCost:
    """Where the check's time goes, summed over iterations (for the report's per-iteration cost)."""

    iterations: int = 0
    record_s: float = 0.0  # building records and hashing them
    exchange_s: float = 0.0  # the all-gathers of digests

    def per_iteration_us(self) -> dict:
        n = max(self.iterations, 1)
        return {"iterations": self.iterations, "records_and_hash_us": self.record_s / n * 1e6,
                "exchange_us": self.exchange_s / n * 1e6}


@dataclass(slots=True)
class DecisionAgreement:
    comm: Communicator
    kv: "KVCacheManager"
    iteration: int = 0  # set by the rank executor before each step
    divergence: RankDivergenceError | None = None
    outcome: tuple[int, list[Record]] = (0, [])  # (digest, records) of the last step's outcome
    decision_log: list[int] | None = None  # every decision digest, when a test keeps them
    cost: AgreementCost = field(default_factory=AgreementCost)

    def begin(self, iteration: int) -> None:
        self.iteration = iteration
        self.outcome = (0, [])

    # ---- the resource-manager lifecycle -------------------------------------------------
    def prepare_resources(self, prepared: "PreparedBatch") -> None:
        started = time.perf_counter()
        records = decision_records(prepared, self.kv)
        value = digest(records)
        self.cost.record_s += time.perf_counter() - started
        if self.decision_log is not None:
            self.decision_log.append(value)
        self.agree(Phase.DECISIONS, self.iteration, value, records)

    def update_resources(self, scheduled: "ScheduledRequests") -> None:
        started = time.perf_counter()
        records = outcome_records(scheduled, self.kv)
        self.outcome = (digest(records), records)
        self.cost.record_s += time.perf_counter() - started
        self.cost.iterations += 1

    def free_resources(self, request: "LlmRequest", *, store_for_reuse: bool = True) -> None:
        """Holds nothing per request."""

    # ---- the check ------------------------------------------------------------------
    def agree(self, phase: Phase, iteration: int, value: int, records: list[Record]) -> None:
        """Compare ``value`` across ranks (one exchange); on a mismatch raise, naming what differs."""
        started = time.perf_counter()
        try:
            digests = [c.values[0] for c in self.comm.exchange(phase, iteration, (value,))]
        except RankDivergenceError as error:  # a rank is elsewhere in the protocol
            self.divergence = error
            raise
        finally:
            self.cost.exchange_s += time.perf_counter() - started
        self.compare(iteration, digests, records, "decisions before the forward")

    def compare(self, iteration: int, digests: list[int], records: list[Record], what: str) -> None:
        """Digests already exchanged: if they differ, exchange the records and raise on every rank."""
        if all(d == digests[0] for d in digests):
            return
        everyone = [c.payload for c in self.comm.exchange(Phase.RECORDS, iteration, (), records)]
        request_id, detail = first_difference(everyone)
        self.divergence = RankDivergenceError(iteration, request_id, f"{what}: {detail}")
        raise self.divergence
