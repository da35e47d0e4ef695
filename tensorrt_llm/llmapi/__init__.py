"""User-facing API in upstream's style: ``LLM``, ``SamplingParams`` and the config class of every
``LLM(...)`` argument, under upstream's names (the project's own names kept beside them):

=============================  ===========================  =====================================
``LLM(...)`` argument          class (upstream's name)       also importable as
=============================  ===========================  =====================================
``kv_cache_config``            ``KvCacheConfig``
``cuda_graph_config``          ``CudaGraphConfig``
``scheduler_config``           ``SchedulerConfig``
``speculative_config``         ``NGramDecodingConfig``       ``SpeculativeConfig``
``fault_injection``            ``FaultInjectionConfig``
``simulated_engine``           ``SimulatedEngineConfig``
``kv_events_config``           ``KVEventsConfig`` (vLLM's)
``capacity_scheduler_policy``  ``CapacitySchedulerPolicy``
``context_chunking_policy``    ``ContextChunkingPolicy``
``token_budget_policy``        ``TokenBudgetPolicyName``
every keyword                  ``TorchLlmArgs``              ``LlmArgs``
=============================  ===========================  =====================================

Each argument also takes the mapping the ``--extra_llm_api_options`` YAML holds
(``LLM(speculative_config={"decoding_type": "NGram", "max_draft_len": 4})``).

The names are imported on first use, so that the argument descriptions (``llm_args``,
``config_fields``) load without torch: ``trtllm-serve`` checks its flags and options file
before torch and the model load.
"""

_CONFIG = "tensorrt_llm._torch.pyexecutor.config"

#: Public name -> (module, attribute).
_NAMES = {
    "LLM": ("tensorrt_llm.llmapi.llm", "LLM"),
    "SamplingParams": ("tensorrt_llm.llmapi.llm", "SamplingParams"),
    "CompletionOutput": ("tensorrt_llm.llmapi.llm", "CompletionOutput"),
    "RequestOutput": ("tensorrt_llm.llmapi.llm", "RequestOutput"),
    "RequestOutputHandle": ("tensorrt_llm.llmapi.llm", "RequestOutputHandle"),
    "RequestError": ("tensorrt_llm._torch.pyexecutor.errors", "RequestError"),
    "GuidedDecodingParams": ("tensorrt_llm._torch.pyexecutor.sampling.guided_decoder", "GuidedDecodingParams"),
    "KvCacheConfig": (_CONFIG, "KvCacheConfig"),
    "SimulatedEngineConfig": ("tensorrt_llm._torch.pyexecutor.engine.simulated", "SimulatedEngineConfig"),
    "CudaGraphConfig": (_CONFIG, "CudaGraphConfig"),
    "SchedulerConfig": (_CONFIG, "SchedulerConfig"),
    "NGramDecodingConfig": (_CONFIG, "SpeculativeConfig"),  # upstream's name for the n-gram drafter's config
    "SpeculativeConfig": (_CONFIG, "SpeculativeConfig"),
    "DecodingType": (_CONFIG, "DecodingType"),
    "FaultInjectionConfig": (_CONFIG, "FaultInjectionConfig"),
    "CapacitySchedulerPolicy": (_CONFIG, "CapacitySchedulerPolicy"),
    "ContextChunkingPolicy": (_CONFIG, "ContextChunkingPolicy"),
    "WaitingQueuePolicy": (_CONFIG, "WaitingQueuePolicy"),
    "TokenBudgetPolicyName": (_CONFIG, "TokenBudgetPolicyName"),
    "ExecutorConfig": (_CONFIG, "ExecutorConfig"),
    "KVEventsConfig": ("tensorrt_llm.llmapi.llm_args", "KVEventsConfig"),  # vLLM's name: upstream has none
    "TorchLlmArgs": ("tensorrt_llm.llmapi.llm_args", "LlmArgs"),  # upstream's name for the PyTorch backend's args
    "LlmArgs": ("tensorrt_llm.llmapi.llm_args", "LlmArgs"),
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        module, attribute = _NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'tensorrt_llm.llmapi' has no attribute {name!r}")
