"""A Python that runs our Triton kernels under Triton's CPU interpreter, for the tests that check
them against their references without a GPU.

Triton is not a dependency of the project (its CPU build of torch needs none), so where the
project's venv lacks it the interpreter runs from a tool venv of its own (``tool_venvs``) that
also sees the project's packages (torch, numpy). The version is the GPU machine's, 3.6.0: the
interpreter of later versions refuses a mask dtype the drafting kernel uses, and a kernel must be
checked by the Triton that compiles it. ``TRITON_INTERPRET`` must be set before Triton is first
imported, so the kernels run in a fresh process: :func:`run_interpreted`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tool_venvs import tool_venv

__all__ = ["TRITON", "run_interpreted"]

TRITON = "triton==3.6.0"
_ROOT = Path(__file__).parents[2]


def _python() -> str:
    if importlib.util.find_spec("triton") is not None:
        return sys.executable
    return str(tool_venv(TRITON, see_project_packages=True) / "bin" / "python")


def run_interpreted(script: Path, timeout: float = 300) -> object:
    """Run ``script`` under the interpreter and return the JSON of its last line of output."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([_python(), str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
