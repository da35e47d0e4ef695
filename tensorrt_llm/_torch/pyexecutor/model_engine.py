"""Model engines: ``_prepare_tp_inputs`` builds one flat forward; an engine runs it.

``ModelEngine`` owns the input preparation, identical for every engine: it appends each
request's positions — a context request's chunk as the batch carries it, a generation
request's next step — checks each count against :func:`forward_cost`, and checks the total
against ``max_num_tokens`` the way upstream asserts it, except that here it raises
:class:`TokenBudgetExceeded`, which fails the batch instead of killing the executor thread. Subclasses run the
prepared inputs: :class:`TorchModelEngine` through a real torch model; the replay's
simulated engine through a cost model.

``forward_async`` launches a forward and returns a :class:`PendingForward` (the CUDA engine
returns before the GPU has run it; a host engine built ``asynchronous=True`` runs it when its
result is first asked for, in launch order); ``forward`` waits for it. Under the overlap
scheduler a generation request can be in the next forward before its newest token is known:
its ``tokens`` end with ``IN_FLIGHT_TOKEN_ID`` (see ``llm_request``), and the engine puts in
that slot the token it picked for the request in the previous forward (:meth:`ModelEngine.can_pick`
says for which requests an engine picks the token the sampler will return).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from tensorrt_llm._torch.attention_backend.paged import PagedAttentionPlan, build_plan, host_to_device
from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.modeling_llama import AttentionMetadata, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CudaGraphRunner
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

PAD_TOKEN_ID = 0  # fills first-draft slots before the drafter has proposed anything


class TpInputs:
    """One flat forward. Request ``i`` owns ``input_ids[offsets[i]:offsets[i] + num_new_tokens[i]]``.

    ``requests``, ``num_new_tokens``, ``num_cached_tokens`` and ``samples`` (does request
    ``i`` produce a token this step) are filled as requests are added. The flat
    ``input_ids`` and ``position_ids`` and the ``block_tables`` are built on first use — a
    simulated engine never needs them, and a context chunk can be thousands of tokens — so
    they must be read before the KV manager allocates again (in the same iteration), or taken
    at launch by :meth:`materialize` when the forward runs later.

    ``in_flight``: ``(flat index, request index)`` of each generation input whose token a
    forward in flight is still sampling (overlap); :meth:`resolve` fills them in.
    """

    __slots__ = (
        "requests", "num_new_tokens", "num_cached_tokens", "samples", "total_num_tokens", "in_flight", "prompt_logits",
        "_pieces", "_beams", "_tables", "_kv", "_input_ids", "_position_ids", "_block_tables",
    )

    def __init__(self, kv_cache_manager: KVCacheManager | None = None) -> None:
        self.requests: list[LlmRequest] = []
        self.num_new_tokens: list[int] = []
        self.num_cached_tokens: list[int] = []
        self.samples: list[bool] = []
        self.total_num_tokens = 0
        self.in_flight: list[tuple[int, int]] = []
        self.prompt_logits: set[int] = set()  # indices of context chunks whose every position gets logits
        self._pieces: list[tuple[list[int], int, int, list[int]]] = []  # token source, start, stop, then extra
        self._beams: list[int] = []
        self._tables: list[list[int] | None] = []  # None: the request's table in the KV manager
        self._kv = kv_cache_manager
        self._input_ids: list[int] | None = None
        self._position_ids: list[int] | None = None
        self._block_tables: list[list[int]] | None = None

    def append(
        self, request: LlmRequest, token_ids: list[int], start: int, block_table: list[int] | None, samples: bool,
        beams: int = 1,
    ) -> None:
        """Consecutive positions from ``start``; with ``beams`` > 1 every beam is at ``start``.
        ``block_table`` None: the request's table in the KV manager, read on first use."""
        self._add(request, (token_ids, 0, len(token_ids), ()), len(token_ids), start, block_table, samples, beams)

    def append_generation(self, requests: list[LlmRequest]) -> None:
        """The next step of each generation request: its newest token (one per beam), then
        its draft tokens, or first-draft padding up to ``max_draft_len``."""
        count = 0
        for request in requests:
            tokens = request.tokens
            beams = request.beam_width
            if request.is_first_draft:
                token_ids = [tokens[-1]] + [PAD_TOKEN_ID] * request.max_draft_len
            elif request.py_draft_tokens:
                token_ids = [tokens[-1], *request.py_draft_tokens]
            else:  # one position per beam
                token_ids = [tokens[-1]] * beams
                if token_ids[0] == IN_FLIGHT_TOKEN_ID:
                    self.in_flight.append((self.total_num_tokens + count, len(self._beams)))  # (flat, request index)
            self._pieces.append((token_ids, 0, len(token_ids), ()))
            self.num_new_tokens.append(len(token_ids))
            self.num_cached_tokens.append(len(tokens) - 1)
            self._beams.append(beams)
            count += len(token_ids)
        self.requests += requests
        self.samples += [True] * len(requests)
        self._tables += [None] * len(requests)
        self.total_num_tokens += count
        self._input_ids = self._position_ids = self._block_tables = None

    def append_chunk(self, request: LlmRequest, start: int, stop: int, extra: list[int], samples: bool) -> None:
        """Prompt tokens ``[start, stop)`` of ``request`` followed by ``extra`` (draft tokens), not copied yet.
        A request that asks for prompt log-probabilities gets the logits of every position of it."""
        if request.sampling_config.prompt_logprobs is not None:
            self.prompt_logits.add(len(self.requests))
        self._add(request, (request.tokens, start, stop, extra), stop - start + len(extra), start, None, samples, 1)

    def _add(self, request, piece, count, start, block_table, samples, beams) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(count)
        self.num_cached_tokens.append(start)
        self.samples.append(samples)
        self._pieces.append(piece)
        self._beams.append(beams)
        self._tables.append(block_table)
        self.total_num_tokens += count
        self._input_ids = self._position_ids = self._block_tables = None

    def resolve(self, picks: Mapping[int, int]) -> None:
        """Fill each in-flight input with the token the engine picked for its request in the
        previous forward (``picks``: request id to token). A request with no pick (its previous
        forward failed) gets token 0: it has failed already, and this forward's output for it is dropped."""
        for flat, index in self.in_flight:
            token = picks.get(self.requests[index].request_id, 0)
            self._pieces[index][0][0] = token  # the generation piece's own list
            if self._input_ids is not None:
                self._input_ids[flat] = token

    def materialize(self) -> None:
        """Build the flat inputs and copy the block tables now: a forward that runs after
        launch must not read request or KV state that has moved on since."""
        self.input_ids, self.position_ids  # noqa: B018 (built and kept)
        self._block_tables = [list(table) for table in self.block_tables]

    def logit_rows(self) -> tuple[list[int], list[int], list[tuple[int, int, int, int]]]:
        """Which flat positions get logits: ``(rows, sampling, prompt_spans)``. ``rows`` holds first
        the last position of each request that samples (``sampling``: their ids, in order), then
        the prompt positions of each context chunk whose request asks for prompt log-probabilities
        (``prompt_spans``: ``(request id, first prompt position, first row in rows, count)``)."""
        rows, sampling, spans = [], [], []
        offset = 0
        for index, (request, n, samples) in enumerate(zip(self.requests, self.num_new_tokens, self.samples)):
            offset += n
            if samples:
                rows.append(offset - 1)  # the last position of the request predicts its next token
                sampling.append(request.request_id)
            if index in self.prompt_logits:
                _, start, stop, _ = self._pieces[index]
                spans.append((request.request_id, start, offset - n, stop - start))
        for rid, start, first, count in spans:
            rows += range(first, first + count)
        first_row = len(sampling)
        for i, (rid, start, first, count) in enumerate(spans):
            spans[i] = (rid, start, first_row, count)
            first_row += count
        return rows, sampling, spans

    def last_input_id(self, index: int) -> int:
        """The last input token of request ``index`` (the one whose logits it samples from)."""
        source, _start, stop, extra = self._pieces[index]
        return extra[-1] if extra else source[stop - 1]

    @property
    def input_ids(self) -> list[int]:
        if self._input_ids is None:
            ids: list[int] = []
            for source, start, stop, extra in self._pieces:
                ids += source[start:stop]
                ids += extra
            self._input_ids = ids
        return self._input_ids

    @property
    def position_ids(self) -> list[int]:
        if self._position_ids is None:
            positions: list[int] = []
            for start, count, beams in zip(self.num_cached_tokens, self.num_new_tokens, self._beams):
                positions += [start] * beams if beams > 1 else range(start, start + count)
            self._position_ids = positions
        return self._position_ids

    @property
    def block_tables(self) -> list[list[int]]:
        if self._block_tables is None:
            self._block_tables = [
                table if table is not None else self._kv.block_table(request)
                for request, table in zip(self.requests, self._tables)
            ]
        return self._block_tables


