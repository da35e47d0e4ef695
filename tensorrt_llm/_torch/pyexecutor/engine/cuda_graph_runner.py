"""Decode steps replayed from CUDA graphs, one graph per (padded) batch size.

A decode step of a 12B model is some 1,800 small kernels; launched one by one from Python they
take longer than the GPU needs to run them at small batches. A graph launches them all at once.
A graph replays fixed addresses and shapes, so each batch size gets static buffers::

    ids, positions, slots   (B,) int64      the step's token, its position, its KV slot
    seq_lens                (B,) int32      positions attended (cached + 1)
    tables                  (B, W) int32    block tables; W covers the longest sequence allowed
    rows                    (B,) int64      0..B-1, constant
    -> logits (B, vocab), tokens (B,) int64 (the argmax, on the device: a plain greedy step's picks)

When the step's rows need the sampling pass (``engine.sampling_pass``: a row that draws,
penalties, a grammar mask, logprobs), a second graph replays after it, captured per batch size and
:class:`~.sampling_columns.PassPlan` (bucketed): it reads the decode graph's logits and a few more
static buffers, filled like the ids::

    floats                  (3, B) float64      temperature, top_p, min_p
    longs                   (5, B) int64        greedy, top_k, block key, token key, logprobs
    top_p_rows              (B,) int64          rows with top-p (a plan reads its first P)
    processed               (B, vocab)          the logits after penalties, min_tokens, grammar masks
                                                (written eagerly before the replay: their shapes vary)
    -> tokens (B,) int64, and (plans with logprobs) the chosen id's, the top ids and theirs

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
from typing import Callable, Iterator
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.paged import DecodeBatch, PagedAttentionPlan, decode_num_splits, num_sms
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import PassPlan, SamplingColumns
from tensorrt_llm._torch.pyexecutor.engine.sampling_pass import (
    PassResult,
    device_columns,
    process_logits,
    sample_rows,
    working_dtype,
)
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

logger = logging.getLogger(__name__)

#: Writes over a decode step's ids, positions, KV slots (each (B,) int64) and attended lengths
#: ((B,) int32) once they are copied in, on the device.
Patch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


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


@dataclass(slots=True)
class _SamplingInputs:
    """The static columns every sampling graph of one batch size reads (:func:`sampling_inputs_of`)."""

    floats: torch.Tensor  # (3, B) float64
    longs: torch.Tensor  # (5, B) int64
    top_p_rows: torch.Tensor  # (B,) int64: a plan with P top-p rows reads the first P
    processed: torch.Tensor | None = None  # (B, vocab), the working dtype; made when a plan first processes


def sampling_inputs_of(columns: SamplingColumns, plan: PassPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host arrays a sampling graph's static buffers take for ``columns`` (laid out over the
    graph's rows: ``SamplingColumns.at_rows``) under the bucketed ``plan``: floats, longs, and the
    top-p rows padded to the plan's count by repeating the last one (the same row twice computes
    the same threshold twice)."""
    rows = columns.top_p_rows
    if plan.top_p_rows > len(rows):
        rows = np.concatenate((rows, np.repeat(rows[-1:], plan.top_p_rows - len(rows))))
    return columns.floats, columns.longs, rows


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
        self._sampling_inputs: dict[int, _SamplingInputs] = {}
        self._sampling_graphs: dict[tuple[int, PassPlan], tuple[torch.cuda.CUDAGraph, PassResult]] = {}
        self._eager_plans: set[tuple[int, PassPlan]] = set()  # plans whose capture failed: run eagerly
        self._pool = None
        self.num_replays = 0
        self.num_sampling_replays = 0

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

    def replay(self, step: "_Step", patch: Patch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step in and replay (capturing the size first if needed); returns device views
        (logits (n, vocab), tokens (n,)) valid until the next replay of that size. ``patch``: what
        writes over the step's ids, positions, KV slots and attended lengths once they are copied
        in (overlap: tokens still in flight, drafts proposed on the device, rows moved back over
        rejected drafts; ``engine.in_flight``), every row its own decode sequence. Called inside
        the staging's ``step()``."""
        g = self._graphs.get(step.size) or self._capture(step.size)
        used = step.tables.shape[1]
        staging = self.staging
        staging.copy_to(g.longs, step.longs)
        staging.copy_to(g.seq_lens, step.seq_lens)
        staging.copy_to(g.tables[:, :used], step.tables)  # a strided destination: torch goes through a device buffer
        if patch is not None:
            patch(g.longs[0], g.longs[1], g.longs[2], g.seq_lens)
        g.graph.replay()
        self.num_replays += 1
        return g.logits[: step.num_requests], g.tokens[: step.num_requests]

    def sample(self, step: "_Step", columns: SamplingColumns) -> PassResult:
        """After :meth:`replay` of ``step``: the sampling pass over its graph's rows (``columns``
        laid out over them, ``SamplingColumns.at_rows``), from the graph of its size and bucketed
        plan (captured first if needed). Returns static views over the ``B`` rows, valid until the
        next sampling replay of that size. Penalties, ``min_tokens`` and grammar masks are applied
        eagerly first, into the size's processed buffer (their shapes change every step); a
        penalized row's in-flight token is read from the graph's ids, where ``replay`` filled it.
        Called inside the staging's ``step()``."""
        g = self._graphs[step.size]
        vocab = g.logits.shape[1]
        plan = columns.plan.bucketed(vocab, step.size)
        inputs = self._sampling_inputs.get(step.size)
        if inputs is None:
            inputs = self._sampling_inputs[step.size] = _SamplingInputs(
                torch.empty((3, step.size), dtype=torch.float64, device=self.device),
                torch.empty((5, step.size), dtype=torch.int64, device=self.device),
                torch.zeros(step.size, dtype=torch.int64, device=self.device),
            )
        floats, longs, top_p_rows = sampling_inputs_of(columns, plan)
        staging = self.staging
        staging.copy_to(inputs.floats, floats)
        staging.copy_to(inputs.longs, longs)
        if plan.top_p_rows:
            staging.copy_to(inputs.top_p_rows[: plan.top_p_rows], top_p_rows)
        if plan.processed:
            if inputs.processed is None:
                inputs.processed = torch.empty(g.logits.shape, dtype=working_dtype(g.logits.dtype), device=self.device)
            inputs.processed.copy_(g.logits)
            process_logits(inputs.processed, columns, staging.to_device, g.longs[0])
        key = (step.size, plan)
        captured = self._sampling_graphs.get(key)
        if captured is None and key not in self._eager_plans:
            try:
                captured = self._capture_sampling(step.size, plan)
            except RuntimeError:  # a kernel that cannot be captured: this plan runs eagerly, the step still samples
                logger.exception("could not capture the sampling graph of batch size %d, %s: it runs eagerly", *key)
                self._eager_plans.add(key)
        if captured is None:
            return self._sampling_pass(step.size, plan)
        captured[0].replay()
        self.num_sampling_replays += 1
        return captured[1]

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

    def _sampling_pass(self, size: int, plan: PassPlan) -> PassResult:
        """The sampling pass of ``plan`` over the decode graph of ``size``'s logits and the size's
        static columns: what its sampling graph captures (run eagerly, it is the same ops)."""
        g = self._graphs[size]
        inputs = self._sampling_inputs[size]
        columns = device_columns(inputs.floats, inputs.longs, inputs.top_p_rows[: plan.top_p_rows],
                                 working_dtype(g.logits.dtype))
        return sample_rows(g.logits, columns, plan, processed=inputs.processed if plan.processed else None)

    def _capture_sampling(self, size: int, plan: PassPlan) -> tuple[torch.cuda.CUDAGraph, PassResult]:
        """Capture :meth:`_sampling_pass` (warmed up on a side stream first, as the decode graphs are)."""

        def run() -> PassResult:
            return self._sampling_pass(size, plan)

        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                result = run()
        self._sampling_graphs[(size, plan)] = graph, result
        logger.info("captured a sampling graph for decode batch size %d, %s", size, plan)
        return graph, result

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
