"""The CUDA engine's launch logic on CPU tensors, for tests without a GPU.

:class:`CudaLogicOnCpu` is ``CudaTorchModelEngine`` with the CPU's reference attention (the paged
backend's plans on CPU tensors) and no graphs: ``launch`` and everything it calls run as on a GPU
(the in-flight inputs, the drafts proposed from the token histories, the move-back, the device
verification, the picks copied back), through the real ``PinnedStaging``. What a CPU lacks is
stood in for by :func:`cuda_stand_ins`: CUDA events on one ordered "stream" (an event has passed
once an event recorded after it was waited for, as a stream orders them), the current stream,
and page-locked buffers. So the staging's own count of host waits (``num_waits``: a buffer reused
while the launch that used it may still be running) means here what it means on a GPU.

``fused=True`` drafts with the n-gram Triton kernel (``speculative.triton_drafting``), which runs
on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensorrt_llm._torch.attention_backend import staging as staging_module
from tensorrt_llm._torch.attention_backend.paged import PagedPlanBuilder
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.pyexecutor.engine.in_flight import Drafting
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import CudaTorchModelEngine
from tensorrt_llm._torch.speculative.device_drafting import TokenHistories

__all__ = ["CudaLogicOnCpu", "LaunchRecord", "Served", "StandInEvent", "cuda_stand_ins", "ops_over_plain",
           "recording_executor", "serve"]

_order = itertools.count(1)


class StandInEvent:
    """A CUDA event on the one stream of a CPU run: ``record`` marks the stream's position, an
    event has passed (``query``) once the host waited (``synchronize``) for it or a later one."""

    passed_up_to = 0  # the latest position the host waited for

    def __init__(self, *args, **kwargs) -> None:
        self.position = 0  # never recorded: passed

    def record(self, stream=None) -> None:
        self.position = next(_order)

    def query(self) -> bool:
        return self.position <= StandInEvent.passed_up_to

    def synchronize(self) -> None:
        StandInEvent.passed_up_to = max(StandInEvent.passed_up_to, self.position)

    def elapsed_time(self, other: "StandInEvent") -> float:
        return 0.0


@contextlib.contextmanager
def cuda_stand_ins() -> Iterator[None]:
    """CUDA events, the current stream and pinned buffers stood in for on the CPU (module docstring)."""
    saved = torch.cuda.Event, torch.cuda.current_stream, staging_module._pinned

    def pinned(nbytes: int):
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        return buffer, buffer.numpy()

    torch.cuda.Event, torch.cuda.current_stream, staging_module._pinned = StandInEvent, lambda device=None: None, pinned
    try:
        yield
    finally:
        torch.cuda.Event, torch.cuda.current_stream, staging_module._pinned = saved


class CudaLogicOnCpu(CudaTorchModelEngine):
    """``CudaTorchModelEngine.launch`` and everything it calls, over CPU tensors (module
    docstring); build and run it inside :func:`cuda_stand_ins`."""

    fused = False  # draft with the n-gram Triton kernel (interpreted) instead of the proposer's torch form

    def _prepare_device(self, cuda_graph_config, max_batch_size, max_seq_len) -> None:
        self._device_picks = None
        self._staging = PinnedStaging(self.device, capacity=1 << 16)
        kv = self.kv_cache_manager
        self._plans = PagedPlanBuilder(self.device, tokens_per_block=kv.tokens_per_block, num_blocks=kv.num_blocks,
                                       num_kv_heads=self.model.num_local_kv_heads, staging=self._staging)
        self._drafting = None
        if self.draft_proposer is not None:
            histories = TokenHistories(self.device, (max_seq_len or 256) + self.max_draft_len + 2, rows=2)
            ngram = self.draft_proposer.max_matching_ngram_size if self.fused else None
            self._drafting = Drafting(histories, self.draft_proposer, ngram)


# ---------------------------------------------------------------------------------------- serving


_SYNCS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_consecutive"}


@dataclass
class LaunchRecord:
    """What one ``launch`` asked of the device: ``ops`` (aten ops that are not views: kernels on a
    GPU; the model's forward counts as one, as a decode graph's replay does there, and so does the
    fused in-flight kernel), ``uploads`` (host arrays shipped through the staging), ``syncs`` (ops
    that read a device value on the host: ``item``, ``nonzero``, ...), ``requests`` (the batch's),
    ``histories_grew`` (the device token histories doubled their rows: two ops more, once in a while)."""

    engine_drafts: int
    ops: int
    uploads: int
    syncs: int
    requests: int = 0
    histories_grew: bool = False


@dataclass
class Served:
    outputs: list[list[int]]
    verified: int  # draft tokens verified
    accepted: int
    launches: list[LaunchRecord] = field(default_factory=list)
    staging_waits: int = 0  # launches whose staging buffer was still in use (the host waited)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            name = str(func.overloadpacket)
            self.syncs += name in _SYNCS
            self.ops += name not in ("aten.lift_fresh", "aten.detach")
        return func(*args, **(kwargs or {}))


class _Recording(CudaLogicOnCpu):
    """:class:`CudaLogicOnCpu` that records a :class:`LaunchRecord` per launch."""

    records: list[LaunchRecord]

    def _prepare_device(self, cuda_graph_config, max_batch_size, max_seq_len) -> None:
        super()._prepare_device(cuda_graph_config, max_batch_size, max_seq_len)
        self.records = []
        self._uploads = 0
        staging = self._staging
        to_device, copy_to = staging.to_device, staging.copy_to

        def counted_to_device(array):
            self._uploads += 1
            return to_device(array)

        def counted_copy_to(dst, array):
            self._uploads += 1
            copy_to(dst, array)

        staging.to_device, staging.copy_to = counted_to_device, counted_copy_to

    def launch(self, inputs):
        self._uploads = 0
        counter = _Counter()
        kernel = _kernel_counted_once(counter) if self.fused else contextlib.nullcontext()
        rows = self._drafting.histories.tokens.shape[0] if self._drafting is not None else 0
        with counter, kernel, _counted_once(self.model, "forward_with_plan", counter):
            pending = super().launch(inputs)
        grew = self._drafting is not None and self._drafting.histories.tokens.shape[0] != rows
        self.records.append(LaunchRecord(len(inputs.engine_drafts), counter.ops, self._uploads, counter.syncs,
                                         len(inputs.requests), grew))
        return pending


@contextlib.contextmanager
def _counted_once(owner, name: str, counter: _Counter) -> Iterator[None]:
    """``owner.name(...)`` as one op while the block runs (what it runs inside is not counted)."""
    method = getattr(owner, name)

    def once(*args, **kwargs):
        counter.ops += 1
        counter.paused = True
        try:
            return method(*args, **kwargs)
        finally:
            counter.paused = False

    setattr(owner, name, once)  # an instance attribute over the method, for this launch only
    try:
        yield
    finally:
        delattr(owner, name)


@contextlib.contextmanager
def _kernel_counted_once(counter: _Counter) -> Iterator[None]:
    """The fused in-flight kernel as one op (interpreted, it runs as many torch and numpy ops)."""
    from tensorrt_llm._torch.speculative import triton_drafting

    kernel = triton_drafting._in_flight_kernel

    class Once:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                counter.ops += 1
                counter.paused = True
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    counter.paused = False
            return run

    triton_drafting._in_flight_kernel = Once()
    try:
        yield
    finally:
        triton_drafting._in_flight_kernel = kernel


def ops_over_plain(drafted: list[LaunchRecord], plain: list[LaunchRecord]) -> list[int]:
    """For each drafting launch of ``drafted`` (histories not grown), its device ops over the most
    a launch of ``plain`` (speculation off, overlap on) with inputs in flight ran at the same batch
    size (batch sizes plain never ran in flight are left out)."""
    most: dict[int, int] = {}
    for launch in plain:
        if launch.uploads == 3:  # ids, positions, the in-flight array: a decode step in flight
            most[launch.requests] = max(most.get(launch.requests, 0), launch.ops)
    return [launch.ops - most[launch.requests] for launch in drafted
            if launch.engine_drafts and not launch.histories_grew and launch.requests in most]


def recording_executor(model, config, *, fused: bool = False):
    """An executor over :class:`CudaLogicOnCpu` for ``config`` whose engine records a
    :class:`LaunchRecord` per launch (``executor.model_engine.records``); build and run it
    inside :func:`cuda_stand_ins`."""
    from tensorrt_llm._torch.pyexecutor import py_executor_creator

    saved = py_executor_creator.TorchModelEngine
    py_executor_creator.TorchModelEngine = type("Fused" if fused else "Torch", (_Recording,), {"fused": fused})
    try:
        return py_executor_creator.create_py_executor(config, model=model)
    finally:
        py_executor_creator.TorchModelEngine = saved


def serve(model, prompts: list[list[int]], spec, *, overlap: bool, on_cpu_logic: bool, fused: bool = False,
          max_new_tokens: int = 40) -> Served:
    """Serve ``prompts`` greedily with ``model`` (speculative decoding with ``spec``, None: off):
    with ``on_cpu_logic`` through :class:`CudaLogicOnCpu` (``fused``: the Triton kernel drafts),
    else through the CPU engine."""
    from tensorrt_llm._torch.pyexecutor import py_executor_creator
    from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

    config = ExecutorConfig(max_num_tokens=96, max_seq_len=256, max_batch_size=8, speculative_config=spec,
                            disable_overlap_scheduler=not overlap,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=512))
    with cuda_stand_ins() if on_cpu_logic else contextlib.nullcontext():
        if on_cpu_logic:
            executor = recording_executor(model, config, fused=fused)
        else:
            executor = py_executor_creator.create_py_executor(config, model=model)
        assert executor.overlap == overlap
        requests = [LlmRequest(input_token_ids=p, max_new_tokens=max_new_tokens) for p in prompts]
        for request in requests:
            executor.enqueue_request(request)
        executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    stats = executor.iteration_stats
    served = Served([r.output_token_ids for r in requests], sum(s.num_draft_tokens for s in stats),
                    sum(s.num_accepted_draft_tokens for s in stats))
    engine = executor.model_engine
    if on_cpu_logic:
        served.launches = engine.records
        served.staging_waits = engine._staging.num_waits
    return served