@dataclass(slots=True)
class ForwardOutput:
    """Per request that samples: the logits row of its last position (None for simulated engines),
    and, from engines that pick on the device, the greedy token (the argmax of that row).

    ``nonfinite``: from engines that check on the device, the requests whose logits row holds NaN
    or inf (None: not checked; the sampler checks the row itself). Checking a device row on the
    host would wait for the device, and with it for the next forward already queued (overlap)."""

    logits: dict[int, torch.Tensor | None]
    num_tokens: int = 0  # positions in the forward
    greedy_tokens: dict[int, int] | None = None
    nonfinite: set[int] | None = None
    # Requests that ask for prompt log-probabilities, in a context chunk: (the chunk's first prompt
    # position, (chunk length, vocab) logits: row i predicts prompt position start + i + 1).
    prompt_logits: dict[int, tuple[int, torch.Tensor]] | None = None


class ModelEngine(abc.ABC):
    """Shared input preparation; subclasses implement :meth:`_run` (and may launch on a device).

    ``asynchronous``: on a host engine, :meth:`forward_async` returns before the forward has
    run; it runs when its result (or a later forward's) is first asked for, in launch order,
    over inputs taken at launch. This is how the CPU tests run the overlap scheduler against an
    engine that completes later. Only an engine without KV data may defer this way (the
    simulated one): the KV manager's host-side block copies (onboarding, partial-reuse copies)
    would otherwise run before a forward launched earlier, which a CUDA stream never allows.
    A torch engine on the CPU runs each forward at launch, in order with those copies, and
    still delivers its tokens one iteration later under overlap.
    """

    #: largest beam width / whether draft tokens can be run; checked at submission.
    max_beam_width: int = 1
    supports_draft_tokens: bool = False

    def __init__(self, max_num_tokens: int, kv_cache_manager: KVCacheManager, *, asynchronous: bool = False) -> None:
        self.max_num_tokens = max_num_tokens
        self.kv_cache_manager = kv_cache_manager
        self.asynchronous = asynchronous
        self._previous: PendingForward | None = None  # the last forward launched on the host

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def completes_asynchronously(self) -> bool:
        """True when :meth:`forward_async` returns before the forward has run: the overlap
        scheduler then hides the host's work behind it (and is on by default)."""
        return self.asynchronous

    def can_pick(self, request: LlmRequest) -> bool:
        """Whether this engine picks, in the forward itself, the very token the sampler will
        return for ``request`` (so the request can be in the next forward before the token
        reaches the host). Greedy, one beam, no drafts, nothing that needs its logits on the host
        (penalties, a grammar mask, logprobs: ``LlmRequest.needs_host_logits``), and an engine that picks."""
        return (
            self.picks_tokens
            and request.beam_width == 1
            and not request.py_draft_tokens
            and not request.is_first_draft
            and request.sampling_config.is_greedy
            and not request.needs_host_logits
        )

    #: whether forwards carry ``greedy_tokens`` (the engine's own pick for each sampling request)
    picks_tokens: bool = False

    def forward(self, scheduled: ScheduledRequests) -> ForwardOutput:
        return self.forward_async(scheduled).result()

    def forward_async(self, scheduled: ScheduledRequests) -> "PendingForward":
        """Prepare the inputs (TokenBudgetExceeded past the budget, before anything runs) and launch."""
        inputs = self._prepare_tp_inputs(scheduled)
        pending = self._launch(inputs)
        pending.num_tokens = inputs.total_num_tokens
        return pending

    def _launch(self, inputs: TpInputs) -> "PendingForward":
        """A host forward: now, or later in launch order when the engine is asynchronous. Its
        in-flight inputs take the previous forward's picks."""
        previous = self._previous
        run = self._host_forward(inputs)

        def complete() -> ForwardOutput:
            if inputs.in_flight:
                inputs.resolve(previous.picks() if previous is not None else {})
            output = run()
            output.num_tokens = inputs.total_num_tokens
            return output

        if self.asynchronous:
            pending = PendingForward.deferred(complete, previous)
        else:
            pending = PendingForward.ready(complete())
        self._previous = pending
        return pending

    def _host_forward(self, inputs: TpInputs) -> Callable[[], ForwardOutput]:
        """Take what running ``inputs`` later needs now (state moves on after launch)."""
        if self.asynchronous:
            inputs.materialize()
        return lambda: self._run(inputs)

    def _prepare_tp_inputs(self, scheduled: ScheduledRequests) -> TpInputs:
        """Flat inputs for the batch; raises TokenBudgetExceeded past ``max_num_tokens``."""
        inputs = TpInputs(self.kv_cache_manager)
        for chunk in scheduled.context_chunks:
            request = chunk.request
            last = chunk.is_last
            inputs.append_chunk(request, chunk.start, chunk.end, request.py_draft_tokens if last else (), samples=last)
        inputs.append_generation(scheduled.generation_requests)
        costs = [chunk.cost() for chunk in scheduled.context_chunks]
        costs += map(forward_cost, scheduled.generation_requests)
        assert costs == inputs.num_new_tokens, "position count drift from forward_cost"
        if inputs.total_num_tokens > self.max_num_tokens:
            raise TokenBudgetExceeded(inputs.total_num_tokens, self.max_num_tokens)
        return inputs

    @abc.abstractmethod
    def _run(self, inputs: TpInputs) -> ForwardOutput: ...


