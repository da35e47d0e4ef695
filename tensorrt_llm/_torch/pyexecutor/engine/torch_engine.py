"""``TorchModelEngine``: a real torch model over the KV manager's paged tensors, one class per device.

The engine interface (``ModelEngine``, ``PendingForward``, ``ForwardOutput``) is in
:mod:`.interface`, the input preparation (``ForwardInputs``, ``_prepare_tp_inputs``) in
:mod:`.inputs`, the logit-row layout in :mod:`.logit_rows`; none imports torch. Here, the
device is chosen once, at construction: ``TorchModelEngine(model, ...)`` makes a
:class:`CpuTorchModelEngine` or a :class:`CudaTorchModelEngine` after the model's device (as
``pathlib.Path`` makes a ``PosixPath``), so no step runs an ``if device.type`` branch. Each makes the attention plan
builder of its device at construction (``attention_backend``) and checks its inputs on the host;
the model's forward then runs unchecked (``LlamaForCausalLM.forward_with_plan``)::

    CpuTorchModelEngine    a forward runs to completion at launch (ReadyForward);
                           plans from a CpuPlanBuilder (a CpuInvariantPlanBuilder for a
                           batch-invariant model: docs/determinism.md)
    CudaTorchModelEngine   a forward is enqueued on the GPU and returns (CudaForward);
                           plans from a PagedPlanBuilder through the pinned staging buffers;
                           decode batches replay CUDA graphs; overlap on by default: what a
                           step built in flight could not know (the previous picks, the drafts
                           of its draft slots, a move-back over rejected drafts) is put in on
                           the device at launch (engine.in_flight)
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.cpu_invariant import CpuInvariantPlanBuilder
from tensorrt_llm._torch.attention_backend.cpu_paged import CpuPlanBuilder
from tensorrt_llm._torch.attention_backend.paged import PagedAttentionPlan, PagedPlanBuilder
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.fused_layers import fuse_decoder_layers
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.engine.cuda_graph_runner import CudaGraphRunner
from tensorrt_llm._torch.pyexecutor.engine.piecewise_cuda_graph import PiecewiseGraphRunner
from tensorrt_llm._torch.pyexecutor.engine.interface import (
    NO_PICKS,
    ForwardOutput,
    ModelEngine,
    PendingForward,
    Picks,
    ReadyForward,
    picks_of,
)
from tensorrt_llm._torch.pyexecutor.engine.inputs import PAD_TOKEN_ID, ForwardInputs, TpInputs
from tensorrt_llm._torch.pyexecutor.engine.logit_rows import BeamSpan, DraftSpan, PromptSpan, draft_targets
from tensorrt_llm._torch.pyexecutor.engine.in_flight import Proposed
from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import SamplingColumns
from tensorrt_llm._torch.pyexecutor.engine.sampling_pass import (
    PassResult,
    device_columns,
    process_logits,
    sample_rows,
    working_dtype,
)
from tensorrt_llm._torch.pyexecutor.sampling_config import TokenLogprob
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.engine.in_flight import DevicePicks, InFlightStep, drafting_for
from tensorrt_llm._torch.speculative.proposer import DraftProposer

# Upstream's names, where an engineer looks for them.
__all__ = [
    "PAD_TOKEN_ID", "CpuTorchModelEngine", "CudaForward", "CudaTorchModelEngine", "ForwardOutput", "ModelEngine",
    "PendingForward", "TorchModelEngine", "ForwardInputs", "TpInputs",
]


def device_pick(logits: torch.Tensor, columns: SamplingColumns, to_device, input_ids: torch.Tensor | None,
                ) -> tuple[torch.Tensor, PassResult]:
    """The pick of every row of ``logits`` ``(R, vocab)``: its first ``columns.num_rows`` rows (the
    sampling rows) by the device sampling pass, the rest (draft rows) by argmax. ``to_device``
    ships a host column; ``input_ids``: the forward's flat input ids (penalized in-flight tokens)."""
    n = columns.num_rows
    head = logits[:n]
    dtype = working_dtype(logits.dtype)
    processed = None
    if columns.plan.processed:
        processed = head.to(dtype, copy=True)
        process_logits(processed, columns, to_device, input_ids)
    params = device_columns(to_device(columns.floats), to_device(columns.longs), to_device(columns.top_p_rows), dtype)
    result = sample_rows(head, params, columns.plan, processed=processed)
    tokens = result.tokens if n == len(logits) else torch.cat((result.tokens, logits[n:].argmax(dim=-1)))
    return tokens, result


