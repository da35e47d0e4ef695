"""Host-tier copies gathered into batches: one gather and a few transfers instead of one each per block.

An allocation that evicts or onboards hundreds of blocks used to enqueue two operations per block
(a strided gather of the block's ``2 * num_layers`` pieces and one transfer), at tens of
microseconds of host time each. :class:`CopyBatch` collects them instead, and the storage issues a
batch as one gather of every offloaded block, one transfer per run of consecutive host slots, and
the same in reverse for onboards (one scatter), so the host's cost per block is a list append.

A batch runs its offloads first, then its onboards, each group in issue order. That is the issue
order with some offloads moved before onboards issued earlier, which is safe unless such an
offload reads a device block a pending onboard writes, or writes a host slot a pending onboard
reads; and an onboard's scatter must not write a device block twice. :meth:`CopyBatch.conflicts`
says when a new copy would break one of those, and the storage issues the batch before taking it.
So a batch's result equals the copies run one by one in issue order (a property test checks it).

No torch here: the storage does the moving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CopyBatch", "runs"]


@dataclass(slots=True)
class CopyBatch:
    """Pending offloads ``(block_id, host_id)`` and onboards ``(host_id, block_id)``, in issue order."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    onboards: list[tuple[int, int]] = field(default_factory=list)
    _onboard_reads: set[int] = field(default_factory=set)  # host slots the pending onboards read
    _onboard_writes: set[int] = field(default_factory=set)  # device blocks they write

    def __len__(self) -> int:
        return len(self.offloads) + len(self.onboards)

    def conflicts(self, *, offload: tuple[int, int] | None = None, onboard: tuple[int, int] | None = None) -> bool:
        """Whether this copy cannot join the batch (it must be issued first; module docstring)."""
        if offload is not None:
            block_id, host_id = offload
            return block_id in self._onboard_writes or host_id in self._onboard_reads
        _, block_id = onboard
        return block_id in self._onboard_writes

    def add_offload(self, block_id: int, host_id: int) -> None:
        self.offloads.append((block_id, host_id))

    def add_onboard(self, host_id: int, block_id: int) -> None:
        self.onboards.append((host_id, block_id))
        self._onboard_reads.add(host_id)
        self._onboard_writes.add(block_id)

    def blocks(self) -> set[int]:
        """The device blocks the batch reads or writes."""
        return {b for b, _ in self.offloads} | self._onboard_writes


def runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first index in host_ids, first host slot, length)`` for each maximal run of consecutive
    host slots in ``host_ids`` (in order), so that each run is one transfer."""
    out: list[tuple[int, int, int]] = []
    for i, host_id in enumerate(host_ids):
        if out and out[-1][1] + out[-1][2] == host_id:
            start, first, length = out[-1]
            out[-1] = (start, first, length + 1)
        else:
            out.append((i, host_id, 1))
    return out
