"""Upstream's module name for the KV cache manager, which lives in :mod:`.kv_cache.manager`."""

from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager

__all__ = ["KVCacheManager"]
