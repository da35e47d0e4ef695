"""The host tier's copy batches give what the copies would give one by one, in issue order.

``KVCacheStorage`` on CUDA issues offloads and onboards in batches (``kv_copy_batch``). Here a
batch is run the way the storage runs it, on numpy arrays, and compared
with running every copy at once in issue order, over any sequence of copies: the conflict rule
must make the reordering invisible whatever the pool does.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.kv_cache.copy_batch import CopyBatch, runs

NUM_BLOCKS, NUM_HOST = 6, 5

copies = st.lists(
    st.tuples(st.sampled_from(["offload", "onboard", "compute"]), st.integers(0, NUM_BLOCKS - 1),
              st.integers(0, NUM_HOST - 1)),
    max_size=40,
)


class _Storage:
    """``KVCacheStorage``'s batching on CUDA, on numpy arrays: an onboard's transfer into its
    staging row when it is added; at issue, one gather, transfers per run, one scatter."""

    def __init__(self, device: np.ndarray, host: np.ndarray) -> None:
        self.device, self.host = device, host
        self.batch, self.landed = CopyBatch(), []

    def offload(self, block_id: int, host_id: int) -> None:
        if self.batch.conflicts(offload=(block_id, host_id)):
            self.issue()
        self.batch.add_offload(block_id, host_id)

    def onboard(self, host_id: int, block_id: int) -> None:
        if self.batch.conflicts(onboard=(host_id, block_id)):
            self.issue()
        assert self.batch.add_onboard(host_id, block_id) == len(self.landed)
        self.landed.append(self.host[host_id].copy())

    def issue(self) -> None:
        batch = self.batch
        if batch.offloads:
            blocks, host_ids = zip(*batch.offloads)
            gathered = self.device[list(blocks)]
            for i, first, n in runs(list(host_ids)):
                self.host[first:first + n] = gathered[i:i + n]
        if batch.onboards:
            blocks = [block_id for _, block_id in batch.onboards]
            assert len(set(blocks)) == len(blocks), "a scatter writes a block twice"
            self.device[blocks] = np.stack(self.landed)
        self.batch, self.landed = CopyBatch(), []


@given(copies)
def test_a_batched_sequence_equals_the_copies_in_issue_order(ops) -> None:
    rng = np.random.default_rng(0)
    device0, host0 = rng.normal(size=(NUM_BLOCKS, 3)), rng.normal(size=(NUM_HOST, 3))
    device, host = device0.copy(), host0.copy()  # one by one
    batched = _Storage(device0.copy(), host0.copy())
    for step, (kind, block_id, host_id) in enumerate(ops):
        if kind == "offload":
            host[host_id] = device[block_id]
            batched.offload(block_id, host_id)
        elif kind == "onboard":
            device[block_id] = host[host_id]
            batched.onboard(host_id, block_id)
        else:  # a forward writes a block: the storage issues the batch first (before_compute)
            batched.issue()
            device[block_id] = batched.device[block_id] = 100 + step
    batched.issue()
    np.testing.assert_array_equal(batched.device, device)
    np.testing.assert_array_equal(batched.host, host)


def test_a_full_tier_refilling_an_onboarded_slot_stays_in_one_batch() -> None:
    """The pool's pattern with its tier full: evict a block into the slot the last onboard freed,
    then onboard into the evicted block's place; none of it forces the batch out."""
    batch = CopyBatch()
    batch.add_offload(0, 0)
    batch.add_onboard(1, 0)
    for n in range(1, 20):
        assert not batch.conflicts(offload=(n, n))  # slot n: freed by the previous onboard
        batch.add_offload(n, n)
        assert not batch.conflicts(onboard=(n + 1, n))
        batch.add_onboard(n + 1, n)
    assert len(batch) == 40


def test_runs_are_maximal_and_in_order() -> None:
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 10, 2, 3, 3]) == [(0, 3, 3), (3, 9, 2), (5, 2, 2), (7, 3, 1)]


def test_batch_blocks_are_what_it_reads_and_writes() -> None:
    batch = CopyBatch()
    batch.add_offload(1, 0)
    batch.add_onboard(2, 4)
    assert batch.blocks() == {1, 4} and len(batch) == 2
    assert batch.conflicts(offload=(4, 3))  # reads a block an onboard writes
    assert batch.conflicts(onboard=(0, 5))  # reads a slot an offload writes
    assert batch.conflicts(onboard=(3, 4))  # the scatter would write block 4 twice
    assert not batch.conflicts(offload=(1, 2)) and not batch.conflicts(onboard=(2, 5))
