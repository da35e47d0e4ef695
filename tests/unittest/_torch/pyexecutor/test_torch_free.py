"""The scheduling side imports no torch: a replay, the scheduler's tests and the KV manager's
run without it. Checked in a fresh interpreter (this one has torch loaded long ago)."""

import subprocess
import sys

import pytest

TORCH_FREE = [
    "tensorrt_llm._torch.pyexecutor.scheduler",
    "tensorrt_llm._torch.pyexecutor.kv_cache.manager",
    "tensorrt_llm._torch.pyexecutor.resource_manager",
    "tensorrt_llm._torch.pyexecutor.engine.interface",
    "tensorrt_llm._torch.pyexecutor.engine.inputs",
    "tensorrt_llm._torch.pyexecutor.engine.simulated",
    "tensorrt_llm._torch.pyexecutor.executor.client",
    "tensorrt_llm._torch.pyexecutor.iteration.records",
]


def loads_torch(module: str) -> bool:
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "True"


def test_the_probe_sees_torch():
    assert loads_torch("tensorrt_llm._torch.pyexecutor.engine.torch_engine")


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    assert not loads_torch(module), f"importing {module} loads torch"
