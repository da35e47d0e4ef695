"""Host-tier copies gathered into batches: one gather and a few transfers instead of one each per block.

An allocation that evicts or onboards hundreds of blocks used to enqueue two operations per block
(a strided gather or scatter of the block's ``2 * num_layers`` pieces, and a transfer), at tens of
microseconds of host time each. :class:`CopyBatch` collects them instead, and the storage runs a
batch as:

* each onboard's transfer, host slot to a row of a device staging buffer, enqueued when the
  onboard is added (so the slot may be offloaded into again at once, as the pool does when its
  tier is full);
* when the batch is issued: one gather of every offloaded block, one transfer per run of
  consecutive host slots, then one scatter of the staged onboards into their blocks.

That reorders the issue order: onboards read their host slot early and write their block late,
offloads read their block and write their slot late. The result equals the copies run one by one
in issue order unless an offload reads a block a pending onboard writes, an onboard reads a slot
a pending offload writes, or two onboards write one block. :meth:`CopyBatch.conflicts` says when a
new copy would do one of those, and the storage issues the batch before taking it (a property
test checks the equality over any sequence of copies).

No torch here: the storage does the moving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CopyBatch", "runs"]


@dataclass(slots=True)
class CopyBatch:
    """Pending offloads ``(block_id, host_id)`` and onboards ``(host_id, block_id)``, in issue order.
    An onboard's staging row is its index in ``onboards``."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    onboards: list[tuple[int, int]] = field(default_factory=list)
    _offload_writes: set[int] = field(default_factory=set)  # host slots the pending offloads write
    _onboard_writes: set[int] = field(default_factory=set)  # device blocks the pending onboards write

    def __len__(self) -> int:
        return len(self.offloads) + len(self.onboards)

    def conflicts(self, *, offload: tuple[int, int] | None = None, onboard: tuple[int, int] | None = None) -> bool:
        """Whether this copy cannot join the batch (it must be issued first; module docstring)."""
        if offload is not None:
            block_id, _ = offload
            return block_id in self._onboard_writes
        host_id, block_id = onboard
        return host_id in self._offload_writes or block_id in self._onboard_writes

    def add_offload(self, block_id: int, host_id: int) -> None:
        self.offloads.append((block_id, host_id))
        self._offload_writes.add(host_id)

    def add_onboard(self, host_id: int, block_id: int) -> int:
        """Add an onboard; returns its staging row."""
        self.onboards.append((host_id, block_id))
        self._onboard_writes.add(block_id)
        return len(self.onboards) - 1

    def blocks(self) -> set[int]:
        """The device blocks the batch reads or writes when it is issued."""
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
