"""What the replicas report, in one place: their KV blocks (from their KV cache events), health
and Prometheus metrics. The router asks it for each request's cached prefix per replica; the
ingress asks it for ``/health`` and ``/prometheus/metrics``.

One :class:`ReplicaRegistry` per application, run as a Ray actor (``deployments``); nothing here
imports Ray. Each replica pushes, in order, numbered batches::

    replica                                     registry
    events 0..k   ── apply(id, epoch, seq=0) ─►  seq matches: applied, expects seq 1   -> True
    events k+1..  ── apply(id, epoch, seq=1) ─►  a new registry (restarted): unknown   -> False
    its blocks    ── resync(id, epoch, seq=2, held) ─► the replica's blocks replaced; expects seq 3
    every second  ── report(id, health, metrics text)

``epoch`` is the replica process's own (a restarted replica starts a new one), so a registry
never mixes two lives of a replica. A replica that has not reported for ``stale_after_s`` is
gone (dead, or replaced by Ray Serve): its blocks and report are dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from tensorrt_llm.serve.ray_serve.prefix_index import EventError, PrefixIndex

logger = logging.getLogger(__name__)

NAMESPACE = "serve"  # Ray Serve's own namespace: the registry actor is looked up there


def registry_name(app_name: str) -> str:
    """The registry actor's name for one Ray Serve application."""
    return f"trtllm-replica-registry:{app_name}"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's last report: its ``/health`` body (with ``healthy``), Prometheus text, and when."""

    health: dict
    metrics: str
    received: float  # the registry's clock


class ReplicaRegistry:
    """See the module docstring. ``clock``: seconds, monotonic (injected by tests)."""

    def __init__(self, stale_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._index = PrefixIndex()
        self._expected: dict[str, tuple[str, int]] = {}  # replica -> (epoch, next batch number)
        self._reports: dict[str, ReplicaReport] = {}
        self._seen: dict[str, float] = {}  # replica -> when it last pushed anything

    # ---- the replicas push ------------------------------------------------------------------
    def apply(self, replica: str, epoch: str, seq: int, events: Sequence[Mapping]) -> bool:
        """Batch ``seq`` of ``replica``'s events: applied (True) when it is the batch expected
        next; False when the registry does not follow this replica's stream (new here, a batch
        lost, another epoch): the replica then sends :meth:`resync`."""
        self._seen[replica] = self._clock()
        if self._expected.get(replica) != (epoch, seq):
            return False
        self._expected[replica] = (epoch, seq + 1)
        try:
            report = self._index.apply(replica, events)
        except EventError as error:  # a bad event from one replica must not stop the others' routing
            logger.error("%s; resynchronising that replica", error)
            del self._expected[replica]
            return False
        if report.unknown_removals:
            logger.debug("replica %s removed %d blocks never stored here", replica, report.unknown_removals)
        return True

    def resync(self, replica: str, epoch: str, seq: int, held: Iterable[int]) -> None:
        """``replica``'s whole set of blocks (``held`` block hashes) as of batch ``seq``; the
        next batch expected is ``seq + 1``."""
        self._seen[replica] = self._clock()
        self._index.forget(replica)
        self._index.apply(replica, [{"data": {"type": "stored", "blocks": [{"block_hash": h} for h in held]}}])
        self._expected[replica] = (epoch, seq + 1)

    def report(self, replica: str, health: dict, metrics: str) -> None:
        now = self._clock()
        self._seen[replica] = now
        self._reports[replica] = ReplicaReport(health, metrics, now)

    # ---- the router and the ingress ask -----------------------------------------------------
    def match(self, keys: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Each of ``replicas``' cached prefix of the block hashes ``keys``, in blocks."""
        return self._index.match(keys, replicas)

    def reports(self) -> dict[str, ReplicaReport]:
        """The live replicas' last reports (stale replicas are dropped first)."""
        self._drop_stale()
        return dict(self._reports)

    def num_blocks(self) -> dict[str, int]:
        """Blocks each replica holds, as its events said."""
        return {replica: self._index.num_blocks(replica) for replica in self._index.replicas}

    def _drop_stale(self) -> None:
        now = self._clock()
        for replica, seen in list(self._seen.items()):
            if now - seen > self.stale_after_s:
                logger.info("replica %s has not reported for %.0f s: dropping its blocks and report", replica,
                            now - seen)
                self._index.forget(replica)
                self._expected.pop(replica, None)
                self._reports.pop(replica, None)
                del self._seen[replica]
