"""The host tier's copy batches give what the copies would give one by one, in issue order.

``KVCacheStorage`` on CUDA issues offloads and onboards in batches (offloads first, then onboards;
``kv_copy_batch``). Here a batch is run the way the storage runs it, on numpy arrays, and compared
with running every copy at once in issue order, over any sequence of copies: the conflict rule
must make the reordering invisible whatever the pool does.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.kv_copy_batch import CopyBatch, runs

NUM_BLOCKS, NUM_HOST = 6, 5

copies = st.lists(
    st.tuples(st.sampled_from(["offload", "onboard", "compute"]), st.integers(0, NUM_BLOCKS - 1),
              st.integers(0, NUM_HOST - 1)),
    max_size=40,
)


def _run_batch(batch: CopyBatch, device: np.ndarray, host: np.ndarray) -> None:
    """As ``KVCacheStorage._issue_batch``: one gather, transfers per run, one scatter."""
    if batch.offloads:
        blocks, host_ids = zip(*batch.offloads)
        gathered = device[list(blocks)]
        for i, first, n in runs(list(host_ids)):
            host[first:first + n] = gathered[i:i + n]
    if batch.onboards:
        host_ids, blocks = zip(*batch.onboards)
        landed = np.empty((len(blocks), *host.shape[1:]))
        for i, first, n in runs(list(host_ids)):
            landed[i:i + n] = host[first:first + n]
        assert len(set(blocks)) == len(blocks), "a scatter writes a block twice"
        device[list(blocks)] = landed


@given(copies)
def test_a_batched_sequence_equals_the_copies_in_issue_order(ops) -> None:
    rng = np.random.default_rng(0)
    device0, host0 = rng.normal(size=(NUM_BLOCKS, 3)), rng.normal(size=(NUM_HOST, 3))
    device, host = device0.copy(), host0.copy()  # one by one
    bdevice, bhost = device0.copy(), host0.copy()  # batched
    batch = CopyBatch()
    for step, (kind, block_id, host_id) in enumerate(ops):
        if kind == "offload":
            host[host_id] = device[block_id]
            if batch.conflicts(offload=(block_id, host_id)):
                _run_batch(batch, bdevice, bhost)
                batch = CopyBatch()
            batch.add_offload(block_id, host_id)
        elif kind == "onboard":
            device[block_id] = host[host_id]
            if batch.conflicts(onboard=(host_id, block_id)):
                _run_batch(batch, bdevice, bhost)
                batch = CopyBatch()
            batch.add_onboard(host_id, block_id)
        else:  # a forward writes a block: the storage issues the batch first (before_compute)
            _run_batch(batch, bdevice, bhost)
            batch = CopyBatch()
            device[block_id] = bdevice[block_id] = 100 + step
    _run_batch(batch, bdevice, bhost)
    np.testing.assert_array_equal(bdevice, device)
    np.testing.assert_array_equal(bhost, host)


def test_runs_are_maximal_and_in_order() -> None:
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 10, 2, 3, 3]) == [(0, 3, 3), (3, 9, 2), (5, 2, 2), (7, 3, 1)]


def test_batch_blocks_are_what_it_reads_and_writes() -> None:
    batch = CopyBatch()
    batch.add_offload(1, 0)
    batch.add_onboard(0, 4)
    assert batch.blocks() == {1, 4} and len(batch) == 2
    assert batch.conflicts(offload=(4, 2))  # reads a block an onboard writes
    assert batch.conflicts(offload=(2, 0))  # writes a host slot an onboard reads
    assert batch.conflicts(onboard=(3, 4))  # the scatter would write block 4 twice
    assert not batch.conflicts(offload=(1, 3)) and not batch.conflicts(onboard=(0, 5))
