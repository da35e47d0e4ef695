"""``LLM``: a torch model served by a background executor (an ``ExecutorClient``: one rank or
several), driven with text or token ids; ``SamplingParams``, what each request asks for. What a
submitted request gives back lives in ``request_output``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Mapping, Sequence

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales
from tensorrt_llm._torch.distributed.multi_rank_executor import MultiRankExecutor
from tensorrt_llm._torch.distributed.torchrun import TorchrunEnv, TorchrunGroup, follow
from tensorrt_llm._torch.distributed.worker import serve_config, serve_rank
from tensorrt_llm._torch.models.checkpoints import KvCacheQuantization
from tensorrt_llm._torch.models.linear_formats import LinearFormats
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.config import DEFAULT_PRIORITY, ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.simulated import (
    LinearForwardTime,
    SimulatedEngineConfig,
    SimulatedModelEngine,
    SleepingClock,
)
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tensorrt_llm._torch.pyexecutor.errors import KVCacheEventsDisabled, RequestError
from tensorrt_llm._torch.pyexecutor.executor.client import ExecutorClient, Health
from tensorrt_llm._torch.pyexecutor.sampling.guided_decoder import GrammarCompiler, GuidedDecodingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, check_priority
from tensorrt_llm._torch.pyexecutor.sampling_config import SEED_LIMIT, SamplingConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.llmapi.config_fields import build_nested, from_mapping
from tensorrt_llm.llmapi.kv_cache_events import event_dict
from tensorrt_llm.llmapi.llm_args import KVEventsConfig, check_batch_invariant
from tensorrt_llm.llmapi.llm_utils import (
    GenerationDefaults,
    describe_checkpoint,
    derived_kv_scales,
    kv_scales_to_use,
    load_model,
    seeded_model,
)
from tensorrt_llm.llmapi.request_output import (  # noqa: F401 - CompletionOutput: re-exported (tensorrt_llm.llmapi)
    CompletionOutput,
    RequestOutput,
    RequestOutputHandle,
)
from tensorrt_llm.llmapi.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_EXECUTOR_FIELDS = {f.name for f in dataclasses.fields(ExecutorConfig)}


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings (greedy by default).

    ``n``: samples returned; ``best_of`` (>= n): samples drawn, of which the ``n`` with the
    highest cumulative log-probability are returned (upstream's meaning when beam search is
    off). Each sample is a request of its own, charged by the token budget like any other: the
    first computes the prompt, the others are submitted once it has, and claim its prompt blocks
    from the prefix cache (``enable_block_reuse``) instead of recomputing them. With a ``seed``,
    sample ``i`` draws with ``seed + i``.

    Beam search (upstream's meaning): ``use_beam_search`` searches with ``best_of`` beams
    (default ``n``) and returns the ``n`` best; ``beam_width`` > 1 does the same without
    ``use_beam_search`` (``n`` of its beams returned). One request runs every beam (charged
    ``beam_width`` positions a step); ``length_penalty`` (default 0: none) and ``early_stopping``
    (0, 1 = default, 2 = "never") as upstream's; see ``beam_search``. Beam search ranks the model's
    log-probabilities: temperature, top-k/top-p/min-p, penalties, ``min_tokens``, ``logprobs`` and
    ``guided_decoding`` do not combine with it (refused).

    Penalties, ``min_tokens`` and ``logprobs``: see ``SamplingConfig``. ``guided_decoding``:
    structured output (``GuidedDecodingParams``; needs the model's tokenizer).
    """

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off; see SamplingConfig
    seed: int | None = None
    end_id: int | None = None  # default: the tokenizer's eos id
    stop_token_ids: Sequence[int] = ()  # added to the tokenizer's end-of-generation ids
    ignore_eos: bool = False  # generate max_tokens whatever the model says (only stop_token_ids stop it)
    beam_width: int = 1
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives reported beside each sampled token's log-probability
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (no prefix reuse then)
    guided_decoding: GuidedDecodingParams | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None  # beam search: None = upstream's default, 0
    early_stopping: int | None = None  # beam search: None = upstream's default, 1

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= MAX_SAMPLES):
            raise ValueError(f"best_of must be an integer in [n, {MAX_SAMPLES}] (n={self.n}), got {self.best_of!r}")
        if self.guided_decoding is not None and self.ignore_eos:
            # a complete document leaves the grammar nothing but its end token: it must end the output
            raise ValueError("guided_decoding ends the output with the end-of-generation token; ignore_eos cannot be honoured")
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.use_beam_search and self.beam_width > 1 and self.best_of not in (None, self.beam_width):
            raise ValueError(f"beam_width ({self.beam_width}) and best_of ({self.best_of}) disagree on the number of beams")
        if self.is_beam_search:
            self._check_beam_search()

    @property
    def search_width(self) -> int:
        """Beams searched: ``best_of`` (or ``n``) with ``use_beam_search``, else ``beam_width``; 1: no beam search."""
        if self.use_beam_search:
            return self.best_of or (self.beam_width if self.beam_width > 1 else self.n)
        return self.beam_width

    @property
    def is_beam_search(self) -> bool:
        return self.search_width > 1

    def _check_beam_search(self) -> None:
        if self.n > self.search_width:
            raise ValueError(f"n ({self.n}) must be at most the number of beams ({self.search_width})")
        if not self.use_beam_search and self.best_of is not None:
            raise ValueError("best_of with beam_width > 1: set use_beam_search (best_of is then the beam width)")
        unsupported = [name for name, on in (
            ("temperature", self.temperature > 0), ("top_k", self.top_k > 1), ("top_p", self.top_p < 1.0),
            ("min_p", self.min_p > 0),
            ("presence_penalty", bool(self.presence_penalty)), ("frequency_penalty", bool(self.frequency_penalty)),
            ("repetition_penalty", self.repetition_penalty != 1.0), ("min_tokens", self.min_tokens > 0),
            ("logprobs", self.logprobs is not None), ("guided_decoding", self.guided_decoding is not None),
        ) if on]
        if unsupported:
            raise ValueError(f"beam search ranks the model's log-probabilities; {', '.join(unsupported)}"
                             " cannot be combined with it")

    @property
    def num_samples(self) -> int:
        """Executor requests: ``best_of``, or ``n``; one for beam search (it runs every beam)."""
        if self.is_beam_search:
            return 1
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether more samples are drawn than returned (``best_of > n``), or beams searched: the
        outputs are known only at the end."""
        return self.is_beam_search or self.num_samples > self.n

    def sampling_config(self, index: int = 0) -> SamplingConfig:
        """Sample ``index``'s settings (its own seed; the log-probabilities ranking needs)."""
        logprobs = self.logprobs
        if logprobs is None and self.ranks_samples and not self.is_beam_search:
            logprobs = 0  # ranking reads each sampled token's log-probability
        return SamplingConfig(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            # sample 0 keeps the seed as given (SamplingConfig refuses one out of range); later ones wrap
            seed=self.seed if self.seed is None or index == 0 else (self.seed + index) % SEED_LIMIT,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,  # the samples share one prompt
            **self._beam_config(),
        )

    def _beam_config(self) -> dict:
        if not self.is_beam_search:
            return {}
        config = {"num_return_sequences": self.n}
        if self.length_penalty is not None:
            config["length_penalty"] = self.length_penalty
        if self.early_stopping is not None:
            config["early_stopping"] = int(self.early_stopping)
        return config


