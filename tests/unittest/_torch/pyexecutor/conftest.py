"""Fixtures shared by the executor tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's matmuls are far too small for intra-op threads: on a busy 2-core
    machine, OpenMP spin-waiting made each forward about 20 times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
