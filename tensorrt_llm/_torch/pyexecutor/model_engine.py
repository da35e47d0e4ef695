"""``TorchModelEngine``: a real torch model over the KV manager's paged tensors, one class per device.

The engine interface (``ModelEngine``, ``PendingForward``, ``ForwardOutput``) is in
:mod:`.engine`, the input preparation (``TpInputs``, ``_prepare_tp_inputs``) in
:mod:`.engine_inputs`; both import no torch. Here, the device is chosen once, at
construction: ``TorchModelEngine(model, ...)`` makes a :class:`CpuTorchModelEngine` or a
:class:`CudaTorchModelEngine` after the model's device (as ``pathlib.Path`` makes a
``PosixPath``), so no step runs an ``if device.type`` branch. Each makes the attention plan
builder of its device at construction (``attention_backend``) and checks its inputs on the host;
the model's forward then runs unchecked (``LlamaForCausalLM.forward_with_plan``)::

    CpuTorchModelEngine    a forward runs to completion at launch (ReadyForward);
                           plans from a CpuPlanBuilder
    CudaTorchModelEngine   a forward is enqueued on the GPU and returns (CudaForward);
                           plans from a PagedPlanBuilder through the pinned staging buffers;
                           decode batches replay CUDA graphs; overlap on by default
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.cpu_paged import CpuPlanBuilder
from tensorrt_llm._torch.attention_backend.paged import PagedAttentionPlan, PagedPlanBuilder
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CudaGraphRunner
from tensorrt_llm._torch.pyexecutor.piecewise_cuda_graph import PiecewiseGraphRunner
from tensorrt_llm._torch.pyexecutor.engine import ForwardOutput, ModelEngine, PendingForward, ReadyForward
from tensorrt_llm._torch.pyexecutor.engine_inputs import (
    PAD_TOKEN_ID,
    BeamSpan,
    DraftSpan,
    TpInputs,
    draft_targets,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager

# Upstream's names, where an engineer looks for them.
__all__ = [
    "PAD_TOKEN_ID", "CpuTorchModelEngine", "CudaForward", "CudaTorchModelEngine", "ForwardOutput", "ModelEngine",
    "PendingForward", "TorchModelEngine", "TpInputs",
]


class TorchModelEngine(ModelEngine):
    """Runs a real torch model over the paged KV tensors of the KV manager.

    The model and the KV pools live on one device; constructing a ``TorchModelEngine`` makes
    the subclass for that device (see the module docstring).

    ``time_forwards``: on CUDA, each forward also carries the device time of its forward (from
    its first kernel, after the host has prepared the inputs, to the greedy pick): what a cost
    model predicts, without the host's share of the iteration.
    """

    time_forwards: bool = False
    picks_tokens = True  # the greedy pick of every sampling row, made on the model's device
    # Drafts run as extra positions of their request (causal over its cache, like a chunk); the
    # greedy pick at each draft row comes back in ForwardOutput.draft_targets.
    supports_draft_tokens = True
    # Beams run as sequences of their own to attention, one row each, over their own block
    # tables (TpInputs.attention_batch); their rows come back in ForwardOutput.beam_logits.
    max_beam_width = 64

    def __new__(cls, model: LlamaForCausalLM, *args, **kwargs) -> "TorchModelEngine":
        if cls is TorchModelEngine:
            cls = CudaTorchModelEngine if model.device.type == "cuda" else CpuTorchModelEngine
        return super().__new__(cls)

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_num_tokens: int,
        kv_cache_manager: KVCacheManager,
        *,
        cuda_graph_config: CudaGraphConfig | None = None,
        max_batch_size: int = 0,
        max_seq_len: int | None = None,
    ) -> None:
        super().__init__(max_num_tokens, kv_cache_manager)
        storage = kv_cache_manager.storage
        if storage is None:
            raise ValueError("TorchModelEngine needs a KV cache manager with tensor storage")
        self.model = model.eval()
        self.device = model.device
        if storage.device != self.device:
            raise ValueError(f"the KV pools are on {storage.device}, the model on {self.device}")
        model.check_kv_pools(storage.k_cache, storage.v_cache, kv_cache_manager.tokens_per_block)  # once: forwards do not
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        self._prepare_device(cuda_graph_config, max_batch_size, max_seq_len)

    @abc.abstractmethod
    def _prepare_device(self, cuda_graph_config: CudaGraphConfig | None, max_batch_size: int, max_seq_len: int | None) -> None:
        """What the device needs before the first forward (its attention plan builder first)."""

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _check(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """Check a forward's int64 ids and positions on the host: the model's forward does not
        (on a device it would have to read them back). Raises ValueError, before anything runs,
        for ids outside the vocabulary or positions past the model's."""
        config = self.model.config
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {config.vocab_size})")
        if positions.size and (positions.min() < 0 or positions.max() >= config.max_position_embeddings):
            raise ValueError(f"position_ids must lie in [0, {config.max_position_embeddings})")

    def warmup(self) -> None:
        """Capture the decode graphs of every batch size and the piecewise graphs of every token
        count now rather than at first use (also compiles the decode kernel for every split
        count). Nothing to do on the CPU."""
        if self.graph_runner is not None:
            self.graph_runner.capture_all()
        if self.piecewise_runner is not None:
            self.piecewise_runner.capture_all()

    @abc.abstractmethod
    def launch(self, inputs: TpInputs) -> PendingForward:
        """Start one forward over ``inputs`` and return at once (on the CPU it has run)."""