class TorchModelEngine(ModelEngine):
    """Runs a real torch model over the paged KV tensors of the KV manager.

    The model and the KV pools live on one device. On the CPU a forward runs to completion in
    :meth:`_run`. On CUDA, :meth:`launch` enqueues the whole forward, the LM head on the sampled
    rows and their greedy pick, then a copy of the picked tokens to pinned host memory, and
    returns a :class:`PendingForward` without waiting for the GPU; ``result()`` waits for that
    copy alone. A decode batch (every request computes one token) replays a CUDA graph when
    ``cuda_graph_config`` allows (see ``cuda_graph_runner``). A launch's inputs travel through
    persistent pinned buffers (``attention_backend.staging``), and the forward waits on the
    device, never on the host, for the KV storage's host-tier copies issued before it
    (``KVCacheStorage.before_compute``; ``benchmarks/results/h200/serving/sync_audit.md`` lists
    every point where the step path waits for the device, and why).

    ``time_forwards``: on CUDA, each ``PendingForward`` also carries the device time of its
    forward (from its first kernel, after the host has prepared the inputs, to the greedy pick):
    what a cost model predicts, without the host's share of the iteration.
    """

    time_forwards: bool = False
    picks_tokens = True  # the greedy pick of every sampling row, made on the model's device

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
        self.graph_runner: CudaGraphRunner | None = None
        # The previous CUDA launch's picks, on the device: request id -> row, and the tokens.
        self._device_picks: tuple[dict[int, int], torch.Tensor] | None = None
        # Every host array a CUDA launch ships goes through these pinned buffers (one per launch, in turn).
        self._staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda" and cuda_graph_config is not None:
            self.graph_runner = CudaGraphRunner(
                model,
                storage,
                tokens_per_block=kv_cache_manager.tokens_per_block,
                batch_sizes=cuda_graph_config.resolve_batch_sizes(max_batch_size or 1),
                enable_padding=cuda_graph_config.enable_padding,
                max_seq_len=max_seq_len or model.config.max_position_embeddings,
                staging=self._staging,
            )

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def completes_asynchronously(self) -> bool:
        return self.device.type == "cuda"

    def _launch(self, inputs: TpInputs) -> "PendingForward":
        if self.device.type == "cuda":
            return self.launch(inputs)
        return super()._launch(inputs)

    def warmup(self) -> None:
        """Capture the decode graphs of every batch size now rather than at first use (also
        compiles the decode kernel for every split count). Nothing to do on the CPU."""
        if self.graph_runner is not None:
            self.graph_runner.capture_all()

    def _run(self, inputs: TpInputs) -> ForwardOutput:
        if self.device.type == "cpu":
            return self._run_cpu(inputs)
        return self.launch(inputs).result()

    @torch.inference_mode()
    def _run_cpu(self, inputs: TpInputs) -> ForwardOutput:
        storage = self.kv_cache_manager.storage
        metadata = AttentionMetadata(
            num_new_tokens=inputs.num_new_tokens,
            num_cached_tokens=inputs.num_cached_tokens,
            block_tables=inputs.block_tables,
            tokens_per_block=self.kv_cache_manager.tokens_per_block,
        )
        hidden = self.model(
            torch.tensor(inputs.input_ids, dtype=torch.long),
            torch.tensor(inputs.position_ids, dtype=torch.long),
            metadata,
            storage.k_cache,
            storage.v_cache,
        )  # (T, hidden)
        rows, sampling, spans = inputs.logit_rows()
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty((0, self.vocab_size))
        greedy = logits[: len(sampling)].argmax(dim=-1).tolist() if sampling else []
        return ForwardOutput(logits=dict(zip(sampling, logits)), greedy_tokens=dict(zip(sampling, greedy)),
                             prompt_logits=_prompt_logits(logits, spans))

    @torch.inference_mode()
    def launch(self, inputs: TpInputs) -> "PendingForward":
        """Enqueue one forward on the device and return at once (CUDA; on the CPU it is done).

        Raises ValueError, before anything is enqueued, for token ids outside the vocabulary
        or positions past the model's (the device forward does not check them). In-flight
        inputs (overlap) take the previous launch's picks on the device, never via the host.
        The host does not wait for the device here: the inputs are copied from pinned buffers,
        and the forward waits on the device for the KV storage's pending host-tier copies (the
        exceptions, a graph captured at first use and a staging buffer still in use, are listed
        in ``benchmarks/results/h200/serving/sync_audit.md``).
        """
        if self.device.type == "cpu":
            return PendingForward.ready(self._run_cpu(inputs))
        ids = np.asarray(inputs.input_ids, dtype=np.int64)
        slots = [flat for flat, _ in inputs.in_flight]
        if slots:
            ids[slots] = 0  # the previous launch's picks are written over them on the device
        positions = np.asarray(inputs.position_ids, dtype=np.int64)
        config = self.model.config
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {config.vocab_size})")
        if positions.size and (positions.min() < 0 or positions.max() >= config.max_position_embeddings):
            raise ValueError(f"position_ids must lie in [0, {config.max_position_embeddings})")
        rows, sampling, spans = inputs.logit_rows()  # prompt rows after the sampling rows: picks ignore them

        size = None
        if self.graph_runner is not None and all(inputs.samples) and not spans:
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
                storage.before_compute(inputs.block_tables)
                if self.time_forwards:
                    start = _record_event()
                logits, tokens = self._forward_eager(plan, ids, positions, rows, fill)
        self._device_picks = (dict(zip(sampling, range(len(sampling)))), tokens)
        pending = PendingForward.launch(sampling, logits, tokens, start)
        pending.prompt_logits = _prompt_logits(logits, spans)
        return pending

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
        return host_to_device(array, self.device, self._staging)

    def _plan(self, inputs: TpInputs) -> PagedAttentionPlan:
        return build_plan(
            inputs.num_new_tokens,
            inputs.num_cached_tokens,
            inputs.block_tables,
            tokens_per_block=self.kv_cache_manager.tokens_per_block,
            num_blocks=self.kv_cache_manager.num_blocks,
            num_kv_heads=self.model.num_local_kv_heads,
            device=self.device,
            staging=self._staging,
        )

    def _forward_eager(self, plan: PagedAttentionPlan, ids: np.ndarray, positions: np.ndarray, rows: list[int], fill=None):
        storage = self.kv_cache_manager.storage
        ids_device = self._to_device(ids)
        if fill is not None:
            ids_device.index_copy_(0, *fill)
        hidden = self.model.forward_with_plan(
            ids_device, self._to_device(positions), plan, storage.k_cache, storage.v_cache
        )  # (T, hidden)
        if not rows:
            return hidden.new_empty((0, self.vocab_size)), torch.empty(0, dtype=torch.int64, device=self.device)
        if rows == list(range(len(rows))) and len(rows) == hidden.shape[0]:
            sampled = hidden  # every row samples (a decode batch)
        else:
            sampled = hidden.index_select(0, self._to_device(np.asarray(rows, dtype=np.int64)))
        logits = self.model.compute_logits(sampled)  # (rows, vocab)
        return logits, logits.argmax(dim=-1)


