"""``ResourceManager``: every per-request resource under one prepare / update / free lifecycle.

Managers are prepared in registration order and freed in reverse order, as upstream does.
The KV cache manager is the one resource here; the protocol is what the executor sees.
"""

from __future__ import annotations

from typing import Protocol

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

KV_CACHE_MANAGER = "kv_cache_manager"


class BaseResourceManager(Protocol):
    def prepare_resources(self, scheduled: ScheduledRequests) -> None: ...

    def update_resources(self, scheduled: ScheduledRequests) -> None: ...

    def free_resources(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None: ...


class ResourceManager:
    def __init__(self, managers: dict[str, BaseResourceManager]) -> None:
        self.managers = dict(managers)

    def get_resource_manager(self, name: str) -> BaseResourceManager:
        return self.managers[name]

    def prepare_resources(self, scheduled: ScheduledRequests) -> None:
        for manager in self.managers.values():
            manager.prepare_resources(scheduled)

    def update_resources(self, scheduled: ScheduledRequests) -> None:
        for manager in self.managers.values():
            manager.update_resources(scheduled)

    def free_resources(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        for manager in reversed(self.managers.values()):
            manager.free_resources(request, store_for_reuse=store_for_reuse)
