"""``Communicator``: one rank's process group, a tagged control-plane exchange, and the group abort.

Every control message between ranks is one :meth:`Communicator.exchange`: each rank
contributes a small fixed header ``(phase, iteration, payload bytes, values...)`` in one
all-gather; a pickled payload, when some rank has one, follows in a second collective (a
broadcast when only rank 0 has one, an all-gather otherwise). Because every rank sees every
header, each one checks that all ranks are at the same phase of the same iteration; a rank
that wandered off (skipped a forward, ran an extra step) is caught at its next exchange
with a :class:`RankDivergenceError` on every rank, rather than its collectives pairing with
the wrong ones.

Nothing waits forever:

* every collective (these and the model's) is bounded by the process group's timeout;
* a rank that fails calls :meth:`abort`: it records ``(rank, iteration, message)`` in the
  rendezvous store, which the launching process hosts and so outlives every rank, then
  destroys its process group, which fails its peers' pending collectives at once
  ("connection closed by peer") instead of at their timeout;
* a rank whose collective fails reads the store and raises :class:`GroupAborted` with the
  first failing rank's own message, or, if no rank said anything (it died, or hung past the
  timeout), aborts itself and raises :class:`CollectiveError`.
"""

from __future__ import annotations

import datetime
import enum
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tensorrt_llm._torch.distributed.errors import CollectiveError, DistributedError, GroupAborted, RankDivergenceError

logger = logging.getLogger(__name__)

T = TypeVar("T")

NUM_VALUES = 6  # small integers every rank contributes to an exchange
_HEADER = 3  # phase, iteration, payload bytes
_STORE_WAIT_S = 5.0  # an aborting rank writes its record before it tears the group down


class Phase(enum.IntEnum):
    """Where in the protocol an exchange happens; ranks must agree on it."""

    BEGIN = 1  # start of an iteration: rank 0's requests, every rank's load and last digest
    DECISIONS = 2  # after allocation, before the forward: the digest of the batch
    RECORDS = 3  # after a digest mismatch: the decision records, to name what differs
    GATHER = 4  # end of a run: per-rank results to rank 0


@dataclass(frozen=True, slots=True)
class Contribution:
    """What one rank put into an exchange."""

    rank: int
    values: tuple[int, ...]
    payload: Any = None


@dataclass(frozen=True, slots=True)
class AbortRecord:
    rank: int
    iteration: int | None
    message: str


def _describe_position(row: Sequence[int]) -> str:
    try:
        phase = Phase(row[0]).name
    except ValueError:  # paired with a collective that is not an exchange
        phase = f"a non-exchange collective ({row[0]})"
    return f"{phase} of iteration {row[1]}"