class CpuTorchModelEngine(TorchModelEngine):
    """On the CPU: each forward runs to completion at launch, in order with the KV manager's
    block copies, and still delivers its tokens one iteration later under overlap."""

    def _prepare_device(self, cuda_graph_config: CudaGraphConfig | None, max_batch_size: int, max_seq_len: int | None) -> None:
        """The CPU's attention plan builder; nothing else."""
        kv = self.kv_cache_manager
        self._plans = CpuPlanBuilder(tokens_per_block=kv.tokens_per_block, num_blocks=kv.num_blocks,
                                     dtype=self.model.config.torch_dtype, kv_scales=kv.storage.kv_scales)

    def launch(self, inputs: TpInputs) -> PendingForward:
        return ReadyForward(self._run(inputs))

    @torch.inference_mode()
    def _run(self, inputs: TpInputs) -> ForwardOutput:
        storage = self.kv_cache_manager.storage
        ids = np.asarray(inputs.input_ids, dtype=np.int64)  # in-flight inputs resolved already (ModelEngine._launch)
        positions = np.asarray(inputs.position_ids, dtype=np.int64)
        self._check(ids, positions)
        plan = self._plans.build(*inputs.attention_batch())  # a beam-search request: one sequence per beam
        hidden = self.model.forward_with_plan(
            torch.from_numpy(ids), torch.from_numpy(positions), plan, storage.k_cache, storage.v_cache
        )  # (T, hidden)
        rows, sampling, spans, drafts, beams = inputs.logit_layout()  # sampling, prompt, draft, then beam rows
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty((0, self.vocab_size))
        picked = logits if drafts else logits[: len(sampling)]  # prompt and beam rows need no pick; draft rows do
        picks = picked.argmax(dim=-1).tolist() if len(picked) else []  # (rows,)
        return ForwardOutput(logits=dict(zip(sampling, logits)), greedy_tokens=dict(zip(sampling, picks)),
                             prompt_logits=_prompt_logits(logits, spans), draft_targets=draft_targets(picks, drafts),
                             beam_logits=_beam_logits(logits, beams))


