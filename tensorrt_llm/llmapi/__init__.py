"""User-facing API in upstream's style: ``LLM``, ``SamplingParams``, ``KvCacheConfig``.

The names are imported on first use, so that the argument descriptions (``llm_args``,
``config_fields``) load without torch: ``trtllm-serve`` checks its flags and options file
before torch and the model load.
"""

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "RequestOutputHandle",
    "SamplingParams",
    "SchedulerConfig",
]


def __getattr__(name: str):
    if name == "KvCacheConfig":
        from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig

        return KvCacheConfig
    if name == "SchedulerConfig":
        from tensorrt_llm._torch.pyexecutor.config import SchedulerConfig

        return SchedulerConfig
    if name == "GuidedDecodingParams":
        from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecodingParams

        return GuidedDecodingParams
    if name == "RequestError":
        from tensorrt_llm._torch.pyexecutor.errors import RequestError

        return RequestError
    if name in __all__:
        from tensorrt_llm.llmapi import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tensorrt_llm.llmapi' has no attribute {name!r}")
