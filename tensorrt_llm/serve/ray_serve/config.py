"""The Ray Serve application's own settings (``build_app``'s arguments beside the model, its
``LLM(...)`` options and the HTTP front's ``ServerConfig``). Nothing here imports Ray."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tensorrt_llm.serve.ray_serve.routing import LoadBound

ROUTERS = ("prefix_aware", "round_robin", "power_of_two")


def _positive(name: str, value: object, *, kind: type | tuple[type, ...] = (int, float), minimum: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not minimum < value < math.inf:
        raise ValueError(f"{name} must be a number > {minimum:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class RayServeConfig:
    """How many replicas, how requests are routed to them, and what each reserves."""

    num_replicas: int = 2  # LLM replicas, each an engine of its own
    # how the ingress picks a replica: the longest cached prefix within the load bound
    # (prefix_aware), turns (round_robin), or Ray Serve's default, power of two choices
    router: str = field(default="prefix_aware", metadata={"choices": ROUTERS})
    # prefix_aware: a replica with more requests in flight than the least-loaded one plus this is skipped
    max_load_gap: int = 4
    max_in_flight: int | None = None  # prefix_aware: a replica with this many requests in flight is skipped
    min_match_blocks: int = 1  # prefix_aware: a shorter cached prefix (in blocks) does not steer a request
    # prefix_aware: how long a routing decision waits for the registry's match; past it the request is balanced
    match_timeout_s: float = 0.5
    replica_num_cpus: float = 1.0  # CPUs Ray reserves for each LLM replica (Ray's default is 1)
    ingress_num_cpus: float = 0.5  # CPUs Ray reserves for each ingress replica
    ingress_replicas: int = 1  # replicas of the HTTP ingress (tokenizes for routing, relays the answer)
    max_ongoing_requests: int = 256  # requests Ray Serve lets one LLM replica hold (more wait in the router)
    health_check_period_s: float = 5.0  # how often Ray Serve calls each replica's check_health
    health_check_timeout_s: float = 30.0  # a check_health that takes longer fails
    report_period_s: float = 1.0  # how often each replica reports its health and metrics to the registry

    def __post_init__(self) -> None:
        for name in ("num_replicas", "ingress_replicas", "max_ongoing_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        self.load_bound  # noqa: B018 - checks max_load_gap, max_in_flight and min_match_blocks
        for name in ("replica_num_cpus", "ingress_num_cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("health_check_period_s", "health_check_timeout_s", "report_period_s", "match_timeout_s"):
            _positive(name, getattr(self, name))

    @property
    def load_bound(self) -> LoadBound:
        return LoadBound(max_load_gap=self.max_load_gap, max_in_flight=self.max_in_flight,
                         min_match_blocks=self.min_match_blocks)

    @property
    def stale_after_s(self) -> float:
        """A replica silent this long is gone (three reports missed, at least 5 s)."""
        return max(5.0, 3 * self.report_period_s)