#: Most samples one request may ask for (n or best_of): each is a request of its own in the executor.
MAX_SAMPLES = 16


Prompt = str | Sequence[int]


class LLM:
    """Serve a Llama-style model on the CPU (default) or a GPU (``device="cuda"``; there a checkpoint
    runs in its own dtype and a preset in ``bfloat16`` unless ``dtype`` says otherwise): a Hugging
    Face checkpoint directory or hub id (Llama, Mistral, Qwen2, Qwen3; docs/models.md), a GGUF file
    (``"smollm2-135m-instruct"``, a path to a llama-architecture ``.gguf`` file) with its tokenizer,
    or a random-weight preset (``"tiny-random"``, ``"small-random"``) that takes token ids only
    (``llm_utils.load_model``).

    ``quantization`` (vLLM's name): a GGUF file's quantized weights, kept as stored (``"gguf"``: Q4_0,
    Q4_1 and Q8_0 blocks through torch's int4 kernel, bfloat16 activations, CPU only) or
    dequantized to ``dtype`` (``"none"``); unset, they are kept on the CPU when no ``dtype`` is
    given (the fastest format there) and dequantized otherwise (``llm_utils``).

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

    ``simulated_engine`` (a ``SimulatedEngineConfig`` or its mapping) runs no model: the model's
    config, tokenizer and generation defaults are read (no weights), the KV manager keeps books
    only, tokens come from ``SyntheticSampler`` and each forward sleeps what the config's cost
    formula says (replicas behind real HTTP at a device's latencies, on a small CPU machine).

    ``batch_invariant=True`` builds the model with the batch-invariant layers: a request's tokens
    and logprobs are then the same bits whatever else is in its batches, however its prompt is
    chunked or reused, at any thread count; CPU and one rank only (docs/determinism.md).

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
        simulated_engine: SimulatedEngineConfig | Mapping | None = None,
        kv_events_config: KVEventsConfig | dict | None = None,
        batch_invariant: bool = False,
        quantization: str | None = None,
        **executor_options,
    ) -> None:
        self.kv_events_config = _kv_events_config(kv_events_config)
        config = _with_event_buffer(_executor_config(executor_options), self.kv_events_config)
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        if simulated_engine is not None:
            if tensor_parallel_size > 1:
                raise ValueError("simulated_engine runs on one rank (tensor_parallel_size=1)")
            device = "cpu" if device == "auto" else device  # no model runs: nothing for a GPU to do
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        device = resolve_device(device, ranks=tensor_parallel_size)
        if batch_invariant:
            check_batch_invariant(str(device), tensor_parallel_size)
        if dtype is None and device.type == "cuda" and seeded_model(model) is not None:
            dtype = "bfloat16"  # DESIGN.md §7; a checkpoint runs in its own dtype there (llm_utils.default_dtype)
        self.device = device
        self.tensor_parallel_size = tensor_parallel_size
        self._executor: ExecutorClient
        self._pool_blocks: int | None = None  # one rank: its pool, sized here (several ranks size their own)
        self._kv_scales_line: str | None = None  # one rank: how FP8 scales derived at start-up came about
        self.kv_bytes_per_token: int | None = None  # one rank: what a token takes in its pool (KvCacheConfig.dtype)
        self._kv_stored: str | None = None  # one rank: the pool's element type
        self._linear_formats: LinearFormats | None = None  # one rank: what its linear layers store and run
        if tensor_parallel_size > 1:
            if device.type != "cpu":
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} runs on the CPU only (gloo ranks),"
                                 f" not on {device.type}")
            rank_model = _rank_model(model, dtype=dtype, seed=seed, quantization=quantization)
            self.model_id, self.model_config, self.tokenizer = rank_model.model_id, rank_model.config, rank_model.tokenizer
            self.generation_defaults = rank_model.generation_defaults
            self.config = _cap_max_seq_len(config, executor_options, self.model_config)
            # what each rank's pool gets from its own read of the checkpoint (worker.build_rank_executor)
            self.kv_scales = kv_scales_to_use(self.model_id, config.kv_cache_config.dtype, rank_model.kv_scales,
                                              rank_model.kv_cache_quantization,
                                              model_dtype=_kv_dtype(self.model_config))
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
        elif simulated_engine is not None:
            self._build_simulated(model, config, executor_options, simulated_engine, dtype=dtype, seed=seed)
        else:
            loaded = load_model(model, dtype=dtype, seed=seed, device=device, batch_invariant=batch_invariant,
                                quantization=quantization)
            self.model_id = loaded.model_id  # the served name: the preset's, or the .gguf file's stem
            self.tokenizer = loaded.tokenizer  # None for random-weight models
            self.generation_defaults = loaded.generation_defaults  # generation_config.json's sampling values
            self.model_config = loaded.model.config
            given = "max_seq_len" in executor_options
            ceiling = _cap_max_seq_len(config, executor_options, self.model_config)
            if not given:  # the model's positions, then lowered to what the pool holds (below)
                ceiling = dataclasses.replace(ceiling, max_seq_len=self.model_config.max_position_embeddings)
            self.kv_scales = kv_scales_to_use(self.model_id, config.kv_cache_config.dtype, loaded.kv_scales,
                                              loaded.kv_cache_quantization, model_dtype=_kv_dtype(self.model_config))
            if self.kv_scales is None and (derived := derived_kv_scales(loaded.model, loaded.tokenizer,
                                                                         config.kv_cache_config)) is not None:
                self.kv_scales, self._kv_scales_line = derived.scales, derived.describe()
            self._linear_formats = loaded.model.linear_formats  # what the weights are stored and run as
            executor = create_py_executor(ceiling, model=loaded.model, fit_max_seq_len_to_pool=not given,
                                          kv_scales=self.kv_scales)
            self._executor, self.config = executor, executor.config
            self._pool_blocks = executor.kv_cache_manager.num_blocks
            storage = executor.kv_cache_manager.storage
            self.kv_bytes_per_token, self._kv_stored = storage.bytes_per_token, str(storage.pools.dtype).removeprefix("torch.")
            pool_tokens = self._pool_blocks * self.config.kv_cache_config.tokens_per_block
            self.max_seq_len_source = _max_seq_len_source(self.config, executor_options, self.model_config, pool_tokens)
        logger.info("%s", self.describe())
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first guided request
        self._grammar_lock = threading.Lock()
        self.kv_event_publisher = None  # a ZmqEventPublisher when kv_events_config publishes
        if self.kv_events_config is not None and self.kv_events_config.publishes:
            from tensorrt_llm.llmapi.kv_event_publisher import ZmqEventPublisher  # pyzmq, only when asked for

            try:
                self.kv_event_publisher = ZmqEventPublisher(self._executor.get_kv_cache_events, self.kv_events_config)
            except Exception as error:  # an address in use: nothing may stay running
                self._executor.shutdown()
                raise ValueError(f"kv_events_config: cannot publish on {self.kv_events_config.endpoint}"
                                 f" / {self.kv_events_config.replay_endpoint}: {error}") from None
        self._executor.start()

    def _build_simulated(self, model, config: ExecutorConfig, options: dict,
                         simulated: SimulatedEngineConfig | Mapping, *, dtype: str | None, seed: int | None) -> None:
        """The simulated engine (``simulated_engine``): the model's config, tokenizer and generation
        defaults are read (a preset's, or a checkpoint's metadata: no weights are loaded); forwards
        sleep what ``simulated`` says the batch costs; tokens are ``SyntheticSampler``'s."""
        if isinstance(simulated, Mapping):
            simulated = from_mapping(SimulatedEngineConfig, simulated, path="simulated_engine")
        if self.device.type != "cpu":
            raise ValueError(f"simulated_engine runs no model: give device 'cpu' or 'auto', not {str(self.device)!r}")
        described = _rank_model(model, dtype=dtype, seed=seed)
        self.model_id, self.model_config, self.tokenizer = described.model_id, described.config, described.tokenizer
        self.generation_defaults, self.kv_scales = described.generation_defaults, None
        self.kv_bytes_per_token, self._kv_stored = self.model_config.kv_bytes_per_token, "none (simulated)"
        config = _cap_max_seq_len(config, options, self.model_config)
        if "max_seq_len" not in options:
            config = dataclasses.replace(config, max_seq_len=self.model_config.max_position_embeddings)
        timer, vocab_size = LinearForwardTime(simulated), self.model_config.vocab_size

        def engine(kv):
            return SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=vocab_size, clock=SleepingClock(),
                                        forward_time_s=timer)

        executor = create_py_executor(config, engine_factory=engine, sampler=SyntheticSampler(vocab_size),
                                      kv_bytes_per_token=self.kv_bytes_per_token,
                                      fit_max_seq_len_to_pool="max_seq_len" not in options)
        self._executor, self.config = executor, executor.config
        self._pool_blocks = executor.kv_cache_manager.num_blocks
        pool_tokens = self._pool_blocks * self.config.kv_cache_config.tokens_per_block
        self.max_seq_len_source = _max_seq_len_source(self.config, options, self.model_config, pool_tokens)

    def describe(self) -> str:
        """One line for a start-up log: the model, device, dtype, vocabulary (with how many ids the
        tokenizer lacks: they decode to ``''``), KV pool (an FP8 pool's scales: the checkpoint's or
        1.0) and ``max_seq_len`` (with the limit that set it)."""
        kv = self.config.kv_cache_config
        line = f"model {self.model_id} on {self.device} ({self.model_config.dtype}"
        formats = self._linear_formats
        line += "; linear layers: " + formats.describe() if formats is not None else ""
        line += ", batch-invariant)" if self.model_config.batch_invariant else ")"
        line += f", vocabulary {self.model_config.vocab_size}"
        if self.tokenizer is not None and self.tokenizer.num_padded_ids:
            line += (f" (tokenizer covers {self.tokenizer.num_tokens}; {self.tokenizer.num_padded_ids} ids"
                     " decode to '')")
        blocks = self._pool_blocks
        if blocks is not None:
            tokens, per_token = blocks * kv.tokens_per_block, self.kv_bytes_per_token
            line += (f", KV pool {blocks} blocks x {kv.tokens_per_block} tokens = {tokens} tokens"
                     f" ({tokens * per_token / 2**30:.2f} GiB, {self._kv_stored}, {per_token / 1024:g} KiB/token)")
        if kv.dtype == "fp8":
            scales = self.kv_scales
            line += ", KV scales " + (self._kv_scales_line or ("1.0" if scales is None
                                                             else f"from the checkpoint ({scales.describe()})"))
        return line + f", max_seq_len {self.config.max_seq_len} ({self.max_seq_len_source})"

    def default_sampling_params(self) -> SamplingParams:
        """What a request without ``SamplingParams`` runs with: the checkpoint's ``generation_config.json``
        values (``generation_defaults``) over ``SamplingParams``' own, as vLLM does."""
        return SamplingParams(**self.generation_defaults.sampling_kwargs())

    def generate_async(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, priority: float = DEFAULT_PRIORITY
    ) -> RequestOutputHandle:
        """Submit one prompt. ``priority`` in [0, 1] (upstream's meaning, 0.5 by default): who
        waits first under ``scheduler_config.waiting_queue_policy="priority"``; accepted and
        ignored under ``fcfs``."""
        params = sampling_params or self.default_sampling_params()
        requests = self._make_requests(prompt, params, _priorities(priority, 1)[0])
        for request in requests:
            self._executor.validate(request)
        return self._submit([requests], [prompt], params)[0]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        priority: float | Sequence[float] = DEFAULT_PRIORITY,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a list of prompts (each text or token ids); raises ValueError
        before queueing anything if any prompt is invalid, RequestError if one fails while running.
        ``priority``: one for every prompt, or one per prompt (see :meth:`generate_async`)."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = sampling_params or self.default_sampling_params()
        priorities = _priorities(priority, len(batch))
        requests = [self._make_requests(prompt, params, p) for prompt, p in zip(batch, priorities)]
        for samples in requests:
            for request in samples:
                self._executor.validate(request)
        handles = self._submit(requests, batch, params)
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

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict]:
        """The KV cache events since the last call, as upstream's dicts (``{"event_id", "data":
        {"type": "created" | "stored" | "removed" | "updated", ...}}``: ``llmapi/kv_cache_events.py``),
        oldest first; with none waiting, waits up to ``timeout`` seconds for one. Needs
        ``kv_cache_config.event_buffer_max_size > 0`` (``KVCacheEventsDisabled`` otherwise).
        Several ranks: rank 0's pool under tensor parallelism (it decides as every rank does);
        every rank's under attention DP, each dict with its ``attention_dp_rank``."""
        if self.kv_event_publisher is not None:
            raise KVCacheEventsDisabled(
                f"this LLM's KV cache events go to its ZMQ publisher ({self.kv_events_config.endpoint}), their one"
                " reader: subscribe there, or set kv_events_config.publisher: null to read them here")
        window = self.config.max_seq_len
        return [event_dict(record, window_size=window) for record in self._executor.get_kv_cache_events(timeout)]

    async def get_kv_cache_events_async(self, timeout: float | None = 2) -> AsyncIterator[dict]:
        """:meth:`get_kv_cache_events` as an async iterator (``async for event in ...``): the
        events as they come, until none comes for ``timeout`` seconds. The waiting happens on a
        worker thread: the event loop is never blocked."""
        while True:
            events = await asyncio.to_thread(self.get_kv_cache_events, timeout)
            if not events:
                return
            for event in events:
                yield event

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (both tiers) between two iterations: True when done (a KV
        cache event reader sees it cleared); False, changing nothing, while a request holds
        cached blocks. One rank only."""
        return self._executor.reset_prefix_cache()

    @property
    def executor(self) -> ExecutorClient:
        """The executor serving this LLM, one rank or several alike (health, load, statistics,
        iteration listeners)."""
        return self._executor

    @property
    def iteration_stats(self):
        return self._executor.iteration_stats

    def shutdown(self) -> None:
        """Stop the executor, then the KV event publisher (it sends what the pool emitted last)."""
        self._executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _submit(self, requests: list[list[LlmRequest]], prompts: list[Prompt],
                params: SamplingParams) -> list[RequestOutputHandle]:
        """One submission: the executor fetches the first sample of every prompt in the same
        iteration (each handle submits its other samples once its first has computed the prompt)."""
        handles = [RequestOutputHandle(self._executor, self.tokenizer, samples, p if isinstance(p, str) else None,
                                       keep=params.n, report_logprobs=params.logprobs is not None)
                   for samples, p in zip(requests, prompts)]
        self._executor.enqueue_requests([handle.first_submission() for handle in handles])
        return handles

    def _make_requests(self, prompt: Prompt, params: SamplingParams, priority: float = DEFAULT_PRIORITY) -> list[LlmRequest]:
        """One request per sample (``SamplingParams.num_samples``), all of the same prompt."""
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
        if self.tensor_parallel_size > 1 and (
                params.guided_decoding or params.logprobs is not None or params.prompt_logprobs is not None
                or params.ranks_samples):
            # The ranks sample; what comes back is tokens, neither matchers nor log-probabilities.
            raise ValueError("guided_decoding, logprobs, prompt_logprobs and best_of > n run with one rank only"
                             " (tensor_parallel_size=1)")
        if self.tensor_parallel_size > 1 and params.is_beam_search:
            raise ValueError("beam search runs with one rank only (tensor_parallel_size=1, no attention DP)")
        grammar = self.compile_grammar(params.guided_decoding) if params.guided_decoding is not None else None
        end_id, stop_token_ids = self._stop_ids(params)
        return [
            LlmRequest(
                input_token_ids=token_ids,
                max_new_tokens=params.max_tokens,
                beam_width=params.search_width,
                end_id=end_id,
                stop_token_ids=stop_token_ids,
                sampling_config=params.sampling_config(index),
                guided_grammar=grammar,
                priority=priority,
            )
            for index in range(params.num_samples)
        ]

    def compile_grammar(self, guided: GuidedDecodingParams):
        """The grammar of ``guided`` for this model's tokenizer (ValueError naming what is wrong).
        The compiler reads the vocabulary once, on the first guided request, and keeps recent
        grammars: a caller on an event loop runs this on a worker thread first, and
        ``generate_async`` then finds the grammar compiled."""
        if self.tokenizer is None:
            raise ValueError(f"guided_decoding needs a tokenizer and model {self.model_id!r} has none")
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, vocab_size=self.model_config.vocab_size, end_ids=self.tokenizer.stop_token_ids)
        return self._grammar_compiler.compile(guided)

    def _stop_ids(self, params: SamplingParams) -> tuple[int | None, tuple[int, ...]]:
        """The ids that end a request: the caller's, plus the model's unless ``ignore_eos``."""
        stop = tuple(params.stop_token_ids)
        if params.ignore_eos or self.tokenizer is None:
            return (None if params.ignore_eos else params.end_id), stop
        end_id = self.tokenizer.eos_token_id if params.end_id is None else params.end_id
        return end_id, stop + tuple(t for t in self.tokenizer.stop_token_ids if t not in stop)


def _priorities(priority: float | Sequence[float], count: int) -> list[float]:
    """``priority`` for each of ``count`` prompts: one value for all, or a sequence of one per
    prompt; ValueError naming ``priority`` for anything else, or a value outside [0, 1]."""
    values = [priority] * count if not isinstance(priority, Sequence) or isinstance(priority, str) else list(priority)
    if len(values) != count:
        raise ValueError(f"priority has {len(values)} values for {count} prompts: give one, or one per prompt")
    return [check_priority(value) for value in values]


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
    generation_defaults: GenerationDefaults = GenerationDefaults()
    kv_scales: KvScales | None = None  # the checkpoint's (each rank reads them again with its weights)
    kv_cache_quantization: KvCacheQuantization | None = None


def _rank_model(model, *, dtype: str | None, seed: int | None, quantization: str | None = None) -> _RankModel:
    """Every rank dequantizes a GGUF file (its shards are slices of dense weights): quantization='gguf' is refused."""
    if quantization == "gguf":
        raise ValueError("quantization='gguf' runs on one rank: tensor-parallel ranks shard dequantized weights"
                         " (quantization='none')")
    seeded = seeded_model(model, dtype=dtype, seed=seed)
    if seeded is not None:
        return _RankModel(seeded[0], seeded[1], None, None)
    checkpoint = describe_checkpoint(model, dtype=dtype, seed=seed, quantization="none")
    return _RankModel(checkpoint.model_id, checkpoint.config, checkpoint.tokenizer, os.fspath(checkpoint.path),
                      checkpoint.generation_defaults, checkpoint.kv_scales, checkpoint.kv_cache_quantization)


def _kv_dtype(config: LlamaConfig) -> str:
    """What an unquantized (``auto``) KV pool stores for ``config``, in words."""
    return str(config.torch_dtype).removeprefix("torch.")


_TORCHRUN_ATTENTION_DP = ("enable_attention_dp is not supported under torchrun yet: each rank's responses and"
                          " statistics would have to reach rank 0; use tensor parallelism, or spawned ranks")


def _executor_config(executor_options: dict) -> ExecutorConfig:
    """``ExecutorConfig`` from ``LLM(...)``'s executor keywords; an unknown one is a TypeError. A
    nested config may be given as its object or as the mapping the YAML holds
    (``speculative_config={"decoding_type": "NGram", "max_draft_len": 4}``)."""
    unknown = set(executor_options) - _EXECUTOR_FIELDS
    if unknown:
        raise TypeError(f"LLM got unknown options {sorted(unknown)}; accepted: {sorted(_EXECUTOR_FIELDS)}")
    return ExecutorConfig(**build_nested(ExecutorConfig, executor_options))


def _kv_events_config(given: KVEventsConfig | dict | None) -> KVEventsConfig | None:
    """``kv_events_config`` as given: its object, the mapping the YAML holds, or None."""
    if given is None or isinstance(given, KVEventsConfig):
        return given
    from tensorrt_llm.llmapi.config_fields import from_mapping

    return from_mapping(KVEventsConfig, given, path="kv_events_config")


def _with_event_buffer(config: ExecutorConfig, events: KVEventsConfig | None) -> ExecutorConfig:
    """With KV cache events enabled and ``kv_cache_config.event_buffer_max_size`` 0, a buffer of
    ``max_queue_size`` events (vLLM's queue for its publisher)."""
    kv = config.kv_cache_config
    if events is None or not events.enable_kv_cache_events or kv.event_buffer_max_size:
        return config
    return dataclasses.replace(config, kv_cache_config=dataclasses.replace(kv, event_buffer_max_size=events.max_queue_size))


def _torchrun_group(config: ExecutorConfig, enable_attention_dp: bool) -> TorchrunGroup | None:
    """Rank 0's group when this process was started by ``torchrun`` (``env://``), else None
    (the ranks are spawned here)."""
    launch = TorchrunEnv.from_environ()
    if launch is None or launch.world_size == 1:
        return None
    if enable_attention_dp:
        raise ValueError(_TORCHRUN_ATTENTION_DP)
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
    kv_events_config: KVEventsConfig | dict | None = None,
    batch_invariant: bool = False,
    quantization: str | None = None,
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
        raise ValueError(_TORCHRUN_ATTENTION_DP)
    if batch_invariant:
        check_batch_invariant(device, launch.world_size)
    if resolve_device(device, ranks=launch.world_size).type != "cpu":
        raise ValueError("ranks run on the CPU only (gloo)")
    # rank 0's process publishes the events (under TP its pool speaks for all): only the buffer matters here
    config = _with_event_buffer(_executor_config(executor_options), _kv_events_config(kv_events_config))
    rank_model = _rank_model(model, dtype=dtype, seed=seed, quantization=quantization)
    config = _cap_max_seq_len(config, executor_options, rank_model.config)
    job = serve_config(rank_model.config, config, check_decisions=check_decisions, checkpoint=rank_model.checkpoint)
    return follow(launch, lambda ctx: serve_rank(ctx, job))