def token_logprobs(request_ids: list[int], counts, tokens: list[int], logprob: list[float],
                   top_ids: list[list[int]] | None, top_values: list[list[float]] | None) -> dict[int, TokenLogprob]:
    """Each request's :class:`TokenLogprob` from the pass's rows (read back as lists), for the rows
    whose ``counts`` (alternatives asked for; -1: none) ask."""
    found = {}
    for i, (rid, count) in enumerate(zip(request_ids, counts)):
        if count < 0:
            continue
        top = tuple(zip(top_ids[i][:count], top_values[i][:count])) if count else ()
        found[rid] = TokenLogprob(tokens[i], logprob[i], top)
    return found


def _token_logprobs(request_ids: list[int], columns: SamplingColumns | None, result: PassResult | None,
                    ) -> dict[int, TokenLogprob] | None:
    """:func:`token_logprobs` of a host forward's pass (None: no row asked)."""
    if result is None or result.logprob is None:
        return None
    top = result.top_ids is not None
    return token_logprobs(request_ids, columns.longs[4].tolist(), result.tokens.tolist(), result.logprob.tolist(),
                          result.top_ids.tolist() if top else None, result.top_logprobs.tolist() if top else None)


class TorchModelEngine(ModelEngine):
    """Runs a real torch model over the paged KV tensors of the KV manager.

    The model and the KV pools live on one device; constructing a ``TorchModelEngine`` makes
    the subclass for that device (see the module docstring).

    ``time_forwards``: on CUDA, each forward also carries the device time of its forward (from
    its first kernel, after the host has prepared the inputs, to the greedy pick): what a cost
    model predicts, without the host's share of the iteration.
    """

    time_forwards: bool = False
    picks_tokens = True  # the pick of every sampling row, made on the model's device
    # Every sampling row is sampled on the model's device in one pass (engine.sampling_pass): greedy
    # rows' argmax (bit for bit the plain pick), drawing rows' draw, penalties, masks, logprobs.
    samples_on_device = True
    # Drafts run as extra positions of their request (causal over its cache, like a chunk); the
    # greedy pick at each draft row comes back in ForwardOutput.draft_targets.
    supports_draft_tokens = True
    # Beams run as sequences of their own to attention, one row each, over their own block
    # tables (ForwardInputs.attention_batch); their rows come back in ForwardOutput.beam_logits.
    max_beam_width = 64
    # A speculative request stays under overlap: the engine verifies drafts as the sampler does
    # and moves the next forward back over rejected ones (on the host on the CPU, on the device on CUDA).
    accepts_drafts = True

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
        max_draft_len: int = 0,
        draft_proposer: DraftProposer | None = None,
    ) -> None:
        """``max_draft_len``: speculative decoding's; a verification step runs ``1 + max_draft_len``
        decode rows per request, so the decode graphs are sized for ``max_batch_size`` times that.
        ``draft_proposer``: what the engine fills the draft slots of steps built in flight with
        (``ModelEngine``)."""
        super().__init__(max_num_tokens, kv_cache_manager, draft_proposer=draft_proposer)
        self.max_draft_len = max_draft_len
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
        self._prepare_device(cuda_graph_config, max_batch_size * (1 + max_draft_len), max_seq_len)

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
    def launch(self, inputs: ForwardInputs) -> PendingForward:
        """Start one forward over ``inputs`` and return at once (on the CPU it has run)."""


