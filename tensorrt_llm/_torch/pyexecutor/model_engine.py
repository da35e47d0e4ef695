"""Model engines: ``_prepare_tp_inputs`` builds one flat forward; an engine runs it.

``ModelEngine`` owns the input preparation, identical for every engine: it runs the
token-budget policy's ``before_inputs`` hook, appends each request's positions (counted
by :func:`forward_cost`, nothing else), and checks the total against ``max_num_tokens``
the way upstream asserts it — except that here it raises :class:`TokenBudgetExceeded`,
which fails the batch instead of killing the executor thread. Subclasses run the
prepared inputs: :class:`TorchModelEngine` through a real torch model; the replay's
simulated engine through a cost model.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.models.modeling_llama import AttentionMetadata, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.kv_cache_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_budget import TokenBudgetPolicy

PAD_TOKEN_ID = 0  # fills first-draft slots before the drafter has proposed anything


@dataclass(slots=True)
class TpInputs:
    """One flat forward. Request ``i`` owns ``input_ids[offsets[i]:offsets[i] + num_new_tokens[i]]``."""

    requests: list[LlmRequest] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # does request i produce a token this step

    @property
    def total_num_tokens(self) -> int:
        return len(self.input_ids)

    def append(
        self, request: LlmRequest, token_ids: list[int], start: int, block_table: list[int], samples: bool, beams: int = 1
    ) -> None:
        """Consecutive positions from ``start``; with ``beams`` > 1 every beam is at ``start``."""
        self.requests.append(request)
        self.input_ids.extend(token_ids)
        self.position_ids.extend([start] * beams if beams > 1 else range(start, start + len(token_ids)))
        self.num_new_tokens.append(len(token_ids))
        self.num_cached_tokens.append(start)
        self.block_tables.append(block_table)
        self.samples.append(samples)


@dataclass(slots=True)
class ForwardOutput:
    """Per request that samples: the logits row of its last position (None for simulated engines)."""

    logits: dict[int, torch.Tensor | None]
    num_tokens: int = 0  # positions in the forward


class ModelEngine(abc.ABC):
    """Shared input preparation; subclasses implement :meth:`_run`."""

    #: largest beam width / whether draft tokens can be run; checked at submission.
    max_beam_width: int = 1
    supports_draft_tokens: bool = False

    def __init__(self, max_num_tokens: int, kv_cache_manager: KVCacheManager, token_budget: TokenBudgetPolicy) -> None:
        self.max_num_tokens = max_num_tokens
        self.kv_cache_manager = kv_cache_manager
        self.token_budget = token_budget

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    def forward(self, scheduled: ScheduledRequests) -> ForwardOutput:
        inputs = self._prepare_tp_inputs(scheduled)
        output = self._run(inputs)
        output.num_tokens = inputs.total_num_tokens
        return output

    def _prepare_tp_inputs(self, scheduled: ScheduledRequests) -> TpInputs:
        """Flat inputs for the batch; raises TokenBudgetExceeded past ``max_num_tokens``."""
        self.token_budget.before_inputs(scheduled)
        inputs = TpInputs()
        kv = self.kv_cache_manager
        for request in scheduled.context_requests:
            start = request.context_current_position
            chunk = min(request.context_chunk_size, request.prompt_len - start)
            last = request.is_last_context_chunk
            token_ids = request.tokens[start : start + chunk]
            if last:
                token_ids += request.py_draft_tokens
            inputs.append(request, token_ids, start, kv.block_table(request), samples=last)
        for request in scheduled.generation_requests:
            last_token = request.tokens[-1]
            if request.is_first_draft:
                token_ids = [last_token] + [PAD_TOKEN_ID] * request.max_draft_len
            elif request.py_draft_tokens:
                token_ids = [last_token, *request.py_draft_tokens]
            else:  # one position per beam
                token_ids = [last_token] * request.beam_width
            start = len(request.tokens) - 1
            inputs.append(request, token_ids, start, kv.block_table(request), samples=True, beams=request.beam_width)
        assert all(n == forward_cost(r) for r, n in zip(inputs.requests, inputs.num_new_tokens)), "position count drift"
        if inputs.total_num_tokens > self.max_num_tokens:
            raise TokenBudgetExceeded(inputs.total_num_tokens, self.max_num_tokens)
        return inputs

    @abc.abstractmethod
    def _run(self, inputs: TpInputs) -> ForwardOutput: ...


class TorchModelEngine(ModelEngine):
    """Runs a real torch model over the paged KV tensors of the KV manager."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_num_tokens: int,
        kv_cache_manager: KVCacheManager,
        token_budget: TokenBudgetPolicy,
    ) -> None:
        super().__init__(max_num_tokens, kv_cache_manager, token_budget)
        if kv_cache_manager.storage is None:
            raise ValueError("TorchModelEngine needs a KV cache manager with tensor storage")
        self.model = model.eval()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def _run(self, inputs: TpInputs) -> ForwardOutput:
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
        rows, sampling = [], []
        offset = 0
        for request, n, samples in zip(inputs.requests, inputs.num_new_tokens, inputs.samples):
            offset += n
            if samples:
                rows.append(offset - 1)  # the last position of the request predicts its next token
                sampling.append(request.request_id)
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty((0, self.vocab_size))
        return ForwardOutput(logits=dict(zip(sampling, logits)))
