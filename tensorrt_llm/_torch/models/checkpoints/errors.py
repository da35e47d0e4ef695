"""The one error every checkpoint reader raises."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or describes a model we cannot run."""
