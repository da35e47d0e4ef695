"""``RankExecutor``: one rank's :class:`PyExecutor`, stepping in lock-step with the other ranks.

Every rank calls :meth:`RankExecutor.step` in a loop; each call is one group iteration::

    BEGIN exchange        rank 0: new requests, cancellations, stop (a Ticket)
                          every rank: has work, active requests, free KV blocks, its clock,
                          the digest of its previous iteration (when checking), and whether
                          its previous step overshot its budget
    stop on overshoot     (``stop_on_overshoot``) if any rank's previous step overshot, every
                          rank stops here, as upstream's assertion would have stopped it
    compare digests       (when checking) the previous iteration's outcome (TP) or
                          assignment (attention DP) must agree on every rank
    admit                 TP: every rank admits every new request; attention DP: each rank
                          admits those :func:`assign_requests` gives it (same on every rank)
    executor.step()       schedule, re-check, allocate, [DECISIONS exchange], forward, sample
    failure check         TP: a failed batch that is not a budget overshoot means this rank
                          may be out of step with the others: abort the group

Requests reach a rank only through the BEGIN exchange, on the executor's own thread, right
before the step that admits them: no rank ever sees a request earlier or later than the
others, whatever the timing of the threads that submitted it. Rank 0 is the only rank that
takes submissions (:meth:`submit`, :meth:`cancel`, any thread).

Under tensor parallelism every rank holds every request and the ranks' model collectives
pair up only if every rank runs the same batch; with ``check_decisions`` a
:class:`DecisionAgreement` verifies that before each forward. Under attention DP each rank
holds its own requests, KV cache and budget; the ranks still exchange once per iteration,
so an iteration ends for all when all have finished it, and a rank with nothing to do runs
an empty step.

Responses: rank 0 calls the callback given to :meth:`submit`. Under attention DP a request
may run on another rank; with ``forward_responses`` that rank sends its responses to rank 0
in the next BEGIN exchange. ``on_local_response`` sees every response on the rank that
produced it (the multi-rank replay records per-rank metrics with it).
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from typing import Callable

from tensorrt_llm._torch.distributed.agreement import DECISION_AGREEMENT, DecisionAgreement
from tensorrt_llm._torch.distributed.attention_dp import RankLoad, assign_requests
from tensorrt_llm._torch.distributed.communicator import Communicator, Contribution, Phase
from tensorrt_llm._torch.distributed.digest import digest
from tensorrt_llm._torch.distributed.errors import DistributedError, GroupAborted
from tensorrt_llm._torch.distributed.request_spec import RequestSpec
from tensorrt_llm._torch.pyexecutor.iteration.records import Iteration
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor, Response, ResponseCallback
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

#: Test-only: called on its rank with (executor, iteration) right before each step.
PlantHook = Callable[[PyExecutor, int], None]


@dataclass(frozen=True, slots=True)
class Ticket:
    """Rank 0's part of an iteration's BEGIN exchange."""

    new_requests: tuple[RequestSpec, ...] = ()
    cancelled: tuple[int, ...] = ()
    stop: bool = False

    def __bool__(self) -> bool:
        return bool(self.new_requests or self.cancelled or self.stop)


@dataclass(frozen=True, slots=True)
class GroupStep:
    """One group iteration, as this rank saw it."""

    iteration: int
    stats: IterationStats | None  # this rank's step (None: it had nothing to do, or its forward is in flight)
    assigned: tuple[int, ...] = ()  # ids of the new requests this rank admitted
    group_idle: bool = False  # no rank had work and nothing came in: the step did nothing anywhere
    stopped: bool = False  # rank 0 stopped the group, or a rank overshot (``stop_on_overshoot``); no step ran
    overshot_ranks: tuple[int, ...] = ()  # with ``stop_on_overshoot``: the ranks whose previous step overshot


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class RankExecutor:
    def __init__(
        self,
        executor: PyExecutor,
        comm: Communicator,
        mapping: Mapping,
        *,
        check_decisions: bool = False,
        forward_responses: bool = False,
        on_local_response: ResponseCallback | None = None,
        clock_sync: Callable[[float], None] | None = None,
        plant: PlantHook | None = None,
        stop_on_overshoot: bool = False,
    ) -> None:
        """``clock_sync(t)`` moves a virtual clock to the group's latest clock at each iteration
        (attention-DP replays: an iteration ends when the slowest rank's forward does).

        ``stop_on_overshoot``: the group stops at the iteration after any rank's forward
        exceeded its budget (the replay of policy ``none``: upstream's assertion stops the
        executor there). Every rank learns it from the same BEGIN exchange, so all stop at
        the same iteration; under attention DP a rank's overshoot is local and the others
        would not know without it."""
        if mapping.world_size != comm.world_size or mapping.rank != comm.rank:
            raise ValueError(f"{mapping} does not match the communicator (rank {comm.rank} of {comm.world_size})")
        self.executor, self.comm, self.mapping = executor, comm, mapping
        self.rank = mapping.rank
        self.attention_dp = mapping.enable_attention_dp
        self.forward_responses = forward_responses and self.attention_dp
        self.on_local_response = on_local_response
        self.clock_sync = clock_sync
        self.plant = plant
        self.stop_on_overshoot = stop_on_overshoot
        self._overshot = False  # this rank's previous step overshot its budget
        self.iteration = 0
        self.tokens_per_block = executor.kv_cache_manager.tokens_per_block
        self._submissions = threading.Lock()
        self._pending: list[RequestSpec] = []
        self._pending_cancels: list[int] = []
        self._stop = False
        self._callbacks: dict[int, tuple[LlmRequest, ResponseCallback | None]] = {}
        self._outbox: list[Response] = []
        self._check_value = 0  # digest of the previous iteration, compared at the next BEGIN
        self._check_records: list[tuple[int, ...]] = []
        self.agreement: DecisionAgreement | None = None
        if check_decisions and comm.world_size > 1:
            self.agreement = DecisionAgreement(comm, executor.kv_cache_manager)
            if not self.attention_dp:
                # After the KV manager: prepare_resources then sees the allocated batch.
                executor.resource_manager.add_resource_manager(DECISION_AGREEMENT, self.agreement)

    # ---- submission: rank 0, any thread ------------------------------------------------
    def submit(self, request: LlmRequest, on_response: ResponseCallback | None = None) -> int:
        """Queue ``request`` for the next iteration's broadcast (rank 0 only)."""
        self._require_rank0("submit")
        with self._submissions:
            spec = RequestSpec.of(request, arrival_time=self.executor.clock())
            self._callbacks[request.request_id] = (request, on_response)
            self._pending.append(spec)
        return request.request_id

    def cancel(self, request_id: int) -> None:
        self._require_rank0("cancel")
        with self._submissions:
            self._pending_cancels.append(request_id)

    def request_stop(self) -> None:
        """Stop every rank at the next iteration (rank 0 only); unfinished requests stay unfinished."""
        self._require_rank0("request_stop")
        with self._submissions:
            self._stop = True

    def _require_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what}: only rank 0 takes requests (this is rank {self.rank})")

    def _take_ticket(self) -> Ticket:
        with self._submissions:
            ticket = Ticket(tuple(self._pending), tuple(self._pending_cancels), self._stop)
            self._pending, self._pending_cancels = [], []
        return ticket

    # ---- the lock-step iteration: every rank ---------------------------------------------
    def step(self) -> GroupStep:
        """One group iteration (collective: every rank calls it the same number of times)."""
        iteration = self.iteration
        try:
            return self._step()
        except DistributedError:
            raise  # every rank raises it together, or the group is already torn down
        except Exception as error:  # this rank cannot go on: stop the others at once
            self.comm.abort(f"{type(error).__name__}: {error}", iteration)
            raise

    def _step(self) -> GroupStep:
        iteration = self.iteration
        self.iteration += 1
        contributions = self._begin(iteration)
        ticket = contributions[0].payload or Ticket()
        if self.agreement is not None and iteration > 0:
            self._compare_previous(iteration - 1, contributions)
        if ticket.stop:
            return GroupStep(iteration, None, stopped=True)
        if self.stop_on_overshoot:
            overshot = tuple(c.rank for c in contributions if c.values[5])
            if overshot:
                return GroupStep(iteration, None, stopped=True, overshot_ranks=overshot)
        if self.clock_sync is not None:
            self.clock_sync(max(_bits_float(c.values[4]) for c in contributions))
        if self.rank == 0:
            for contribution in contributions[1:]:
                for response in contribution.payload or ():
                    self._deliver(response)
        assigned = self._admit(ticket, contributions)
        group_idle = not ticket and not any(c.values[0] for c in contributions)
        if self.plant is not None:
            self.plant(self.executor, iteration)
        if self.agreement is not None:
            self.agreement.begin(iteration)
        step = self.executor.step()
        self._after_step(iteration, step)
        return GroupStep(iteration, step.stats if step is not None else None, assigned, group_idle)

    def _begin(self, iteration: int) -> list[Contribution]:
        executor = self.executor
        if self.rank == 0:
            ticket = self._take_ticket()
            payload = ticket or None
        else:
            payload, self._outbox = self._outbox or None, []
        values = (
            int(executor.has_work),
            len(executor.active_requests),
            executor.kv_cache_manager.available_blocks,
            self._check_value,
            _float_bits(executor.clock()),
            int(self._overshot),
        )
        return self.comm.exchange(Phase.BEGIN, iteration, values, payload)

    def _compare_previous(self, previous: int, contributions: list[Contribution]) -> None:
        """The previous iteration's outcome (TP) or assignment (attention DP) must agree."""
        what = "assignment of new requests" if self.attention_dp else "outcome of the iteration"
        self.agreement.compare(previous, [c.values[3] for c in contributions], self._check_records, what)

    def _admit(self, ticket: Ticket, contributions: list[Contribution]) -> tuple[int, ...]:
        specs = ticket.new_requests
        if self.attention_dp:
            loads = [RankLoad(c.values[1], c.values[2]) for c in contributions]
            ranks = assign_requests(specs, loads, self.tokens_per_block)
            mine = [spec for spec, rank in zip(specs, ranks) if rank == self.rank]
            if self.agreement is not None:  # compared at the next BEGIN
                self._check_records = [(spec.request_id, rank) for spec, rank in zip(specs, ranks)]
                self._check_value = digest(self._check_records) if specs else 0
        else:
            mine = list(specs)
        for spec in mine:
            self.executor.enqueue_request(spec.build(), self._on_response)
        for request_id in ticket.cancelled:  # harmless where the request is not held
            self.executor.cancel_request(request_id)
        return tuple(spec.request_id for spec in mine)

    def _after_step(self, iteration: int, step: Iteration | None) -> None:
        self._overshot = step is not None and bool(step.launch.overshoot)
        agreement = self.agreement
        if agreement is not None:
            if agreement.divergence is not None:
                raise agreement.divergence
            if not self.attention_dp:
                self._check_value, self._check_records = agreement.outcome
        if self.attention_dp or step is None or step.error is None or step.launch.overshoot:
            return
        # A budget overshoot is decided before the forward, identically on every rank. Any
        # other failed batch may have left this rank's collectives out of step with its peers'.
        record = self.comm.abort_record()
        if record is not None and record.rank != self.rank:
            raise GroupAborted(record.rank, record.iteration, record.message)
        message = self.comm.explain(step.error)  # a model collective failed: which peer is gone, if known
        self.comm.abort(message, iteration)
        raise DistributedError(f"rank {self.rank} failed at iteration {iteration}: {message}")

    # ---- responses ------------------------------------------------------------------
    def _on_response(self, request: LlmRequest, response: Response) -> None:
        if self.on_local_response is not None:
            self.on_local_response(request, response)
        if self.rank == 0:
            self._deliver(response, request)
        elif self.forward_responses:
            self._outbox.append(response)

    def _deliver(self, response: Response, request: LlmRequest | None = None) -> None:
        """Call the submitter's callback with the request that ran (rank 0's copy if it ran elsewhere)."""
        entry = self._callbacks.get(response.request_id)
        if entry is None:
            return
        if response.finished:
            del self._callbacks[response.request_id]
        submitted, callback = entry
        if callback is not None:
            callback(request or submitted, response)
