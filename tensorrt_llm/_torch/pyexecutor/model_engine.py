"""Upstream's module name for the model engine: the interface is in :mod:`.engine.interface`,
the torch engines in :mod:`.engine.torch_engine` (importing this module loads torch)."""

from tensorrt_llm._torch.pyexecutor.engine.interface import ModelEngine
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import (
    CpuTorchModelEngine,
    CudaTorchModelEngine,
    TorchModelEngine,
)

__all__ = ["CpuTorchModelEngine", "CudaTorchModelEngine", "ModelEngine", "TorchModelEngine"]
