"""Decode steps replayed from CUDA graphs, one graph per (padded) batch size.

A decode step of a 12B model is some 1,800 small kernels; launched one by one from Python they
take longer than the GPU needs to run them at small batches. A graph launches them all at once.
A graph replays fixed addresses and shapes, so each batch size gets static buffers::

    ids, positions, slots   (B,) int64      the step's token, its position, its KV slot
    seq_lens                (B,) int32      positions attended (cached + 1)
    tables                  (B, W) int32    block tables; W covers the longest sequence allowed
    rows                    (B,) int64      0..B-1, constant
    -> logits (B, vocab), tokens (B,) int64 (greedy pick, on the device)

A verification step (drafts) is a decode batch too: each of its positions is a row of its own
over the request's block table (``ForwardInputs.attention_batch``), so it replays the graph of its
row count. Each step copies its values in (three small host-to-device copies, through the engine's
persistent pinned buffers, ``attention_backend.staging``; of the tables only the columns in
use: stale columns past a sequence's length are never read) and replays. A batch of ``n <
B`` requests is padded: rows ``n..B-1`` decode token 0 at position 0 into the storage's scratch
block, which no request holds, so padding never touches real KV; their outputs are dropped.
The attention plan's split count depends on ``B`` only, so the graph is valid for any lengths.

Graphs are captured by :meth:`CudaGraphRunner.capture_all` (the engine's warm-up) or the first
time a size is needed, each after a warm-up run on a side stream (Triton compiles, cuBLAS
chooses its kernels); all graphs share one memory pool.

No Python garbage is collected while a graph is being captured (:func:`garbage_collection_paused`).
torch stopped collecting before a capture (2.9), and a collection that fires inside one finalises
whatever unreachable CUDA objects it finds: another executor's graphs (``cudaGraphExecDestroy``),
a Triton kernel's module, a CUDA event. Those calls are not permitted while a stream captures, and
the capture fails at its end with ``cudaErrorStreamCaptureInvalidated`` ("operation not permitted
when stream is capturing"). Which capture a collection lands in depends on what the process
allocated before, not on the graph: on the H200 it was the size-24 verification graph of a test
that had built and dropped four executors before it.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from typing import Iterator
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.paged import DecodeBatch, PagedAttentionPlan, decode_num_splits, num_sms
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.speculative.device_verification import move_back_

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Collect the garbage now, then collect none until the block ends (a graph capture: module
    docstring); the collector's state before is restored. Inside another such block (captures in
    a row) it does nothing: nothing was collected since."""
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.collect()  # unreachable graphs and kernels are finalised here, before the capture begins
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class _Step:
    """One decode step's values for the static buffers, padded to ``size`` rows."""

    size: int
    num_requests: int
    longs: np.ndarray  # (3, size) int64
    seq_lens: np.ndarray  # (size,) int32
    tables: np.ndarray  # (size, used columns) int32


@dataclass(slots=True)
class _DecodeGraph:
    """Static buffers, plan and outputs of the graph of one batch size."""

    size: int
    longs: torch.Tensor  # (3, B) int64: ids, positions, slots
    seq_lens: torch.Tensor  # (B,) int32
    tables: torch.Tensor  # (B, W) int32
    plan: PagedAttentionPlan
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # (B, vocab)
    tokens: torch.Tensor | None = None  # (B,) int64


