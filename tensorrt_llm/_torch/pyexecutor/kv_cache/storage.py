"""Real K/V tensors in a paged layout, on the model's device, with a host tier for offloading.

Per layer, K and V are each one pool ``(num_blocks, tokens_per_block, num_kv_heads, head_dim)``;
a block id indexes dim 0 of every layer's pools. All pools are views of ONE tensor::

    pools: (2, num_layers, num_blocks + num_scratch_blocks, tokens_per_block, num_kv_heads, head_dim)
            K/V

so that moving a block (copy, offload, onboard) is one copy across every layer instead of one per
layer and pool. The host tier holds each block in one piece::

    host: (num_host_blocks, 2, num_layers, tokens_per_block, num_kv_heads, head_dim)

on the CPU, pinned when the pools are on CUDA. Scratch blocks follow the ``num_blocks`` blocks the
KV manager hands out: never allocated to a request, they absorb the writes of the padding rows of a
CUDA-graph batch.

On CUDA with a host tier, offloads (device to host) and onboards (host to device) run on a copy
stream of their own, ordered with the compute stream (the current stream, where forwards and
``copy_block`` run) by events; the host never waits for either. Under the overlap scheduler the KV
manager evicts and onboards for forward n+1 while forward n runs::

    host     launch n ─┬─ allocate for n+1: offload x, onboard y ─┬─ launch n+1
                       │                                          │
    compute  ──────────M_n[ forward n, tables T_n ]···············(wait C)[ forward n+1 ]
    copy     ─────────────(wait M_n)[ offload x ][ onboard y ]C

* ``M_n``: recorded on the compute stream by :meth:`before_compute` just before forward n's
  kernels. A copy waits for it, i.e. for every earlier forward, which wrote what it offloads and
  last used the slot it onboards into; it does not wait for forward n itself, so it runs beside
  it. A copy whose block is in ``T_n`` (the tables forward n reads and writes), or was touched by
  a ``copy_block`` since, waits for the compute stream's tail instead (forward n included). The
  executor frees no block of a forward in flight, so under overlap this is rare; without overlap
  forward n has completed by then and the wait costs nothing.
* ``C``: recorded on the copy stream by the next :meth:`before_compute` (forward n+1's) or
  ``copy_block``, which then make the compute stream wait for it: a slot whose offload is pending
  is not overwritten, and an onboarded block is in place, before anything on the compute stream
  touches the pools again.
* The host tier is written only by offloads and read only by onboards, all on the copy stream,
  so they run in issue order: a host slot freed by an onboard can be handed to the next offload
  at once (its source is read before it is overwritten), and no host event is needed. The host
  itself never reads or writes the tier (:meth:`synchronize` first, for a test that does).

So the host waits for nothing here, and the compute stream waits, on the device, only for the
copies issued before the work that follows. Work on the compute stream that touches the pools other than
through a forward (:meth:`before_compute` with its tables) or ``copy_block`` — a test writing a
block — calls :meth:`before_compute` with no tables first; then the next copy waits for all of it.
On CUDA, offloads and onboards are not issued one by one: they join a :class:`CopyBatch`
(``kv_copy_batch``; an onboard's transfer into a staging buffer is enqueued at once, on an upload
stream of its own so that it overlaps the copy stream's offloads), issued as one gather, one
transfer per run of consecutive host slots and one scatter once it holds
``max_batch_blocks`` copies, before a copy that would conflict with it, and
before anything on the compute stream touches the pools (:meth:`before_compute`, ``copy_block``)
or the host reads the tier (:meth:`synchronize`). The ordering above applies to a batch as to a
copy: the copy stream waits for the compute stream's tail if any of the batch's blocks is busy.

On the CPU every copy is a plain synchronous one.

An FP8 pool (``KvCacheConfig.dtype: fp8``, ``attention_backend.kv_quant``) and its host tier
hold float8_e4m3fn: every move above runs on byte views of both (``_pools``, ``_host``), so a
block's bytes travel unchanged (not every device has gather, scatter and copy kernels for
float8), and ``kv_scales`` (per layer, 1.0 unless a checkpoint gave them) go with the storage to
the engine's attention plans.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Sequence

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, is_quantized

from .copy_batch import CopyBatch, runs


class KVCacheStorage:
    """Tensor storage behind a :class:`BlockPool` (which decides what moves where)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        num_host_blocks: int,
        block_shape: tuple[int, int, int],  # (tokens_per_block, num_kv_heads, head_dim)
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_scratch_blocks: int = 0,
        max_batch_blocks: int = 64,
        kv_scales: KvScales | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.num_scratch_blocks = num_scratch_blocks
        rows = num_blocks + num_scratch_blocks
        self.pools = torch.zeros((2, num_layers, rows, *block_shape), dtype=dtype, device=self.device)
        pin = self.device.type == "cuda" and num_host_blocks > 0
        self.host = torch.zeros((num_host_blocks, 2, num_layers, *block_shape), dtype=dtype, pin_memory=pin)
        if kv_scales is not None and kv_scales.num_layers != num_layers:
            raise ValueError(f"kv_scales has {kv_scales.num_layers} layers, the KV storage {num_layers}")
        self.kv_scales = kv_scales  # an FP8 pool's per-layer scales (None: 1.0)
        # What block moves copy: the tensors themselves, or byte views of an FP8 pool and tier.
        self._pools = self.pools.view(torch.uint8) if is_quantized(self.pools) else self.pools
        self._host = self.host.view(torch.uint8) if is_quantized(self.host) else self.host
        self.k_cache = list(self.pools[0])  # (rows, tokens_per_block, num_kv_heads, head_dim) per layer
        self.v_cache = list(self.pools[1])
        self.k_host = list(self.host[:, 0].transpose(0, 1))  # (num_host_blocks, tokens_per_block, ...) per layer
        self.v_host = list(self.host[:, 1].transpose(0, 1))
        # The copy stream and its ordering state (module docstring); None on the CPU or without a tier.
        self._copy_stream = torch.cuda.Stream(self.device) if pin else None
        # Onboards' transfers into the staging buffer run on a stream of their own, so that they
        # overlap the previous batch's offloads (the two directions use separate copy engines).
        self._upload_stream = torch.cuda.Stream(self.device) if pin else None
        if pin:
            self._uploaded = torch.cuda.Event()  # upload stream, after the staged transfers so far
            self._issued = torch.cuda.Event()  # copy stream, after the newest batch's transfers
            self._mark = torch.cuda.Event()  # M: compute stream, before the newest forward
            self._tail = torch.cuda.Event()  # the compute stream's tail, when a copy must wait for all of it
            self._copied = torch.cuda.Event()  # C: copy stream, after the copies so far
        self._mark_waited = True  # the copy stream waits for M already (or there is none)
        self._any_busy = True  # compute work of unknown extent since M (the pools' zeroing, to begin with)
        self._busy_tables: Sequence[Sequence[int]] = ()  # T: the newest forward's block tables
        self._busy: set[int] | None = set()  # blocks of T and of copy_block since M; None: not built from T yet
        self._copies_unjoined = False  # copies issued that the compute stream does not wait for yet
        self.num_copy_stream_tail_waits = 0  # batches that had to wait for the forward in flight (see docstring)
        self._batch = CopyBatch()  # offloads and onboards not issued yet (CUDA with a tier only)
        self._max_batch_blocks = max_batch_blocks
        self._landed: torch.Tensor | None = None  # the batch's onboards, staged on the device (row per onboard)
        self.num_batches = 0  # batches issued, for the benchmarks' counts
        self._slot_written = {}  # host slot -> the number of the issued batch whose offload last wrote it
        self._upload_waited = 0  # the upload stream waits for the copy stream's batches up to this number

    @property
    def scratch_block_ids(self) -> range:
        """Block ids no request ever holds (see the module docstring)."""
        return range(self.num_blocks, self.num_blocks + self.num_scratch_blocks)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in the pools, over every layer (this rank's heads)."""
        return self.pools[:, :, 0, 0].numel() * self.pools.element_size()  # 2 * layers * heads * head_dim

    @staticmethod
    def bytes_per_block(num_layers: int, block_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
        tokens_per_block, num_kv_heads, head_dim = block_shape
        return 2 * num_layers * tokens_per_block * num_kv_heads * head_dim * dtype.itemsize

    # ---- moving blocks -----------------------------------------------------------------
    def copy_block(self, src_block_id: int, dst_block_id: int) -> None:
        """Copy a block's K/V on the compute stream (after every copy of the tier issued so far)."""
        if self._copy_stream is not None:
            self._issue_batch()
            self._join_copies(torch.cuda.current_stream(self.device))
            self._busy_blocks().update((src_block_id, dst_block_id))
        self._pools[:, :, dst_block_id].copy_(self._pools[:, :, src_block_id])

    def offload(self, block_id: int, host_id: int) -> None:
        """Copy device block ``block_id`` into host slot ``host_id`` (on CUDA: in the next batch)."""
        if self._copy_stream is None:
            self._host[host_id].copy_(self._pools[:, :, block_id])
            return
        if self._batch.conflicts(offload=(block_id, host_id)):
            self._issue_batch()
        self._batch.add_offload(block_id, host_id)
        self._maybe_issue()

    def onboard(self, host_id: int, block_id: int) -> None:
        """Copy host slot ``host_id`` into device block ``block_id`` (on CUDA: its transfer into the
        batch's staging buffer now, the write into the block when the batch is issued)."""
        if self._copy_stream is None:
            self._pools[:, :, block_id].copy_(self._host[host_id])
            return
        if self._batch.conflicts(onboard=(host_id, block_id)):
            self._issue_batch()
        upload = self._upload_stream
        if self._slot_written.get(host_id, 0) > self._upload_waited:
            upload.wait_event(self._issued)  # the slot's offload, issued in a recent batch, lands first
            self._upload_waited = self.num_batches
        with torch.cuda.stream(upload):  # reads the tier only: no wait on the compute stream
            if self._landed is None:
                shape = (self._max_batch_blocks, *self._host.shape[1:])
                self._landed = torch.empty(shape, dtype=self._host.dtype, device=self.device)
            row = self._batch.add_onboard(host_id, block_id)
            self._landed[row].copy_(self._host[host_id], non_blocking=True)
        self._maybe_issue()

    def _maybe_issue(self) -> None:
        # Issue full batches at once, so the copies run while the host goes on allocating.
        if len(self._batch) >= self._max_batch_blocks:
            self._issue_batch()

    def _issue_batch(self) -> None:
        """Enqueue the pending copies on the copy stream: offloads, then onboards (``kv_copy_batch``)."""
        batch, landed = self._batch, self._landed
        if not len(batch):
            return
        self._batch, self._landed = CopyBatch(), None
        self.num_batches += 1
        by_block = self._pools.movedim(2, 0)  # (rows, 2, num_layers, ...): a block's pieces at one index
        with self._on_copy_stream(batch.blocks()) as copy:
            if batch.onboards:
                # The staged transfers come first: the scatter reads them, and an offload below
                # may write a slot one of them reads.
                self._uploaded.record(self._upload_stream)
                copy.wait_event(self._uploaded)
                landed.record_stream(copy)  # the upload stream's memory, read here
            if batch.offloads:
                blocks, host_ids = zip(*batch.offloads)
                gathered = by_block[self._index(blocks)]  # one gather kernel: (n, 2, num_layers, ...)
                for i, first, n in runs(list(host_ids)):
                    self._host[first:first + n].copy_(gathered[i:i + n], non_blocking=True)
                for host_id in host_ids:
                    self._slot_written[host_id] = self.num_batches
            if batch.onboards:
                blocks = [block_id for _, block_id in batch.onboards]
                by_block[self._index(blocks)] = landed[:len(blocks)]  # one scatter kernel
            self._issued.record(copy)

    def _index(self, block_ids) -> torch.Tensor:
        """Block ids on the device, through pinned memory (a pageable copy would wait for the device)."""
        return torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)

    # ---- ordering with the compute stream ---------------------------------------------
    def before_compute(self, block_tables: Sequence[Sequence[int]] | None = None) -> None:
        """Work that touches the pools is about to be enqueued on the current (compute) stream:
        make it wait for every copy of the tier issued so far (on the device; the host does not
        wait). ``block_tables``: the blocks a forward reads and writes (its requests' tables;
        the list is kept, not copied, until the next call); None: any block, for the rest of
        the compute stream's work until the next forward (then the next copy waits for all of it).
        A no-op on the CPU or without a host tier."""
        if self._copy_stream is None:
            return
        self._issue_batch()
        compute = torch.cuda.current_stream(self.device)
        self._join_copies(compute)
        if block_tables is None:
            self._any_busy = True
            return
        self._mark.record(compute)
        self._mark_waited = False
        self._any_busy = False
        self._busy_tables, self._busy = block_tables, None

    def flush(self) -> None:
        """Issue the pending offloads and onboards now, on the copy stream, rather than at the next
        forward's :meth:`before_compute` (which would then wait for all of them). The host does
        not wait; a no-op on the CPU or without a host tier."""
        if self._copy_stream is not None:
            self._issue_batch()

    def synchronize(self) -> None:
        """Wait on the host for every copy of the tier issued so far (tests; the step path never does)."""
        if self._copy_stream is not None:
            self._issue_batch()
            self._copy_stream.synchronize()

    def _join_copies(self, compute: torch.cuda.Stream) -> None:
        if self._copies_unjoined:
            self._copied.record(self._copy_stream)
            compute.wait_event(self._copied)
            self._copies_unjoined = False

    def _busy_blocks(self) -> set[int]:
        if self._busy is None:
            self._busy = set(itertools.chain.from_iterable(self._busy_tables))
            self._busy_tables = ()
        return self._busy

    def _on_copy_stream(self, block_ids: set[int]) -> contextlib.AbstractContextManager[torch.cuda.Stream]:
        """Order the copy stream after the compute work that may touch ``block_ids``; enter it."""
        copy = self._copy_stream
        if self._any_busy or not block_ids.isdisjoint(self._busy_blocks()):
            self._tail.record(torch.cuda.current_stream(self.device))
            copy.wait_event(self._tail)  # covers M and everything since: nothing is left to wait for
            self._any_busy, self._mark_waited = False, True
            self._busy_tables, self._busy = (), set()
            self.num_copy_stream_tail_waits += 1
        elif not self._mark_waited:
            copy.wait_event(self._mark)
            self._mark_waited = True
        self._copies_unjoined = True
        return _entered(copy)


@contextlib.contextmanager
def _entered(stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:
    """``torch.cuda.stream(stream)``, yielding the stream."""
    with torch.cuda.stream(stream):
        yield stream
