"""``LLM``: a torch model served by a background executor (an ``ExecutorClient``: one rank or
several), driven with text or token ids."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import torch

from tensorrt_llm._torch.distributed.multi_rank_executor import MultiRankExecutor
from tensorrt_llm._torch.distributed.torchrun import TorchrunEnv, TorchrunGroup, follow
from tensorrt_llm._torch.distributed.worker import serve_config, serve_rank
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.errors import RequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig
from tensorrt_llm._torch.pyexecutor.executor_client import ExecutorClient, Health, Response
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.llmapi.llm_utils import describe_checkpoint, load_model, seeded_model
from tensorrt_llm.llmapi.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

_EXECUTOR_FIELDS = {f.name for f in dataclasses.fields(ExecutorConfig)}


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings (greedy by default)."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # default: the tokenizer's eos id
    stop_token_ids: Sequence[int] = ()  # added to the tokenizer's end-of-generation ids
    ignore_eos: bool = False  # generate max_tokens whatever the model says (only stop_token_ids stop it)
    beam_width: int = 1

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error"
    # With a tokenizer: the text of token_ids so far (control tokens left out; a character whose
    # bytes have not all arrived is held back until they do), and what the last step added to it.
    text: str | None = None
    text_diff: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    prompt: str | None = None  # the prompt text, when the prompt was text

    @property
    def text(self) -> str | None:
        """The generated text (None for a model without a tokenizer)."""
        return self.outputs[0].text


class RequestOutputHandle:
    """A submitted request: iterate it to stream, ``result()`` to wait, ``abort()`` to cancel.

    A handle created inside a running asyncio event loop is consumed from that loop with
    ``async for`` and ``await aresult()``: each response crosses from the executor thread
    with ``loop.call_soon_threadsafe``, so the loop never blocks on the executor. Any other
    handle is consumed with ``for`` and ``result()``.
    """

    def __init__(self, llm: "LLM", request: LlmRequest, prompt: str | None = None) -> None:
        self._llm = llm
        self._request = request
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._events: queue.Queue[Response] | None = None if self._loop else queue.Queue()
        self._aevents: asyncio.Queue[Response] | None = asyncio.Queue() if self._loop else None
        self.output = RequestOutput(
            request.request_id, list(request.input_token_ids), [CompletionOutput(0)], prompt=prompt
        )
        tokenizer = llm.tokenizer
        self._detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        if tokenizer is not None:
            self.output.outputs[0].text = ""

    @property
    def request_id(self) -> int:
        return self._request.request_id

    def _on_response(self, request: LlmRequest, response: Response) -> None:
        """Runs on the executor thread; never blocks, never raises into it."""
        if self._loop is None:
            self._events.put(response)
            return
        try:
            self._loop.call_soon_threadsafe(self._aevents.put_nowait, response)
        except RuntimeError:  # the event loop is closed: nobody is waiting for this request any more
            pass

    def _apply(self, response: Response) -> None:
        """Fold one executor response into ``output``. Text that cannot be decoded (an id the
        tokenizer does not know) fails this request alone, as an executor error would: it is
        cancelled in the executor and its output finishes with a DetokenizationError."""
        completion = self.output.outputs[0]
        completion.token_ids.extend(response.new_token_ids)
        finished, error = response.finished, response.error
        if self._detokenizer is not None:
            try:
                completion.text_diff = self._detokenizer.step(response.new_token_ids)
                if finished:
                    completion.text_diff += self._detokenizer.flush()
            except Exception as failure:  # noqa: BLE001 - whatever decoding raises is this request's alone
                completion.text_diff = ""
                error = error or f"DetokenizationError: request {self.request_id}: {type(failure).__name__}: {failure}"
                logger.error("%s", error)
                if not finished:
                    finished = True
                    self.abort()  # the executor stops generating for it; what it still sends is not read
            completion.text += completion.text_diff
        if finished:
            self.output.finished = True
            self.output.error = error
            if error:
                completion.finish_reason = "error"
            elif response.cancelled:
                completion.finish_reason = "cancelled"
            elif len(completion.token_ids) >= self._request.max_new_tokens:
                completion.finish_reason = "length"
            else:
                completion.finish_reason = "stop"

    def __iter__(self) -> Iterator[RequestOutput]:
        """Yields the output after each step that changed it, until it is finished."""
        self._check_mode(asynchronous=False)
        while not self.output.finished:
            self._apply(self._events.get())
            yield self.output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """``__iter__`` for a handle created in an event loop, awaited on that loop."""
        self._check_mode(asynchronous=True)
        while not self.output.finished:
            self._apply(await self._aevents.get())
            yield self.output

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the final output; raises RequestError if the request failed."""
        self._check_mode(asynchronous=False)
        while not self.output.finished:
            self._apply(self._events.get(timeout=timeout))
        return self._final()

    async def aresult(self) -> RequestOutput:
        """``result()`` for a handle created in an event loop."""
        self._check_mode(asynchronous=True)
        while not self.output.finished:
            self._apply(await self._aevents.get())
        return self._final()

    def _final(self) -> RequestOutput:
        if self.output.error:
            raise RequestError(self.request_id, self.output.error)
        return self.output

    def _check_mode(self, *, asynchronous: bool) -> None:
        if asynchronous != (self._loop is not None):
            how = "async for / await aresult()" if self._loop else "for / result()"
            raise RuntimeError(f"request {self.request_id}: this handle is consumed with {how}")

    def abort(self) -> None:
        self._llm.executor.cancel_request(self.request_id)


