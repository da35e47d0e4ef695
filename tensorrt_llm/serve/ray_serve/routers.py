"""Ray Serve request routers for the LLM replicas (``RequestRouterConfig(request_router_class=...)``).

They run inside the handle that sends requests to the replicas (the ingress's), one instance per
handle. Each reads the request's prompt ids from the :class:`RoutedRequest` the ingress passes,
and counts its own requests in flight per replica (``on_send_request`` /
``on_request_completed``): with several ingress replicas each bounds its own share. The
decisions are ``routing``'s functions; power of two choices is Ray Serve's own router (the
default, ``PowerOfTwoChoicesRequestRouter``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import List, Optional

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tensorrt_llm.serve.ray_serve.prefix_index import request_keys
from tensorrt_llm.serve.ray_serve.registry import NAMESPACE, registry_name
from tensorrt_llm.serve.ray_serve.routing import LoadBound, prefix_aware_choice, round_robin_choice
from tensorrt_llm.serve.ray_serve.wire import RoutedRequest

logger = logging.getLogger(__name__)


def replica_name(replica_id: ReplicaID) -> str:
    """The string a replica is known by in the registry and in its answers' ``x-trtllm-replica``."""
    return replica_id.to_full_id_str()


def prompt_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt ids the ingress computed for routing (None: not a generation request, or a
    prompt the ingress could not render; the replica answers it)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, RoutedRequest):
            return arg.prompt_ids
    return None


class _CountingRouter(RequestRouter):
    """Counts this router's requests in flight on each replica."""

    def _start_counting(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()  # reason -> routing decisions (a request may take several tries)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Ray Serve calls this for every request it sends (on_request_routed only under its
        # rejection protocol), and on_request_completed once for each, rejected ones included.
        super().on_send_request(replica_id)
        self.in_flight[replica_name(replica_id)] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = replica_name(replica_id)
        if self.in_flight[name] > 0:
            self.in_flight[name] -= 1


class PrefixAwareRequestRouter(_CountingRouter):
    """Sends a request to the replica with the longest cached prefix of its prompt, within the
    load bound; otherwise power of two choices (``routing.prefix_aware_choice``). The cached
    prefixes come from the application's registry actor (built from the replicas' KV cache
    events), asked once per decision; when it does not answer in ``match_timeout_s``
    (``RayServeConfig.match_timeout_s``), the request is balanced instead."""

    def initialize_state(self, *, tokens_per_block: int, match_timeout_s: float,
                         max_load_gap: int = 4, max_in_flight: int | None = None, min_match_blocks: int = 1,
                         seed: int | None = None) -> None:
        self._start_counting()
        self.bound = LoadBound(max_load_gap=max_load_gap, max_in_flight=max_in_flight,
                               min_match_blocks=min_match_blocks)
        self.tokens_per_block = tokens_per_block
        self.match_timeout_s = match_timeout_s
        self._registry = None
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        replicas = {replica_name(r.replica_id): r for r in candidate_replicas}
        matched: dict[str, int] = {}
        ids = prompt_ids(pending_request)
        keys = request_keys(ids, self.tokens_per_block) if ids else []
        if keys:
            matched = await self._match(keys, list(replicas))
        decision = prefix_aware_choice(list(replicas), matched, self.in_flight, self.bound, self._rng)
        self.decisions[decision.reason] += 1
        return [[replicas[name] for name in group] for group in decision.ranked]

    async def _match(self, keys: list[int], replicas: list[str]) -> dict[str, int]:
        try:
            if self._registry is None:
                self._registry = ray.get_actor(registry_name(self.app_name), namespace=NAMESPACE)
            return await asyncio.wait_for(self._registry.match.remote(keys, replicas), self.match_timeout_s)
        except ValueError:  # not created yet (the ingress creates it): nothing is known to be cached
            return {}
        except Exception as error:  # noqa: BLE001 - the registry died or is slow: route without it
            logger.warning("prefix match unavailable (%s: %s): balancing this request", type(error).__name__, error)
            self._registry = None
            return {}


class RoundRobinRequestRouter(_CountingRouter):
    """Each request to the next replica in id order (one that is full is skipped): the baseline."""

    def initialize_state(self) -> None:
        self._start_counting()
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        replicas = {replica_name(r.replica_id): r for r in candidate_replicas}
        decision = round_robin_choice(list(replicas), self._turn)
        self._turn += 1
        self.decisions[decision.reason] += 1
        return [[replicas[name] for name in group] for group in decision.ranked]
