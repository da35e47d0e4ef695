"""A forward's host arrays to the device through persistent pinned buffers.

A launch ships a handful of small index arrays (ids, positions, slots, block tables, lengths). A
non-blocking host-to-device copy needs pinned host memory; ``Tensor.pin_memory()`` per array
takes a block from torch's caching host allocator, copies the array into it and gives it back
with an event, some ten times a step (and page-locks new memory whenever a size has not been
seen yet). :class:`PinnedStaging` instead keeps two pinned buffers for the engine's life and
uses them in turn, one per launch (:meth:`PinnedStaging.step`)::

    launch n     buffer 0: pack each array, one async copy each ─ event E0 (current stream)
    launch n+1   buffer 1: ...                                  ─ event E1
    launch n+2   buffer 0 again, once E0 has passed

The host must not rewrite a buffer whose copies may still be pending; under the overlap
scheduler E0 has passed by launch n+2 (forward n, enqueued after E0's copies, has completed by
then), so the host does not wait. Should it ever have to, it waits for E0 alone and counts it
(``num_waits``). A buffer too small for a launch is replaced by a larger one; the old one stays
allocated until its pending copies are done (torch's caching host allocator records their stream).

Each array gets its own device tensor from the caching allocator, as ``Tensor.to`` gives it,
filled from its region of the buffer by a non-blocking copy on the current stream.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

__all__ = ["PinnedStaging"]

_ALIGN = 256  # bytes between the arrays' regions: every dtype's alignment and then some
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class PinnedStaging:
    """Host arrays to ``device`` through ``num_buffers`` persistent pinned buffers used in turn."""

    def __init__(self, device: torch.device | str, *, capacity: int = 1 << 20, num_buffers: int = 2) -> None:
        self.device = torch.device(device)
        self._buffers = [_pinned(capacity) for _ in range(num_buffers)]
        self._events = [torch.cuda.Event() for _ in range(num_buffers)]
        self._turn = num_buffers - 1
        self._offset: int | None = None  # None: outside a step
        self.num_waits = 0  # steps whose buffer still had copies pending (the host waited for them)

    @contextlib.contextmanager
    def step(self) -> Iterator["PinnedStaging"]:
        """One launch: the next buffer, after its previous copies; its event is recorded on exit."""
        if self._offset is not None:
            raise RuntimeError("PinnedStaging.step() does not nest")
        self._turn = (self._turn + 1) % len(self._buffers)
        event = self._events[self._turn]
        if not event.query():
            self.num_waits += 1
            event.synchronize()
        self._offset = 0
        try:
            yield self
        finally:
            event.record(torch.cuda.current_stream(self.device))
            self._offset = None

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a new device tensor (same dtype and shape), copied without blocking the host."""
        staged = self._stage(array)
        if staged.numel() == 0:
            return torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
        return staged.to(self.device, non_blocking=True)

    def copy_to(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """Copy ``array`` into the device tensor ``dst`` (its shape; a view is fine) without blocking the host."""
        staged = self._stage(array)
        if staged.numel():
            dst.copy_(staged, non_blocking=True)

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """``array`` copied into this step's buffer: a pinned tensor of its dtype and shape."""
        if self._offset is None:
            raise RuntimeError("PinnedStaging used outside step()")
        array = np.ascontiguousarray(array)
        dtype = _TORCH_DTYPES.get(array.dtype) or torch.from_numpy(array[:0]).dtype
        start = self._offset
        end = start + array.nbytes
        buffer, view = self._buffers[self._turn]
        if end > len(view):  # a larger buffer from here on (the old one lives until its copies are done)
            start, end = 0, array.nbytes
            buffer, view = self._buffers[self._turn] = _pinned(max(2 * len(view), 1 << (end - 1).bit_length()))
        view[start:end].view(array.dtype).reshape(array.shape)[...] = array  # into pinned memory
        self._offset = -(-end // _ALIGN) * _ALIGN
        return buffer[start:end].view(dtype).view(array.shape)


def _pinned(nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
    """A pinned byte buffer and a numpy view of it (how the host fills it)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return buffer, buffer.numpy()