class CudaTorchModelEngine(TorchModelEngine):
    """On CUDA: :meth:`launch` enqueues the whole forward, the LM head on the sampled rows and
    their greedy pick, then a copy of the picked tokens to pinned host memory, and returns a
    :class:`CudaForward` without waiting for the GPU; ``result()`` waits for that copy alone. A
    decode batch (every request computes one token) replays a CUDA graph when
    ``cuda_graph_config`` allows (see ``cuda_graph_runner``); another forward of up to its
    largest ``capture_num_tokens`` replays piecewise graphs around eager attention
    (``piecewise_cuda_graph``). A launch's inputs travel through
    persistent pinned buffers (``attention_backend.staging``), and the forward waits on the
    device, never on the host, for the KV storage's host-tier copies issued before it
    (``KVCacheStorage.before_compute``; ``benchmarks/results/h200/serving/sync_audit.md`` lists
    every point where the step path waits for the device, and why).
    """

    def _prepare_device(self, cuda_graph_config: CudaGraphConfig | None, max_batch_size: int, max_seq_len: int | None) -> None:
        """The pinned staging buffers, and the graph runners (decode, piecewise) when ``cuda_graph_config`` allows."""
        # The previous launch's picks, on the device: request id -> row, and the tokens.
        self._device_picks: tuple[dict[int, int], torch.Tensor] | None = None
        # Every host array a launch ships goes through these pinned buffers (one per launch, in turn).
        self._staging = PinnedStaging(self.device)
        kv = self.kv_cache_manager
        self._plans = PagedPlanBuilder(self.device, tokens_per_block=kv.tokens_per_block, num_blocks=kv.num_blocks,
                                       num_kv_heads=self.model.num_local_kv_heads, staging=self._staging,
                                       kv_scales=kv.storage.kv_scales)
        mapping = self.model.mapping
        if cuda_graph_config is not None and (mapping.attn_tp_size > 1 or mapping.mlp_tp_size > 1):
            # Row-parallel layers all-reduce through the process group, which a graph cannot capture.
            raise ValueError("CUDA graphs are not supported on tensor-parallel ranks: set cuda_graph_config=None")
        if cuda_graph_config is not None:
            self.graph_runner = CudaGraphRunner(
                self.model,
                kv.storage,
                tokens_per_block=kv.tokens_per_block,
                batch_sizes=cuda_graph_config.resolve_batch_sizes(max_batch_size or 1),
                enable_padding=cuda_graph_config.enable_padding,
                max_seq_len=max_seq_len or self.model.config.max_position_embeddings,
                staging=self._staging,
            )
            sizes = cuda_graph_config.resolve_capture_num_tokens(self.max_num_tokens)
            if sizes:
                self.piecewise_runner = PiecewiseGraphRunner(self.model, num_tokens=sizes)

    @property
    def completes_asynchronously(self) -> bool:
        return True

    def _launch(self, inputs: TpInputs) -> PendingForward:
        return self.launch(inputs)

    def _run(self, inputs: TpInputs) -> ForwardOutput:
        return self.launch(inputs).result()

    @torch.inference_mode()
    def launch(self, inputs: TpInputs) -> "CudaForward":
        """Enqueue one forward on the device and return at once.

        Raises ValueError, before anything is enqueued, for token ids outside the vocabulary
        or positions past the model's (the device forward does not check them). In-flight
        inputs (overlap) take the previous launch's picks on the device, never via the host.
        The host does not wait for the device here: the inputs are copied from pinned buffers,
        and the forward waits on the device for the KV storage's pending host-tier copies (the
        exceptions, a graph captured at first use and a staging buffer still in use, are listed
        in ``benchmarks/results/h200/serving/sync_audit.md``).
        """
        ids = np.asarray(inputs.input_ids, dtype=np.int64)
        slots = [flat for flat, _ in inputs.in_flight]
        if slots:
            ids[slots] = 0  # the previous launch's picks are written over them on the device
        positions = np.asarray(inputs.position_ids, dtype=np.int64)
        self._check(ids, positions)
        rows, sampling, spans, drafts, beams = inputs.logit_layout()  # prompt, draft, beam rows after the sampling rows

        size = None
        if self.graph_runner is not None and all(inputs.samples) and not spans and not beams:
            size = self.graph_runner.graph_size(inputs.num_new_tokens, inputs.num_cached_tokens)
        storage = self.kv_cache_manager.storage
        start = None
        with self._staging.step():
            fill = self._in_flight_fill(inputs, slots) if slots else None
            if size is not None:
                # A decode batch: every request samples, its one row in order.
                step = self.graph_runner.prepare(size, ids, inputs.num_cached_tokens, inputs.block_tables)
                storage.before_compute(inputs.block_tables)  # before the first kernel that touches the pools
                if self.time_forwards:
                    start = _record_event()
                logits, tokens = self.graph_runner.replay(step, fill)
            else:
                plan = self._plan(inputs)
                storage.before_compute(inputs.attention_batch()[2])  # every beam's table too
                if self.time_forwards:
                    start = _record_event()
                logits, tokens = self._forward_eager(plan, ids, positions, rows, fill)
        self._device_picks = (dict(zip(sampling, range(len(sampling)))), tokens)
        return CudaForward(sampling, logits, tokens, start, prompt_logits=_prompt_logits(logits, spans), drafts=drafts,
                           beams=beams)

    def _in_flight_fill(self, inputs: TpInputs, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat slots, their tokens) on the device: each in-flight input's pick from the previous launch."""
        if self._device_picks is None:
            raise RuntimeError("a forward has in-flight inputs but no forward was launched before it")
        index, tokens = self._device_picks
        rows = [index[inputs.requests[i].request_id] for _, i in inputs.in_flight]
        picked = tokens.index_select(0, self._to_device(np.asarray(rows, dtype=np.int64)))
        return self._to_device(np.asarray(slots, dtype=np.int64)), picked

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, through the launch's pinned buffer (inside ``_staging.step()``)."""
        return self._staging.to_device(array)

    def _plan(self, inputs: TpInputs) -> PagedAttentionPlan:
        """The forward's attention plan, its index arrays through the launch's pinned buffer; a
        beam-search request is one sequence per beam."""
        return self._plans.build(*inputs.attention_batch())

    def _forward_eager(self, plan: PagedAttentionPlan, ids: np.ndarray, positions: np.ndarray, rows: list[int], fill=None):
        storage = self.kv_cache_manager.storage
        ids_device = self._to_device(ids)
        if fill is not None:
            ids_device.index_copy_(0, *fill)
        runner = self.piecewise_runner
        forward = self.model.forward_with_plan
        if runner is not None and runner.size_for(len(ids)) is not None:
            forward = runner.forward  # everything but attention from graphs (piecewise_cuda_graph)
        hidden = forward(ids_device, self._to_device(positions), plan, storage.k_cache, storage.v_cache)  # (T, hidden)
        if not rows:
            return hidden.new_empty((0, self.vocab_size)), torch.empty(0, dtype=torch.int64, device=self.device)
        if rows == list(range(len(rows))) and len(rows) == hidden.shape[0]:
            sampled = hidden  # every row samples (a decode batch)
        else:
            sampled = hidden.index_select(0, self._to_device(np.asarray(rows, dtype=np.int64)))
        logits = self.model.compute_logits(sampled)  # (rows, vocab)
        return logits, logits.argmax(dim=-1)