class CpuTorchModelEngine(TorchModelEngine):
    """On the CPU: each forward runs to completion at launch, in order with the KV manager's
    block copies, and still delivers its tokens one iteration later under overlap (a speculative
    request's next forward is moved back over its rejected drafts on the host: ``ForwardInputs.resolve``)."""

    def _prepare_device(self, cuda_graph_config: CudaGraphConfig | None, max_batch_size: int, max_seq_len: int | None) -> None:
        """The CPU's attention plan builder (the batch-invariant one for a batch-invariant model); nothing else."""
        kv = self.kv_cache_manager
        builder = CpuInvariantPlanBuilder if self.model.config.batch_invariant else CpuPlanBuilder
        self._plans = builder(tokens_per_block=kv.tokens_per_block, num_blocks=kv.num_blocks,
                              dtype=self.model.config.torch_dtype, kv_scales=kv.storage.kv_scales)

    def launch(self, inputs: ForwardInputs) -> PendingForward:
        return ReadyForward(self._run(inputs))

    def _propose_on_host(self, histories: list[list[int]], rooms: list[int]) -> list[list[int]]:
        """The drafts of steps built in flight, at resolve time: the proposer's batch form (the one
        the CUDA engine runs on the device) on CPU tensors of the requests' real tokens."""
        lengths = np.fromiter(map(len, histories), dtype=np.int64, count=len(histories))
        history = np.zeros((len(histories), max(int(lengths.max(initial=0)), 1)), dtype=np.int64)
        for row, tokens in zip(history, histories):
            row[: len(tokens)] = tokens
        drafts, counts = self.draft_proposer.propose_batch(torch.from_numpy(history), torch.from_numpy(lengths),
                                                           torch.tensor(rooms, dtype=torch.int64))
        return [row[:count] for row, count in zip(drafts.tolist(), counts.tolist())]

    @torch.inference_mode()
    def _run(self, inputs: ForwardInputs) -> ForwardOutput:
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
        columns = inputs.sampling_columns(self.vocab_size)  # None: every row plain greedy, its argmax the answer
        result = None
        if columns is not None:
            picks, result = device_pick(picked, columns, torch.from_numpy, torch.from_numpy(ids))
            picks = picks.tolist()
        else:
            picks = picked.argmax(dim=-1).tolist() if len(picked) else []  # (rows,)
        finite = torch.isfinite(logits[: len(sampling)]).all(dim=-1).tolist()
        verified = inputs.verified_drafts() if drafts else None  # engine drafts: proposed at resolve
        return ForwardOutput(logits=dict(zip(sampling, logits)), greedy_tokens=dict(zip(sampling, picks)),
                             nonfinite={rid for rid, ok in zip(sampling, finite) if not ok},
                             prompt_logits=_prompt_logits(logits, spans),
                             draft_targets=draft_targets(picks, drafts, verified),
                             beam_logits=_beam_logits(logits, beams), verified_drafts=verified, device_sampled=True,
                             logprobs=_token_logprobs(sampling, columns, result),
                             sampling_errors=columns.errors if columns is not None and columns.errors else None)


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
        """The model's fused decoder layers (``models/fused_layers.py``), the pinned staging buffers,
        and the graph runners (decode, piecewise) when ``cuda_graph_config`` allows."""
        if self.model.config.batch_invariant:  # the model refuses it first; a model moved to the GPU after is refused here
            raise ValueError("batch_invariant runs on the CPU only: the CUDA kernels' reductions depend on the batch "
                             "(docs/determinism.md)")
        fuse_decoder_layers(self.model)  # fewer, larger kernels a layer; a no-op where refused (logged)
        # The previous launch's picks on the device (the next launch's in-flight inputs take them).
        self._device_picks: DevicePicks | None = None
        # Each drafting request's tokens on the device and the proposer, for steps built in flight.
        self._drafting = None
        if self.draft_proposer is not None:
            longest = max_seq_len or self.model.config.max_position_embeddings
            self._drafting = drafting_for(self.draft_proposer, self.device, longest + self.max_draft_len + 2)
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

    def warmup(self) -> None:
        """The graphs (``TorchModelEngine.warmup``), then the fused drafting kernel's variants."""
        super().warmup()
        if self._drafting is not None:
            self._drafting.warm_up()

    def _launch(self, inputs: ForwardInputs) -> PendingForward:
        return self.launch(inputs)

    def _run(self, inputs: ForwardInputs) -> ForwardOutput:
        return self.launch(inputs).result()

    @torch.inference_mode()
    def launch(self, inputs: ForwardInputs) -> "CudaForward":
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
        for entry in inputs.engine_drafts:
            ids[entry.first_row : entry.first_row + entry.slots] = 0  # the drafts proposed on the device
        positions = np.asarray(inputs.position_ids, dtype=np.int64)
        self._check(ids, positions)  # positions as built (a speculative request's may only move back)
        rows, sampling, spans, drafts, beams = inputs.logit_layout()  # prompt, draft, beam rows after the sampling rows
        new, cached, tables = inputs.attention_batch()  # verification steps: one decode row per position

        size = None
        if self.graph_runner is not None and all(inputs.samples) and not spans and not beams:
            size = self.graph_runner.graph_size(new, cached)
        columns = inputs.sampling_columns(self.vocab_size)  # None: every row plain greedy (the argmax)
        verified = inputs.verified_drafts() if drafts else None  # the host's; the engine's come back with the picks
        in_flight = None  # what the forward takes from the one before, and its verification (in_flight)
        if slots or inputs.engine_drafts or drafts:
            in_flight = InFlightStep(inputs, self._device_picks, new=new, positions=positions,
                                     rows_are_sequences=size is not None,
                                     tokens_per_block=self.kv_cache_manager.tokens_per_block, drafting=self._drafting,
                                     sampling=sampling, drafts=drafts, verified=verified,
                                     logit_rows=None if rows == list(range(len(rows))) else rows)
        storage = self.kv_cache_manager.storage
        start = None
        result = None
        with self._staging.step():
            if in_flight is not None:
                in_flight.upload(self._to_device)  # the one copy of everything it needs
            if size is not None:
                # A decode batch (verification rows included): every row of it, in order.
                step = self.graph_runner.prepare(size, ids, cached, tables)
                storage.before_compute(inputs.block_tables)  # before the first kernel that touches the pools
                if self.time_forwards:
                    start = _record_event()
                logits, tokens = self.graph_runner.replay(step, in_flight)
                if columns is not None:  # the sampling pass's graph, over the same rows (draft rows greedy)
                    result = self.graph_runner.sample(step, columns.at_rows(rows[: len(sampling)], size))
                    tokens = result.tokens[: len(ids)]
                if rows != list(range(len(ids))):  # the sampling rows first, then the draft rows
                    index = self._logit_rows(rows, in_flight)
                    logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
                    if result is not None and result.logprob is not None:
                        result = _rows_of(result, index[: len(sampling)])
            else:
                plan = self._plans.build(new, cached, tables)
                storage.before_compute(tables)  # every beam's table too
                if self.time_forwards:
                    start = _record_event()
                logits, tokens, result = self._forward_eager(plan, ids, positions, rows, in_flight, columns)
            if in_flight is None:
                self._device_picks = DevicePicks(dict(zip(sampling, range(len(sampling)))), tokens, None)
            else:
                self._device_picks = in_flight.verify(tokens)
        proposed = in_flight.proposed if in_flight is not None else None
        return CudaForward(sampling, logits, tokens, start, prompt_logits=_prompt_logits(logits, spans), drafts=drafts,
                           beams=beams, verified_drafts=verified, proposed=proposed, columns=columns, logprobs=result)

    def _logit_rows(self, rows: list[int], in_flight: InFlightStep | None) -> torch.Tensor:
        """The flat rows whose logits the forward computes, on the device (in the in-flight array
        when the launch has one: no copy of their own)."""
        if in_flight is not None and in_flight.logit_rows is not None:
            return in_flight.logit_rows
        return self._to_device(np.asarray(rows, dtype=np.int64))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, through the launch's pinned buffer (inside ``_staging.step()``)."""
        return self._staging.to_device(array)

    def _forward_eager(self, plan: PagedAttentionPlan, ids: np.ndarray, positions: np.ndarray, rows: list[int],
                       in_flight: InFlightStep | None = None, columns: SamplingColumns | None = None):
        """``(logits (rows, vocab), picks (rows,), the sampling pass's result or None)`` of a forward
        run kernel by kernel (piecewise graphs where they serve); the picks of the sampling rows
        come from the sampling pass when ``columns`` ask for one, the others' are argmaxes."""
        storage = self.kv_cache_manager.storage
        ids_device = self._to_device(ids)
        positions_device = self._to_device(positions)
        if in_flight is not None:  # every moved row is a decode of the plan (attention_batch)
            in_flight(ids_device, positions_device, plan.new_slots, plan.decode.seq_lens if plan.decode else None)
        runner = self.piecewise_runner
        forward = self.model.forward_with_plan
        if runner is not None and runner.size_for(len(ids)) is not None:
            forward = runner.forward  # everything but attention from graphs (piecewise_cuda_graph)
        hidden = forward(ids_device, positions_device, plan, storage.k_cache, storage.v_cache)  # (T, hidden)
        if not rows:
            return hidden.new_empty((0, self.vocab_size)), torch.empty(0, dtype=torch.int64, device=self.device), None
        if rows == list(range(len(rows))) and len(rows) == hidden.shape[0]:
            sampled = hidden  # every row samples (a decode batch)
        else:
            sampled = hidden.index_select(0, self._logit_rows(rows, in_flight))
        logits = self.model.compute_logits(sampled)  # (rows, vocab)
        if columns is None:
            return logits, logits.argmax(dim=-1), None
        tokens, result = device_pick(logits, columns, self._to_device, ids_device)
        return logits, tokens, result




