"""User-facing API in upstream's style: ``LLM``, ``SamplingParams``, ``KvCacheConfig``."""

from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm._torch.pyexecutor.errors import RequestError
from tensorrt_llm.llmapi.llm import LLM, CompletionOutput, RequestOutput, RequestOutputHandle, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "RequestOutputHandle",
    "SamplingParams",
]