class CudaGraphRunner:
    """Runs decode batches (every request computes one token) from captured graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVCacheStorage,
        *,
        tokens_per_block: int,
        batch_sizes: Sequence[int],
        enable_padding: bool,
        max_seq_len: int,
        staging: PinnedStaging,
    ) -> None:
        if not storage.num_scratch_blocks:
            raise ValueError("CUDA graphs need a scratch block in the KV storage for padding rows")
        self.model = model
        self.storage = storage
        self.tokens_per_block = tokens_per_block
        self.batch_sizes = sorted(batch_sizes)
        self.enable_padding = enable_padding
        self.max_blocks = -(-max_seq_len // tokens_per_block)
        self.scratch_block = storage.scratch_block_ids[0]
        self.device = model.device
        self.staging = staging  # the engine's pinned buffers: replay() runs inside its step()
        self._graphs: dict[int, _DecodeGraph] = {}
        self._pool = None
        self.num_replays = 0

    @property
    def captured_sizes(self) -> list[int]:
        """The batch sizes whose graph is captured, ascending."""
        return sorted(self._graphs)

    # ---- which forwards a graph serves ---------------------------------------------------
    def graph_size(self, num_new_tokens: Sequence[int], num_cached_tokens: Sequence[int]) -> int | None:
        """The captured size that serves this forward, or None when it must run eagerly."""
        n = len(num_new_tokens)
        if n == 0 or n > self.batch_sizes[-1] or any(k != 1 for k in num_new_tokens):
            return None
        if max(num_cached_tokens) + 1 > self.max_blocks * self.tokens_per_block:
            return None
        i = bisect.bisect_left(self.batch_sizes, n)
        size = self.batch_sizes[i]
        if size != n and not self.enable_padding:
            return None
        return size

    # ---- replay ----------------------------------------------------------------------------
    def prepare(
        self, size: int, input_ids: Sequence[int], num_cached_tokens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> "_Step":
        """The host side of a replay: this step's values for the static buffers of ``size``."""
        n = len(input_ids)
        tpb = self.tokens_per_block
        cached = np.asarray(num_cached_tokens, dtype=np.int64)
        used = int(cached.max()) // tpb + 1  # table columns any sequence reads
        longs = np.zeros((3, size), dtype=np.int64)
        longs[0, :n] = input_ids
        longs[1, :n] = cached
        seq_lens = np.ones(size, dtype=np.int32)
        seq_lens[:n] = cached + 1
        tables = np.zeros((size, used), dtype=np.int32)
        tables[n:, 0] = self.scratch_block
        for i, table in enumerate(block_tables):
            tables[i, : min(used, len(table))] = table[:used]
        longs[2, :n] = tables[np.arange(n), cached // tpb].astype(np.int64) * tpb + cached % tpb
        longs[2, n:] = self.scratch_block * tpb
        return _Step(size, n, longs, seq_lens, tables)

    def replay(self, step: "_Step", fill: tuple[torch.Tensor, torch.Tensor] | None = None, moves=None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step in and replay (capturing the size first if needed); returns device views
        (logits (n, vocab), tokens (n,)) valid until the next replay of that size. ``fill``:
        (rows, tokens) on the device written over the step's ids (overlap: tokens still in flight).
        ``moves``: rows to move back over drafts the previous forward rejected (``rows``, ``back``;
        ``speculative.device_verification.move_back_``; every row here is its own decode sequence).
        Called inside the staging's ``step()``."""
        g = self._graphs.get(step.size) or self._capture(step.size)
        used = step.tables.shape[1]
        staging = self.staging
        staging.copy_to(g.longs, step.longs)
        if fill is not None:
            g.longs[0].index_copy_(0, *fill)
        staging.copy_to(g.seq_lens, step.seq_lens)
        staging.copy_to(g.tables[:, :used], step.tables)  # a strided destination: torch goes through a device buffer
        if moves is not None:
            move_back_(g.longs[1], g.longs[2], g.seq_lens, g.tables, moves.rows, moves.rows, moves.back,
                       self.tokens_per_block)
        g.graph.replay()
        self.num_replays += 1
        return g.logits[: step.num_requests], g.tokens[: step.num_requests]

    # ---- capture ---------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every size now (largest first, so smaller graphs reuse its pool memory)."""
        with garbage_collection_paused():  # one collection for all of them
            for size in reversed(self.batch_sizes):
                if size not in self._graphs:
                    self._capture(size)

    def _forward(self, g: _DecodeGraph) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.forward_with_plan(
            g.longs[0], g.longs[1], g.plan, self.storage.k_cache, self.storage.v_cache
        )  # (B, hidden)
        logits = self.model.compute_logits(hidden)  # (B, vocab)
        return logits, logits.argmax(dim=-1)

    def _capture(self, size: int) -> _DecodeGraph:
        device, tpb = self.device, self.tokens_per_block
        longs = torch.zeros((3, size), dtype=torch.int64, device=device)
        longs[2] = self.scratch_block * tpb  # every row padding until a step writes it
        seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        tables = torch.full((size, self.max_blocks), self.scratch_block, dtype=torch.int32, device=device)
        splits = decode_num_splits(size, self.model.config.num_kv_heads, num_sms(device))
        rows = torch.arange(size, dtype=torch.int64, device=device)
        plan = PagedAttentionPlan(tpb, size, longs[2], None, DecodeBatch(rows, tables, seq_lens, splits),
                                  self.storage.kv_scales)
        g = _DecodeGraph(size, longs, seq_lens, tables, plan)
        with torch.inference_mode():
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(g)
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with garbage_collection_paused(), torch.cuda.graph(graph, pool=self._pool):
                g.logits, g.tokens = self._forward(g)
        g.graph = graph
        self._graphs[size] = g
        logger.info("captured a CUDA graph for decode batch size %d (%d flash-decoding splits)", size, splits)
        return g