class PendingForward:
    """A forward in flight. ``result()`` waits for its greedy tokens to reach the host (not for
    anything enqueued after it) and returns the :class:`ForwardOutput`.

    The logits rows it hands out are device tensors, valid until the engine's next forward of
    the same graph size (they may live in a CUDA graph's static output).
    """

    __slots__ = ("_output", "_event", "_start", "_tokens_host", "_request_ids", "_logits", "_compute", "_previous",
                 "_error", "num_tokens", "prompt_logits")

    def __init__(self) -> None:
        self._output: ForwardOutput | None = None
        self._compute: Callable[[], ForwardOutput] | None = None
        self._previous: PendingForward | None = None
        self._error: BaseException | None = None
        self.num_tokens = 0  # positions in the forward
        self._event = None
        self._start = None
        self._tokens_host = None
        self._request_ids: list[int] = []
        self._logits = None
        self.prompt_logits: dict[int, tuple[int, torch.Tensor]] | None = None  # device rows (see ForwardOutput)

    @classmethod
    def ready(cls, output: ForwardOutput) -> "PendingForward":
        pending = cls()
        pending._output = output
        return pending

    @classmethod
    def deferred(cls, compute: Callable[[], ForwardOutput], previous: "PendingForward | None") -> "PendingForward":
        """A host forward that runs when its result is first asked for, after ``previous``."""
        pending = cls()
        pending._compute = compute
        pending._previous = previous
        return pending

    def picks(self) -> Mapping[int, int]:
        """The engine's token for each request that sampled (waits for the forward); empty if it failed."""
        try:
            return self.result().greedy_tokens or {}
        except Exception:
            return {}

    @classmethod
    def launch(
        cls, request_ids: list[int], logits: torch.Tensor, tokens: torch.Tensor, start: torch.cuda.Event | None = None
    ) -> "PendingForward":
        """Enqueue the copy of ``tokens`` (device) to pinned host memory and an event after it;
        ``start``: an event recorded before the forward's first kernel (timing)."""
        pending = cls()
        pending._start = start
        pending._request_ids = request_ids
        pending._logits = logits
        pending._tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.numel() > 0)
        if tokens.numel():
            # one copy carries the picks and the finiteness check: -1 for a row with NaN or inf
            checked = torch.where(torch.isfinite(logits).all(dim=-1), tokens, torch.full_like(tokens, -1))
            pending._tokens_host.copy_(checked, non_blocking=True)
        pending._event = _record_event()
        return pending

    @property
    def events(self) -> tuple | None:
        """(start, end) CUDA events of the forward (engines with ``time_forwards``), else None."""
        return (self._start, self._event) if self._start is not None else None

    def done(self) -> bool:
        """True once the result can be had without waiting."""
        return self._output is not None or (self._event is not None and self._event.query())

    def device_time_ms(self) -> float | None:
        """The forward's device time (engines with ``time_forwards``), once ``result()`` returned."""
        if self._start is None or self._output is None:
            return None
        return self._start.elapsed_time(self._event)

    def result(self) -> ForwardOutput:
        if self._error is not None:
            raise self._error
        if self._output is None and self._compute is not None:
            compute, previous, self._compute, self._previous = self._compute, self._previous, None, None
            if previous is not None:
                previous.picks()  # launch order: the previous forward runs first (its failure is its own)
            try:
                self._output = compute()
            except BaseException as error:
                self._error = error
                raise
        if self._output is None:
            self._event.synchronize()
            tokens = self._tokens_host.tolist()  # -1: a row that is not finite (see launch)
            self._output = ForwardOutput(
                logits=dict(zip(self._request_ids, self._logits)),
                greedy_tokens=dict(zip(self._request_ids, tokens)),
                nonfinite={rid for rid, token in zip(self._request_ids, tokens) if token < 0},
                prompt_logits=self.prompt_logits,
            )
        return self._output


def _prompt_logits(logits: torch.Tensor, spans) -> dict[int, tuple[int, torch.Tensor]] | None:
    """Each prompt span's rows of ``logits`` (see :meth:`TpInputs.logit_rows`), keyed by request id."""
    if not spans:
        return None
    return {rid: (start, logits[first : first + count]) for rid, start, first, count in spans}


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
