"""Outside tools the suite runs (a benchmark client, a router's indexer), each in a venv of its own.

A tool's dependencies must not enter the project's venv (they pin their own versions), so each one
is installed once into ``<the project's venv>/bench-clients/<name>-<version>`` and reused by later
runs; a stamp file says the install finished. Where the package registry cannot be reached, the
test that asked is skipped with pip's own words, never failed: the suite must not depend on the
network to pass where nothing of ours is wrong.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["tool_venv"]

# what pip says when it cannot reach the registry
_UNREACHABLE = ("Temporary failure in name resolution", "Network is unreachable", "Failed to establish a new connection",
                "Connection refused", "ConnectTimeoutError", "No matching distribution found")


def tool_venv(requirement: str, *, see_project_packages: bool = False) -> Path:
    """The venv holding ``requirement`` (``name==version``), installed on first use.

    ``see_project_packages``: the venv also sees the project venv's site-packages (a ``.pth`` file), so
    the tool reuses what is installed there (torch, transformers) instead of downloading its own."""
    venv = Path(sys.prefix) / "bench-clients" / requirement.replace("==", "-")
    stamp = venv / ".installed"
    if stamp.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    # One installer at a time: two test runs sharing the project's venv (or the workers of one) may
    # ask for the same tool at once, and a second ``venv --clear`` would wipe the first's install.
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            _install(requirement, venv, see_project_packages)
            stamp.touch()
    return venv


def _install(requirement: str, venv: Path, see_project_packages: bool) -> None:
    """A fresh ``venv`` with ``requirement`` in it; skips the test where the registry is unreachable."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    if see_project_packages:
        site = next((venv / "lib").glob("python*/site-packages"))
        parent = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
        (site / "project-packages.pth").write_text(parent + "\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and any(words in done.stderr for words in _UNREACHABLE):
        pytest.skip(f"the package registry cannot be reached to install {requirement}: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, f"pip install {requirement} failed:\n{done.stderr[-3000:]}"