class CudaForward:
    """A forward enqueued on the GPU. ``result()`` waits for its picks to reach the host (not for
    anything enqueued after it) and returns the :class:`ForwardOutput`.

    The logits rows it hands out are device tensors, valid until the engine's next forward of
    the same graph size (they may live in a CUDA graph's static output).
    """

    __slots__ = ("_output", "_event", "_start", "_host", "_request_ids", "_drafts", "_logits", "num_tokens",
                 "_prompt_logits", "_beams", "_verified", "_proposed", "_columns", "_top", "_rows")

    def __init__(
        self, request_ids: list[int], logits: torch.Tensor, tokens: torch.Tensor, start: torch.cuda.Event | None = None,
        *, prompt_logits: dict[int, tuple[int, torch.Tensor]] | None = None, drafts: list[DraftSpan] = (),
        beams: list[BeamSpan] = (), verified_drafts: dict[int, list[int]] | None = None,
        proposed: Proposed | None = None, columns: SamplingColumns | None = None, logprobs: PassResult | None = None,
    ) -> None:
        """Enqueue one copy to pinned host memory and an event after it; ``start``: an event
        recorded before the forward's first kernel (timing). ``logits`` and ``tokens`` may hold
        more rows than ``request_ids`` (prompt rows, ``prompt_logits`` views them; draft rows,
        ``drafts``; beam rows, ``beams``, as ``ForwardInputs.logit_layout`` lays them out); only
        the first ``len(request_ids)`` are the requests' picks. ``verified_drafts``: the host's
        drafts; ``proposed``: those the engine proposed on the device. ``columns``: the step's
        sampling columns when the sampling pass ran (None: every pick an argmax); ``logprobs``: the
        pass's result when its plan computed log-probabilities (its first rows the sampling rows).

        The copy, in order: every row's pick (-1: a row with NaN or inf), the proposed drafts and
        their counts, then the log-probabilities; int64, or float64 when log-probabilities ride
        along (ids below 2**53 are exact in it)."""
        self._prompt_logits = prompt_logits
        self._verified = verified_drafts
        self._proposed = None if proposed is None else (proposed.position, proposed.width)
        self._output: ForwardOutput | None = None
        self.num_tokens = 0  # positions in the forward
        self._start = start
        self._request_ids = request_ids
        self._drafts = drafts
        self._beams = beams  # beam rows: the sampler reads their logits (on the device) itself
        self._logits = logits
        self._columns = columns
        self._top = -1  # alternatives per row in the copy; -1: no log-probabilities in it
        self._rows = tokens.shape[0]
        parts = []
        if tokens.numel():
            # one copy carries the picks and the finiteness check: -1 for a row with NaN or inf
            parts.append(torch.where(torch.isfinite(logits).all(dim=-1), tokens, torch.full_like(tokens, -1)))
        if proposed is not None:  # the drafts proposed on the device, then their counts (one view)
            parts.append(proposed.values)
        if tokens.numel() and logprobs is not None and logprobs.logprob is not None:
            n = len(request_ids)
            parts = [part.double() for part in parts] + [logprobs.logprob[:n].double()]
            self._top = 0
            if logprobs.top_ids is not None:
                self._top = logprobs.top_ids.shape[1]
                parts += [logprobs.top_ids[:n].double().flatten(), logprobs.top_logprobs[:n].double().flatten()]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else tokens
        # pinned for a non-blocking copy from the GPU (a forward on the CPU, in tests, has nothing to pin)
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=packed.is_cuda and packed.numel() > 0)
        if packed.numel():
            self._host.copy_(packed, non_blocking=True)
        self._event = _record_event()

    def picks(self) -> Picks:
        """What the next forward takes from this one, read on the host (the engine's own next
        launch takes it on the device instead)."""
        try:
            return picks_of(self.result())
        except Exception:
            return NO_PICKS

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
            values = self._host.tolist()
            rows = self._rows
            as_int = (lambda part: part) if self._top < 0 else (lambda part: [int(v) for v in part])
            tokens = as_int(values[:rows])  # -1: a row that is not finite (see launch)
            verified = self._verified
            if self._proposed is not None:  # the engine's drafts follow the picks
                position, width = self._proposed
                proposals = as_int(values[rows : rows + len(position) * width])
                counts = as_int(values[rows + len(position) * width : rows + len(position) * (width + 1)])
                rows += len(position) * (width + 1)
                verified = dict(verified or {})
                for rid, e in position.items():
                    verified[rid] = proposals[e * width : e * width + counts[e]]
            targets = draft_targets(tokens, self._drafts, verified)
            nonfinite = {rid for rid, token in zip(self._request_ids, tokens) if token < 0}
            if targets:  # a draft row that is not finite fails its request too
                nonfinite |= {rid for rid, picks in targets.items() if min(picks) < 0}
            columns = self._columns
            self._output = ForwardOutput(
                logits=dict(zip(self._request_ids, self._logits)),
                greedy_tokens=dict(zip(self._request_ids, tokens)),
                nonfinite=nonfinite,
                prompt_logits=self._prompt_logits,
                draft_targets=targets,
                beam_logits=_beam_logits(self._logits, self._beams),
                verified_drafts=verified,
                device_sampled=True,
                logprobs=self._read_logprobs(values[rows:], tokens) if self._top >= 0 else None,
                sampling_errors=columns.errors if columns is not None and columns.errors else None,
            )
        return self._output

    def _read_logprobs(self, values: list[float], tokens: list[int]) -> dict[int, TokenLogprob]:
        """The log-probabilities packed after the picks: (n,) chosen, then (n, top) ids, (n, top) values."""
        n, top = len(self._request_ids), self._top
        ids = [list(map(int, values[n + i * top : n + (i + 1) * top])) for i in range(n)] if top else None
        tops = [values[n + n * top + i * top : n + n * top + (i + 1) * top] for i in range(n)] if top else None
        return token_logprobs(self._request_ids, self._columns.longs[4].tolist(), tokens, values[:n], ids, tops)


def _rows_of(result: PassResult, index: torch.Tensor) -> PassResult:
    """The pass's log-probabilities of the rows ``index`` (a decode graph's flat rows, in logit-row order)."""
    top = result.top_ids is not None
    return PassResult(result.tokens, result.logprob.index_select(0, index),
                      result.top_ids.index_select(0, index) if top else None,
                      result.top_logprobs.index_select(0, index) if top else None)


def _prompt_logits(logits: torch.Tensor, spans: list[PromptSpan]) -> dict[int, tuple[int, torch.Tensor]] | None:
    """Each prompt span's rows of ``logits`` (:mod:`.logit_rows`), keyed by request id: (first prompt position, rows)."""
    if not spans:
        return None
    return {rid: (start, logits[first : first + count]) for rid, start, first, count in spans}


def _beam_logits(logits: torch.Tensor, spans: list[BeamSpan]) -> dict[int, torch.Tensor] | None:
    """Each beam-search request's ``(beam_width, vocab)`` logits, beam 0 (its sampling row) first,
    from the rows as :meth:`ForwardInputs.logit_layout` lays them out. None: no beams."""
    if not spans:
        return None
    return {rid: torch.cat((logits[index : index + 1], logits[first : first + count]))
            for rid, index, first, count in spans}


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
