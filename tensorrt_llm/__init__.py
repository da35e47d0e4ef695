"""An independent Python executor layer in the layout of TensorRT-LLM's PyTorch executor.

``from tensorrt_llm import LLM, SamplingParams`` is the user-facing entry point; the
executor itself lives in :mod:`tensorrt_llm._torch.pyexecutor`. The facade is imported
lazily so that simulation and tests of the executor layer do not load it.
"""

__all__ = ["LLM", "RequestError", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:
        from tensorrt_llm import llmapi

        return getattr(llmapi, name)
    raise AttributeError(f"module 'tensorrt_llm' has no attribute {name!r}")
