"""``LLM``: a torch model served by a background :class:`PyExecutor`, driven with token ids."""

from __future__ import annotations

import dataclasses
import queue
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.errors import RequestError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor, Response
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

_EXECUTOR_FIELDS = {f.name for f in dataclasses.fields(ExecutorConfig)}


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings (greedy by default)."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    stop_token_ids: Sequence[int] = ()
    beam_width: int = 1

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error"


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None


class RequestOutputHandle:
    """A submitted request: iterate it to stream, ``result()`` to wait, ``abort()`` to cancel."""

    def __init__(self, llm: "LLM", request: LlmRequest) -> None:
        self._llm = llm
        self._request = request
        self._events: queue.Queue[Response] = queue.Queue()
        self.output = RequestOutput(request.request_id, list(request.input_token_ids), [CompletionOutput(0)])

    @property
    def request_id(self) -> int:
        return self._request.request_id

    def _on_response(self, request: LlmRequest, response: Response) -> None:
        self._events.put(response)

    def _apply(self, response: Response) -> None:
        completion = self.output.outputs[0]
        completion.token_ids.extend(response.new_token_ids)
        if response.finished:
            self.output.finished = True
            self.output.error = response.error
            if response.error:
                completion.finish_reason = "error"
            elif response.cancelled:
                completion.finish_reason = "cancelled"
            elif len(completion.token_ids) >= self._request.max_new_tokens:
                completion.finish_reason = "length"
            else:
                completion.finish_reason = "stop"

    def __iter__(self) -> Iterator[RequestOutput]:
        """Yields the output after each step that changed it, until it is finished."""
        while not self.output.finished:
            self._apply(self._events.get())
            yield self.output

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the final output; raises RequestError if the request failed."""
        while not self.output.finished:
            self._apply(self._events.get(timeout=timeout))
        if self.output.error:
            raise RequestError(self.request_id, self.output.error)
        return self.output

    def abort(self) -> None:
        self._llm._executor.cancel_request(self.request_id)


class LLM:
    """Serve a random-weight Llama model (``"tiny-random"``, ``"small-random"``,
    ``"mistral-nemo-12b-random"``) on the CPU (default) or a GPU (``device="cuda"``).

    Every :class:`ExecutorConfig` field is accepted as a keyword (``max_num_tokens``,
    ``enable_chunked_prefill``, ``token_budget_policy``, ``kv_cache_config``, ...). On CUDA the
    model runs in ``bfloat16`` unless ``dtype`` says otherwise (DESIGN.md §7).
    """

    def __init__(self, model: str | LlamaConfig = "tiny-random", *, dtype: str | None = None, seed: int | None = None,
                 device: str = "cpu", **executor_options) -> None:
        unknown = set(executor_options) - _EXECUTOR_FIELDS
        if unknown:
            raise TypeError(f"LLM got unknown options {sorted(unknown)}; accepted: {sorted(_EXECUTOR_FIELDS)}")
        if isinstance(model, str):
            if model not in MODEL_PRESETS:
                raise ValueError(f"unknown model {model!r}; available: {sorted(MODEL_PRESETS)}")
            model = MODEL_PRESETS[model]
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' needs a CUDA GPU, and torch sees none")
        if dtype is None and device.type == "cuda":
            dtype = "bfloat16"
        overrides = {k: v for k, v in (("dtype", dtype), ("seed", seed)) if v is not None}
        self.model_config = dataclasses.replace(model, **overrides)
        self.config = ExecutorConfig(**executor_options)
        model = LlamaForCausalLM(self.model_config, device=device)
        self._executor: PyExecutor = create_py_executor(self.config, model=model)
        self._executor.start()

    def generate_async(self, prompt: Sequence[int], sampling_params: SamplingParams | None = None) -> RequestOutputHandle:
        request = self._make_request(prompt, sampling_params or SamplingParams())
        self._executor.validate(request)
        return self._submit(request)

    def generate(
        self, prompts: Sequence[int] | Sequence[Sequence[int]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a list of prompts (token ids); raises ValueError before
        queueing anything if any prompt is invalid, RequestError if one fails while running."""
        single = bool(prompts) and isinstance(prompts[0], int)
        batch = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        requests = [self._make_request(prompt, params) for prompt in batch]
        for request in requests:
            self._executor.validate(request)
        handles = [self._submit(request) for request in requests]
        outputs, first_error = [], None
        for handle in handles:
            try:
                outputs.append(handle.result())
            except RequestError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error
        return outputs[0] if single else outputs

    def health(self) -> dict:
        return self._executor.health()

    @property
    def iteration_stats(self):
        return list(self._executor.iteration_stats)

    def shutdown(self) -> None:
        self._executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _submit(self, request: LlmRequest) -> RequestOutputHandle:
        handle = RequestOutputHandle(self, request)
        self._executor.enqueue_request(request, handle._on_response)
        return handle

    @staticmethod
    def _make_request(prompt: Sequence[int], params: SamplingParams) -> LlmRequest:
        if isinstance(prompt, str):
            raise ValueError("text prompts need a tokenizer, which this engine does not have: pass token ids")
        try:
            token_ids = [int(t) if not isinstance(t, bool) else None for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"a prompt must be a sequence of token ids, got {prompt!r:.80}") from None
        if any(t is None or t != raw for t, raw in zip(token_ids, prompt)):
            raise ValueError(f"a prompt must hold integer token ids, got {prompt!r:.80}")
        return LlmRequest(
            input_token_ids=token_ids,
            max_new_tokens=params.max_tokens,
            beam_width=params.beam_width,
            end_id=params.end_id,
            stop_token_ids=tuple(params.stop_token_ids),
            sampling_config=params.sampling_config(),
        )