class Communicator:
    """One rank's view of the group. Create it in every rank with the same store and generation.

    ``generation`` namespaces the process group and the abort records in the store, so a group
    that aborted can be set up again (a long-lived test group does that between jobs).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float, generation: int = 0,
                 diagnose: Callable[[], str | None] | None = None):
        """``diagnose``: called after a collective failed that no rank explained, for what the
        failure's own text cannot say (which rank is gone: see ``torchrun``'s heartbeats)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.store = dist.PrefixStore(f"group{generation}/", store)
        self._aborted = False
        self._diagnose = diagnose
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg/", self.store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @staticmethod
    def connect_store(host: str, port: int, *, timeout_s: float) -> dist.Store:
        """A client of the rendezvous store the launching process hosts."""
        return dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )

    # ---- the control plane -----------------------------------------------------------
    def exchange(
        self, phase: Phase, iteration: int, values: Sequence[int] = (), payload: Any = None
    ) -> list[Contribution]:
        """Every rank's ``values`` and ``payload``, in rank order. Collective: all ranks call it.

        Raises :class:`RankDivergenceError` when the ranks are not all at ``(phase, iteration)``.
        """
        if len(values) > NUM_VALUES:
            raise ValueError(f"at most {NUM_VALUES} values per exchange, got {len(values)}")
        blob = b"" if payload is None else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        header = torch.zeros(_HEADER + NUM_VALUES, dtype=torch.int64)
        header[:_HEADER] = torch.tensor([int(phase), iteration, len(blob)])
        header[_HEADER : _HEADER + len(values)] = torch.tensor(list(values), dtype=torch.int64)
        parts = [torch.empty_like(header) for _ in range(self.world_size)]
        self._collective(f"{phase.name} exchange", iteration, lambda: dist.all_gather(parts, header))
        rows = [part.tolist() for part in parts]
        if any(row[:2] != rows[0][:2] for row in rows):
            where = ", ".join(f"rank {r} at {_describe_position(row)}" for r, row in enumerate(rows))
            raise RankDivergenceError(iteration, None, f"the ranks are at different points of the protocol: {where}")
        payloads = self._payloads(blob, [row[2] for row in rows], phase, iteration)
        return [Contribution(r, tuple(row[_HEADER:]), payloads[r]) for r, row in enumerate(rows)]

    def _payloads(self, blob: bytes, sizes: list[int], phase: Phase, iteration: int) -> list[Any]:
        if not any(sizes):
            return [None] * self.world_size
        what = f"{phase.name} payload"
        if not any(sizes[1:]):  # only rank 0 speaks: the usual request broadcast
            buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == 0 else torch.empty(
                sizes[0], dtype=torch.uint8
            )
            self._collective(what, iteration, lambda: dist.broadcast(buffer, 0))
            return [pickle.loads(buffer.numpy().tobytes())] + [None] * (self.world_size - 1)
        width = max(sizes)
        local = torch.zeros(width, dtype=torch.uint8)
        if blob:
            local[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.empty_like(local) for _ in sizes]
        self._collective(what, iteration, lambda: dist.all_gather(parts, local))
        return [pickle.loads(part[:size].numpy().tobytes()) if size else None for part, size in zip(parts, sizes)]

    def _collective(self, what: str, iteration: int | None, run: Callable[[], T]) -> T:
        try:
            return run()
        except DistributedError:
            raise
        except (RuntimeError, ValueError) as error:  # gloo: timeout, or a peer closed the connection
            raise self.failure(f"{what} failed: {error}", iteration) from error

    # ---- failure --------------------------------------------------------------------
    def failure(self, message: str, iteration: int | None) -> DistributedError:
        """The error this rank raises after a collective failed: the first aborter's, if any.

        Without a record nobody explained the failure (a rank died, or hung past the
        timeout): this rank aborts the group itself so the others stop too.
        """
        record = self.abort_record(wait=True)
        if record is not None and record.rank != self.rank:
            return GroupAborted(record.rank, record.iteration, record.message)
        message = self.explain(message)
        self.abort(message, iteration)
        return CollectiveError(f"rank {self.rank}: {message}")

    def explain(self, message: str) -> str:
        """``message`` about a failure no rank explained, with what ``diagnose`` can add (which
        rank is gone), for the abort record every peer then reads."""
        hint = self._diagnose() if self._diagnose is not None else None
        return f"{hint}: {message}" if hint else message

    def abort(self, message: str, iteration: int | None = None) -> None:
        """Record why this rank gives up, then tear down its process group (idempotent)."""
        if self._aborted:
            return
        self._aborted = True
        logger.error("rank %d aborts the group at iteration %s: %s", self.rank, iteration, message)
        try:
            seq = self.store.add("abort/count", 1)
            self.store.set(f"abort/{seq}", pickle.dumps(AbortRecord(self.rank, iteration, message)))
        except Exception:  # the store is gone too: the process group teardown still stops the peers
            logger.exception("rank %d could not record its abort", self.rank)
        self.close()

    def abort_record(self, *, wait: bool = False) -> AbortRecord | None:
        """The first rank's abort record, or None if no rank aborted.

        With ``wait``, give a rank that is aborting right now a moment to write its record:
        a peer's collective can fail between the rank's teardown and our read.
        """
        try:
            if self.store.add("abort/count", 0) == 0:
                if not wait:
                    return None
                self.store.wait(["abort/1"], datetime.timedelta(seconds=_STORE_WAIT_S))
            self.store.wait(["abort/1"], datetime.timedelta(seconds=_STORE_WAIT_S))
            return pickle.loads(self.store.get("abort/1"))
        except Exception:  # no record came (timeout), or the store is unreachable
            return None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
