"""Samplers: turn a forward's logits into each request's next token(s)."""

from __future__ import annotations

import abc

import torch

from tensorrt_llm._torch.pyexecutor.errors import NonFiniteLogitsError, SamplingError
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput
from tensorrt_llm._torch.speculative.verification import accept_greedy


class Sampler(abc.ABC):
    @abc.abstractmethod
    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int]:
        """Tokens to append to ``request`` (at least one) after a forward in which it sampled:
        one, or with draft tokens the accepted drafts and the token after them.

        Raises NonFiniteLogitsError when its logits are not finite; the executor fails that
        request alone."""

    def sample_batch(self, requests: list[LlmRequest], output: ForwardOutput) -> list[list[int] | SamplingError]:
        """:meth:`sample` for each of ``requests``, in order (a sampler may do it in one go).

        Whatever one request's sampling raises (logits that are not finite, a setting the
        sampler cannot honour) is put in that request's place as a SamplingError, so it fails
        that request alone: nothing a single request carries may fail its batch."""
        tokens: list[list[int] | SamplingError] = []
        for request in requests:
            try:
                tokens.append(self.sample(request, output))
            except SamplingError as error:
                tokens.append(error)
            except Exception as error:  # noqa: BLE001 - isolate the request; the cause is in the message
                tokens.append(SamplingError(
                    request.request_id,
                    f"request {request.request_id}: sampling failed: {type(error).__name__}: {error}",
                ))
        return tokens

    def release(self, request: LlmRequest) -> None:
        """Forget per-request state (random generators) of a finished request."""


class TorchSampler(Sampler):
    """Greedy, or temperature / top-k / top-p with a per-request seeded generator."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int]:
        """Raises NonFiniteLogitsError when the logits hold NaN or inf: argmax or multinomial
        over them would return a token that means nothing."""
        logits = output.logits[request.request_id]  # (vocab,)
        if output.nonfinite is not None:  # checked on the engine's device, without waiting for it
            if request.request_id in output.nonfinite:
                raise NonFiniteLogitsError(request.request_id, len(request.tokens))
        elif not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(request.request_id, len(request.tokens))
        config = request.sampling_config
        if config.is_greedy:
            targets = output.draft_targets.get(request.request_id) if output.draft_targets else None
            if targets is not None:  # the drafts this forward verified (a non-greedy request's are all rejected)
                return accept_greedy(request.py_draft_tokens[: len(targets) - 1], targets)
            if output.greedy_tokens is not None:  # picked on the engine's device, for the whole batch
                return [output.greedy_tokens[request.request_id]]
            return [int(torch.argmax(logits))]
        probs = self._filtered_probs(logits.to("cpu", torch.float64), config)  # (vocab,), the generator's device
        return [int(torch.multinomial(probs, 1, generator=self._generator(request)))]

    def release(self, request: LlmRequest) -> None:
        self._generators.pop(request.request_id, None)

    def _generator(self, request: LlmRequest) -> torch.Generator:
        """The request's own generator, seeded once. Any seed in [0, 2**64) is taken (``manual_seed``
        reads it as unsigned 64-bit); the CPU generator (mt19937) keeps its low 32 bits, so seeds
        that differ only above them draw the same tokens."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_config.seed
            generator = torch.Generator()
            generator.manual_seed(seed if seed is not None else request.request_id)
            self._generators[request.request_id] = generator
        return generator

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
        """Float64 probabilities after temperature, top-k and top-p; finite for finite logits
        and any temperature > 0: the largest logit is subtracted *before* dividing, so the
        scaled logits are <= 0 with a 0 among them (a tiny temperature sends the others to
        -inf, never inf - inf = NaN), and the softmax always has mass to normalise."""
        logits = (logits - logits.max()) / config.temperature
        if config.top_k:
            kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= config.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()
