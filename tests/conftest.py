"""Hypothesis profiles: ``ci`` (default, used by ``make test``) and ``thorough`` (``make thorough``)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Test helper modules (factories, invariant checker) import by plain name.
sys.path.insert(0, str(Path(__file__).parent / "unittest" / "_torch" / "pyexecutor"))

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=150, **_COMMON)
settings.register_profile("thorough", max_examples=5000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's matmuls are far too small for intra-op threads: on a busy 2-core
    machine, OpenMP spin-waiting made each forward about 20 times slower (and starves the
    rank processes the multi-rank tests run beside this one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