Prompt = str | Sequence[int]


class LLM:
    """Serve a Llama model on the CPU (default) or a GPU (``device="cuda"``, ``bfloat16`` unless
    ``dtype`` says otherwise, DESIGN.md §7): a real checkpoint (``"smollm2-135m-instruct"``, a path to a
    llama-architecture ``.gguf`` file) with its tokenizer, or a random-weight preset
    (``"tiny-random"``, ``"small-random"``) that takes token ids only (``llm_utils.load_model``).

    Prompts are text (encoded with ``tokenizer``) or token ids. With a tokenizer, generation stops
    at the model's end-of-generation ids by default (``SamplingParams.ignore_eos`` turns that off)
    and outputs carry ``text``. Every :class:`ExecutorConfig` field is accepted as a keyword
    (``max_num_tokens``, ``enable_chunked_prefill``, ``token_budget_policy``, ``kv_cache_config``, ...).

    ``tensor_parallel_size=N`` (> 1) starts N rank processes (gloo on loopback) that shard the
    model, with rank 0 taking the requests; with ``enable_attention_dp`` each rank serves its
    own share of the requests on a full replica instead. ``generate`` works the same either
    way. The ranks are spawned: a script that builds such an LLM needs the usual
    ``if __name__ == "__main__":`` guard. Each rank draws a random-weight model from its seed,
    or reads a checkpoint's file, and keeps its shard; a model whose heads do not split over
    N ranks is refused before any rank starts (SmolLM2-135M: 9 query and 3 KV heads, so 3 ranks
    and not 2). On the CPU only. In a process ``torchrun`` started (``env://``: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), nothing is spawned: this process is rank 0
    of the launch, and the other ranks, on this host or others, run :func:`follow_rank0` with the
    same arguments (``trtllm-serve`` does both). ``check_decisions``: the ranks compare a digest of
    their decisions before every forward.

    ``device="auto"`` (the default) serves on the GPU when torch sees one and on the CPU otherwise.
    ``max_seq_len`` defaults to the model's ``max_position_embeddings``, lowered to what the KV
    pool holds for one sequence (as upstream derives it from the checkpoint and the pool);
    asking for more than the model's positions is an error. ``describe()`` says which won.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LlamaConfig = "tiny-random",
        *,
        dtype: str | None = None,
        seed: int | None = None,
        device: str = "auto",
        tensor_parallel_size: int = 1,
        enable_attention_dp: bool = False,
        check_decisions: bool = False,
        **executor_options,
    ) -> None:
        unknown = set(executor_options) - _EXECUTOR_FIELDS
        if unknown:
            raise TypeError(f"LLM got unknown options {sorted(unknown)}; accepted: {sorted(_EXECUTOR_FIELDS)}")
        config = ExecutorConfig(**executor_options)
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        device = resolve_device(device, ranks=tensor_parallel_size)
        if dtype is None and device.type == "cuda":
            dtype = "bfloat16"  # DESIGN.md §7
        self.device = device
        self._executor: ExecutorClient
        self._pool_blocks: int | None = None  # one rank: its pool, sized here (several ranks size their own)
        if tensor_parallel_size > 1:
            if device.type != "cpu":
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} runs on the CPU only (gloo ranks),"
                                 f" not on {device.type}")
            rank_model = _rank_model(model, dtype=dtype, seed=seed)
            self.model_id, self.model_config, self.tokenizer = rank_model.model_id, rank_model.config, rank_model.tokenizer
            self.config = _cap_max_seq_len(config, executor_options, self.model_config)
            try:
                self._executor = MultiRankExecutor(
                    self.model_config, self.config, tensor_parallel_size=tensor_parallel_size,
                    enable_attention_dp=enable_attention_dp, check_decisions=check_decisions,
                    checkpoint=rank_model.checkpoint,
                    group=_torchrun_group(self.config, enable_attention_dp),
                )
            except ValueError as error:  # an unshardable model: say which, before any rank starts
                raise ValueError(f"model {self.model_id!r} cannot run on {tensor_parallel_size} ranks: {error}") from None
            self.max_seq_len_source = _max_seq_len_source(self.config, executor_options, self.model_config, None)
        else:
            loaded = load_model(model, dtype=dtype, seed=seed, device=device)
            self.model_id = loaded.model_id  # the served name: the preset's, or the .gguf file's stem
            self.tokenizer = loaded.tokenizer  # None for random-weight models
            self.model_config = loaded.model.config
            given = "max_seq_len" in executor_options
            ceiling = _cap_max_seq_len(config, executor_options, self.model_config)
            if not given:  # the model's positions, then lowered to what the pool holds (below)
                ceiling = dataclasses.replace(ceiling, max_seq_len=self.model_config.max_position_embeddings)
            executor = create_py_executor(ceiling, model=loaded.model, fit_max_seq_len_to_pool=not given)
            self._executor, self.config = executor, executor.config
            self._pool_blocks = executor.kv_cache_manager.num_blocks
            pool_tokens = self._pool_blocks * self.config.kv_cache_config.tokens_per_block
            self.max_seq_len_source = _max_seq_len_source(self.config, executor_options, self.model_config, pool_tokens)
        logger.info("%s", self.describe())
        self._executor.start()

    def describe(self) -> str:
        """One line for a start-up log: the model, device, dtype, KV pool and ``max_seq_len``
        (with the limit that set it)."""
        kv = self.config.kv_cache_config
        line = f"model {self.model_id} on {self.device} ({self.model_config.dtype})"
        blocks = self._pool_blocks
        if blocks is not None:
            gib = blocks * kv.tokens_per_block * self.model_config.kv_bytes_per_token / 2**30
            line += f", KV pool {blocks} blocks x {kv.tokens_per_block} tokens = {blocks * kv.tokens_per_block} tokens ({gib:.2f} GiB)"
        return line + f", max_seq_len {self.config.max_seq_len} ({self.max_seq_len_source})"

    def generate_async(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestOutputHandle:
        request = self._make_request(prompt, sampling_params or SamplingParams())
        self._executor.validate(request)
        return self._submit([request], [prompt])[0]

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a list of prompts (each text or token ids); raises ValueError
        before queueing anything if any prompt is invalid, RequestError if one fails while running."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        requests = [self._make_request(prompt, params) for prompt in batch]
        for request in requests:
            self._executor.validate(request)
        handles = self._submit(requests, batch)
        outputs, first_error = [], None
        for handle in handles:
            try:
                outputs.append(handle.result())
            except RequestError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error
        return outputs[0] if single else outputs

    def health(self) -> Health:
        return self._executor.health()

    @property
    def executor(self) -> ExecutorClient:
        """The executor serving this LLM, one rank or several alike (health, load, statistics,
        iteration listeners)."""
        return self._executor

    @property
    def iteration_stats(self):
        return self._executor.iteration_stats

    def shutdown(self) -> None:
        self._executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _submit(self, requests: list[LlmRequest], prompts: list[Prompt]) -> list[RequestOutputHandle]:
        """One submission: the executor fetches all of ``requests`` in the same iteration."""
        handles = [RequestOutputHandle(self, r, p if isinstance(p, str) else None) for r, p in zip(requests, prompts)]
        self._executor.enqueue_requests([(r, h._on_response) for r, h in zip(requests, handles)])
        return handles

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> LlmRequest:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_id!r} has no tokenizer, so text prompts are refused: pass token ids"
                )
            prompt = self.tokenizer.encode(prompt)
        try:
            token_ids = [int(t) if not isinstance(t, bool) else None for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"a prompt must be a sequence of token ids, got {prompt!r:.80}") from None
        if any(t is None or t != raw for t, raw in zip(token_ids, prompt)):
            raise ValueError(f"a prompt must hold integer token ids, got {prompt!r:.80}")
        end_id, stop_token_ids = self._stop_ids(params)
        return LlmRequest(
            input_token_ids=token_ids,
            max_new_tokens=params.max_tokens,
            beam_width=params.beam_width,
            end_id=end_id,
            stop_token_ids=stop_token_ids,
            sampling_config=params.sampling_config(),
        )

    def _stop_ids(self, params: SamplingParams) -> tuple[int | None, tuple[int, ...]]:
        """The ids that end a request: the caller's, plus the model's unless ``ignore_eos``."""
        stop = tuple(params.stop_token_ids)
        if params.ignore_eos or self.tokenizer is None:
            return (None if params.ignore_eos else params.end_id), stop
        end_id = self.tokenizer.eos_token_id if params.end_id is None else params.end_id
        return end_id, stop + tuple(t for t in self.tokenizer.stop_token_ids if t not in stop)


def _cap_max_seq_len(config: ExecutorConfig, options: dict, model: LlamaConfig) -> ExecutorConfig:
    """``max_seq_len`` within the model's ``max_position_embeddings``: the default is lowered to it
    (RoPE positions beyond it were never trained); a larger value asked for is an error."""
    limit = model.max_position_embeddings
    if config.max_seq_len <= limit:
        return config
    if "max_seq_len" in options:
        raise ValueError(f"max_seq_len={config.max_seq_len} exceeds the model's max_position_embeddings ({limit})")
    return dataclasses.replace(config, max_seq_len=limit)


def _max_seq_len_source(config: ExecutorConfig, options: dict, model: LlamaConfig, pool_tokens: int | None) -> str:
    """Which limit set ``config.max_seq_len``, in words for the start-up log."""
    if "max_seq_len" in options:
        return "as configured"
    if config.max_seq_len == model.max_position_embeddings:
        return "the model's max_position_embeddings"
    if config.max_seq_len == pool_tokens:
        return f"what the KV pool holds for one sequence; the model has {model.max_position_embeddings} positions"
    return "ExecutorConfig's default"  # several ranks keep it (each rank sizes its own pool)


def resolve_device(device: str | torch.device, *, ranks: int = 1) -> torch.device:
    """``"auto"``: the GPU when torch sees one (as upstream serves), the CPU otherwise; several
    ranks run on CPU gloo ranks. Otherwise ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; a GPU that
    is not there is a ValueError."""
    if device == "auto":
        if ranks > 1 and torch.cuda.is_available():
            logger.warning("device auto with %d ranks: the ranks run on the CPU (gloo); NCCL ranks are not built yet", ranks)
        return torch.device("cuda" if torch.cuda.is_available() and ranks == 1 else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA GPU, and torch sees none")
    return device


@dataclass(frozen=True, slots=True)
class _RankModel:
    """What every rank builds its shard from: a seed-drawn preset, or a checkpoint file each
    rank reads (only its metadata is read by the process that serves)."""

    model_id: str
    config: LlamaConfig
    tokenizer: Tokenizer | None
    checkpoint: str | None


def _rank_model(model, *, dtype: str | None, seed: int | None) -> _RankModel:
    seeded = seeded_model(model, dtype=dtype, seed=seed)
    if seeded is not None:
        return _RankModel(seeded[0], seeded[1], None, None)
    checkpoint = describe_checkpoint(model, dtype=dtype, seed=seed)
    return _RankModel(checkpoint.model_id, checkpoint.config, checkpoint.tokenizer, os.fspath(checkpoint.path))


def _torchrun_group(config: ExecutorConfig, enable_attention_dp: bool) -> TorchrunGroup | None:
    """Rank 0's group when this process was started by ``torchrun`` (``env://``), else None
    (the ranks are spawned here)."""
    launch = TorchrunEnv.from_environ()
    if launch is None or launch.world_size == 1:
        return None
    if enable_attention_dp:
        raise ValueError("enable_attention_dp is not supported under torchrun yet: each rank's responses and"
                         " statistics would have to reach rank 0; use tensor parallelism, or spawned ranks")
    # a follower is dead once its heartbeat has been silent as long as a stalled loop may be
    return TorchrunGroup(launch, dead_after_s=config.health_check_timeout_s)


def follow_rank0(
    model: str | os.PathLike[str] = "tiny-random",
    *,
    dtype: str | None = None,
    seed: int | None = None,
    device: str = "auto",
    tensor_parallel_size: int | None = None,
    enable_attention_dp: bool = False,
    check_decisions: bool = False,
    **executor_options,
) -> int:
    """A ``torchrun`` rank other than 0: build this rank's shard and executor from the same
    arguments rank 0's :class:`LLM` got, and step with the group until rank 0 stops it
    (:func:`~tensorrt_llm._torch.distributed.torchrun.follow`). Returns the group iterations run."""
    launch = TorchrunEnv.from_environ()
    if launch is None or launch.rank == 0:
        raise ValueError("follow_rank0 runs on a torchrun rank other than 0 (RANK > 0 in the environment)")
    if tensor_parallel_size not in (None, launch.world_size):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, but torchrun started {launch.world_size} ranks")
    if enable_attention_dp:
        raise ValueError("enable_attention_dp is not supported under torchrun yet")
    if resolve_device(device, ranks=launch.world_size).type != "cpu":
        raise ValueError("ranks run on the CPU only (gloo)")
    unknown = set(executor_options) - _EXECUTOR_FIELDS
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; accepted: {sorted(_EXECUTOR_FIELDS)}")
    rank_model = _rank_model(model, dtype=dtype, seed=seed)
    config = _cap_max_seq_len(ExecutorConfig(**executor_options), executor_options, rank_model.config)
    job = serve_config(rank_model.config, config, check_decisions=check_decisions, checkpoint=rank_model.checkpoint)
    return follow(launch, lambda ctx: serve_rank(ctx, job))