class CudaForward:
    """A forward enqueued on the GPU. ``result()`` waits for its greedy tokens to reach the host
    (not for anything enqueued after it) and returns the :class:`ForwardOutput`.

    The logits rows it hands out are device tensors, valid until the engine's next forward of
    the same graph size (they may live in a CUDA graph's static output).
    """

    __slots__ = ("_output", "_event", "_start", "_tokens_host", "_request_ids", "_drafts", "_logits", "num_tokens",
                 "_prompt_logits", "_beams")

    def __init__(
        self, request_ids: list[int], logits: torch.Tensor, tokens: torch.Tensor, start: torch.cuda.Event | None = None,
        *, prompt_logits: dict[int, tuple[int, torch.Tensor]] | None = None, drafts: list[DraftSpan] = (),
        beams: list[BeamSpan] = (),
    ) -> None:
        """Enqueue the copy of ``tokens`` (device) to pinned host memory and an event after it;
        ``start``: an event recorded before the forward's first kernel (timing). ``logits`` and
        ``tokens`` may hold more rows than ``request_ids`` (prompt rows, ``prompt_logits`` views
        them; draft rows, ``drafts``; beam rows, ``beams``, as ``TpInputs.logit_layout`` lays them
        out); only the first ``len(request_ids)`` are the requests' picks."""
        self._prompt_logits = prompt_logits
        self._output: ForwardOutput | None = None
        self.num_tokens = 0  # positions in the forward
        self._start = start
        self._request_ids = request_ids
        self._drafts = drafts
        self._beams = beams  # beam rows: the sampler reads their logits (on the device) itself
        self._logits = logits
        self._tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.numel() > 0)
        if tokens.numel():
            # one copy carries the picks and the finiteness check: -1 for a row with NaN or inf
            checked = torch.where(torch.isfinite(logits).all(dim=-1), tokens, torch.full_like(tokens, -1))
            self._tokens_host.copy_(checked, non_blocking=True)
        self._event = _record_event()

    def picks(self) -> dict[int, int]:
        try:
            return self.result().greedy_tokens or {}
        except Exception:
            return {}

    @property
    def events(self) -> tuple | None:
        """(start, end) CUDA events of the forward (engines with ``time_forwards``), else None."""
        return (self._start, self._event) if self._start is not None else None

    def done(self) -> bool:
        """True once the result can be had without waiting."""
        return self._output is not None or self._event.query()

    def device_time_ms(self) -> float | None:
        """The forward's device time (engines with ``time_forwards``), once ``result()`` returned."""
        if self._start is None or self._output is None:
            return None
        return self._start.elapsed_time(self._event)

    def result(self) -> ForwardOutput:
        if self._output is None:
            self._event.synchronize()
            tokens = self._tokens_host.tolist()  # -1: a row that is not finite (see launch)
            targets = draft_targets(tokens, self._drafts)
            nonfinite = {rid for rid, token in zip(self._request_ids, tokens) if token < 0}
            if targets:  # a draft row that is not finite fails its request too
                nonfinite |= {rid for rid, picks in targets.items() if min(picks) < 0}
            self._output = ForwardOutput(
                logits=dict(zip(self._request_ids, self._logits)),
                greedy_tokens=dict(zip(self._request_ids, tokens)),
                nonfinite=nonfinite,
                prompt_logits=self._prompt_logits,
                draft_targets=targets,
                beam_logits=_beam_logits(self._logits, self._beams),
            )
        return self._output


def _prompt_logits(logits: torch.Tensor, spans) -> dict[int, tuple[int, torch.Tensor]] | None:
    """Each prompt span's rows of ``logits`` (see :meth:`TpInputs.sampling_rows`), keyed by request id."""
    if not spans:
        return None
    return {rid: (start, logits[first : first + count]) for rid, start, first, count in spans}


def _beam_logits(logits: torch.Tensor, spans: list[BeamSpan]) -> dict[int, torch.Tensor] | None:
    """Each beam-search request's ``(beam_width, vocab)`` logits, beam 0 (its sampling row) first,
    from the rows as :meth:`TpInputs.logit_layout` lays them out. None: no beams."""
    if not spans:
        return None
    return {rid: torch.cat((logits[index : index + 1], logits[first : first + count]))
            for rid, index, first, count in spans}


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
