"""Hypothesis profiles: ``ci`` (default, used by ``make test``) and ``thorough`` (``make thorough``)."""

import os
import sys
from pathlib import Path

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
