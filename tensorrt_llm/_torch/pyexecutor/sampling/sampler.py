"""Samplers: turn a forward's logits into each request's next token(s)."""

from __future__ import annotations

import abc
import math

import numpy as np
import torch

from tensorrt_llm._torch.pyexecutor.beam_state import BeamState
from tensorrt_llm._torch.pyexecutor.sampling.beam_search import BeamStep, Candidate, advance
from tensorrt_llm._torch.pyexecutor.errors import NonFiniteLogitsError, SamplingError
from tensorrt_llm._torch.pyexecutor.sampling.guided_decoder import GrammarError, GrammarMatcher
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig
from tensorrt_llm._torch.pyexecutor.sampling.logits_processors import (
    apply_penalties,
    forbid_end_before_min_tokens,
    record_prompt_logprobs,
    token_logprob,
)
from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests
from tensorrt_llm._torch.speculative.verification import accept_greedy


class Sampler(abc.ABC):
    @abc.abstractmethod
    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int] | BeamStep:
        """Tokens to append to ``request`` (at least one) after a forward in which it sampled:
        one, or with draft tokens the accepted drafts and the token after them. For a beam-search
        request, a sampler that searches returns the :class:`BeamStep` instead (the executor
        applies it); one that does not (the simulated engine's) treats it as one sequence.

        Raises NonFiniteLogitsError when its logits are not finite; the executor fails that
        request alone."""

    def sample_batch(
        self, requests: list[LlmRequest], output: ForwardOutput
    ) -> list[list[int] | BeamStep | SamplingError]:
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

    def token_masks(self, batch: ScheduledRequests) -> dict[int, np.ndarray] | None:
        """Request id -> the bitmask (int32 words) of the ids its grammar allows next, for every
        guided request that samples in ``batch`` (asked at launch: the engine masks its row on its
        device). None: no request of the batch is guided (a sampler without grammars: always)."""
        return None

    def release(self, request: LlmRequest) -> None:
        """Forget per-request state (random generators) of a finished request."""

    def record_prompt_logprobs(self, requests: list[LlmRequest], output: ForwardOutput) -> None:
        """The prompt log-probabilities of the context chunks in ``output.prompt_logits`` (requests
        that asked for them), onto ``requests`` (the forward's context requests, any order)."""
        by_id = {request.request_id: request for request in requests}
        for request_id, (start, rows) in output.prompt_logits.items():
            request = by_id.get(request_id)
            if request is not None and not request.is_finished:
                record_prompt_logprobs(request, start, rows)


class TorchSampler(Sampler):
    """Hands each request the token the engine sampled on its device, or draws it on the host.

    **From the device** (``ForwardOutput.device_sampled``: the torch engines): the engine's
    sampling pass (``engine.sampling_pass``) drew every sampling row, greedy or not, with its
    penalties, ``min_tokens`` and grammar mask, and computed the logprobs asked for; here a
    request takes its pick and logprobs, and a guided request's matcher accepts the token. Its
    mask for the next token is computed at launch (:meth:`token_masks`), after its previous token
    was accepted: a guided request is never overlapped (``ModelEngine.can_pick``).

    **On the host** (an engine that did not sample: outputs built by hand, the tests' reference;
    and every beam search, :meth:`beam_step`): greedy, or temperature / top-k / min-p / top-p
    with a per-request seeded generator, on the row in float64; penalties, ``min_tokens`` and the
    grammar mask before the draw (``logits_processors``), logprobs after it. This float64 path
    is the reference the device pass's semantics are tested against (:meth:`_filtered_probs`
    documents the filters).

    A guided request's matcher is created at its first token and kept here until :meth:`release`.
    """

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self._matchers: dict[int, GrammarMatcher] = {}
        self._mask_errors: dict[int, str] = {}  # a guided request whose mask could not be made: fails at its sample

    def token_masks(self, batch: ScheduledRequests) -> dict[int, np.ndarray] | None:
        """Each guided sampling request's bitmask. A matcher that cannot give one (the grammar
        allows nothing, or is broken) fails its request alone, when its token comes back."""
        masks = None
        for request in _sampling_requests(batch):
            if request.guided_grammar is None or request.beam_width > 1:
                continue
            try:
                words = self._matcher(request).bitmask()
                if not words.any():
                    raise GrammarError("the grammar allows no token here")
            except Exception as error:  # noqa: BLE001 - isolate the request; the cause is in the message
                # no mask: the engine samples its row as greedy and reports it; sample() fails it with this
                self._mask_errors[request.request_id] = (
                    f"request {request.request_id}: sampling failed: {type(error).__name__}: {error}")
                continue
            if masks is None:
                masks = {}
            masks[request.request_id] = words
        return masks

    def sample(self, request: LlmRequest, output: ForwardOutput) -> list[int] | BeamStep:
        """Raises NonFiniteLogitsError when the logits hold NaN or inf: argmax or multinomial
        over them would return a token that means nothing. A beam-search request gets its
        :class:`BeamStep` (:meth:`beam_step`)."""
        if request.beam_width > 1:
            return self.beam_step(request, output)
        logits = output.logits[request.request_id]  # (vocab,)
        if output.nonfinite is not None:  # checked on the engine's device, without waiting for it
            if request.request_id in output.nonfinite:
                raise NonFiniteLogitsError(request.request_id, len(request.tokens))
        elif not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(request.request_id, len(request.tokens))
        if output.device_sampled and output.greedy_tokens is not None:
            return self._device_pick(request, output)
        config = request.sampling_config
        if not request.needs_host_logits:
            if config.is_greedy:
                targets = output.draft_targets.get(request.request_id) if output.draft_targets else None
                if targets is not None:  # the drafts this forward verified (a non-greedy request's are all rejected)
                    verified = output.verified_drafts  # as the forward's inputs held them (overlap: py_draft_tokens moved on)
                    drafts = verified[request.request_id] if verified else request.py_draft_tokens[: len(targets) - 1]
                    return accept_greedy(drafts, targets)
                if output.greedy_tokens is not None:  # picked on the engine's device, for the whole batch
                    return [output.greedy_tokens[request.request_id]]
                return [int(torch.argmax(logits))]
            probs = self._filtered_probs(logits.to("cpu", torch.float64), config)  # (vocab,), the generator's device
            return [int(torch.multinomial(probs, 1, generator=self._generator(request)))]
        raw = logits.to("cpu", torch.float64)  # (vocab,)
        processed = raw.clone()
        if config.has_penalties:
            apply_penalties(processed, config, request)
        if config.min_tokens:
            forbid_end_before_min_tokens(processed, config, request)
        matcher = self._matcher(request)
        if matcher is not None:
            matcher.fill_mask(processed)
        if config.is_greedy:
            token = int(torch.argmax(processed))
        else:
            token = int(torch.multinomial(self._filtered_probs(processed, config), 1, generator=self._generator(request)))
        if matcher is not None:
            matcher.accept(token)
        if config.logprobs is not None:
            request.py_logprobs.append(token_logprob(raw, token, config.logprobs))
        return [token]

    def _device_pick(self, request: LlmRequest, output: ForwardOutput) -> list[int]:
        """The engine's pick (after draft verification for a speculative request), accepted by the
        request's matcher; its logprobs from the pass."""
        rid = request.request_id
        error = self._mask_errors.pop(rid, None) or (output.sampling_errors or {}).get(rid)
        if error is not None:
            raise SamplingError(rid, error)
        targets = output.draft_targets.get(rid) if output.draft_targets else None
        if targets is not None:  # a speculative request is plain greedy: the drafts its forward verified
            verified = output.verified_drafts  # as the forward's inputs held them (overlap: py_draft_tokens moved on)
            drafts = verified[rid] if verified else request.py_draft_tokens[: len(targets) - 1]
            return accept_greedy(drafts, targets)
        token = output.greedy_tokens[rid]
        if request.guided_grammar is not None:
            self._matcher(request).accept(token)
        if request.sampling_config.logprobs is not None:
            request.py_logprobs.append(output.logprobs[rid])
        return [token]

    @staticmethod
    def beam_step(request: LlmRequest, output: ForwardOutput) -> BeamStep:
        """One beam-search step (``beam_search``): the log-softmax of each live beam's row (float64,
        on the host) plus the beam's cumulative log-probability, ranked over every (beam, token);
        the ``2 * beam_width`` best, ties in (beam, token) order, go to :func:`beam_search.advance`.

        The forward that completes a request's prompt has one row (its last position), and the
        search starts from it; later forwards have one row per beam (``output.beam_logits``)."""
        rid = request.request_id
        state = request.py_beams if request.py_beams is not None else BeamState.start(request.beam_width)
        if output.beam_logits is not None and rid in output.beam_logits:
            rows = output.beam_logits[rid]  # (beam_width, vocab), beam 0 first
        else:
            rows = output.logits[rid][None]  # (1, vocab): the prompt's last position
        rows = rows.to(torch.float64)  # where the logits are: only the best candidates travel to the host
        if not bool(torch.isfinite(rows).all()):
            raise NonFiniteLogitsError(rid, len(request.tokens))
        cum = torch.tensor([h.cum_logprob for h in state.live[: rows.shape[0]]], dtype=torch.float64, device=rows.device)
        totals = (torch.log_softmax(rows, dim=-1) + cum[:, None]).flatten()  # (rows * vocab,); padding at -inf
        width, vocab = request.beam_width, rows.shape[1]
        candidates = [Candidate(i // vocab, i % vocab, v) for v, i in _best(totals, 2 * width)]
        end_id, stops = request.end_id, request.stop_token_ids
        return advance(state, candidates, request.beam_config, lambda t: t == end_id or t in stops,
                       request.max_new_tokens)

    def release(self, request: LlmRequest) -> None:
        self._generators.pop(request.request_id, None)
        self._matchers.pop(request.request_id, None)
        self._mask_errors.pop(request.request_id, None)

    def _matcher(self, request: LlmRequest) -> GrammarMatcher | None:
        if request.guided_grammar is None:
            return None
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            matcher = self._matchers[request.request_id] = request.guided_grammar.matcher()
        return matcher

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
        """Float64 probabilities after temperature, top-k, min-p and top-p (vLLM's order: min-p
        compares with the likeliest token after temperature, top-p takes the smallest prefix of
        what is left, renormalised); finite for finite logits
        and any temperature > 0: the largest logit is subtracted *before* dividing, so the
        scaled logits are <= 0 with a 0 among them (a tiny temperature sends the others to
        -inf, never inf - inf = NaN), and the softmax always has mass to normalise."""
        logits = (logits - logits.max()) / config.temperature
        if config.top_k:
            kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if config.min_p > 0.0:  # the likeliest token has probability probs.max() and always stays
            probs = probs.masked_fill(probs < config.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= config.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()


def _sampling_requests(batch: ScheduledRequests):
    """The requests that sample a token in ``batch``: last context chunks, then generation steps."""
    for chunk in batch.context_chunks:
        if chunk.is_last:
            yield chunk.request
    yield from batch.generation_requests


def _best(totals: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` largest finite entries of ``totals`` as (value, index), largest first and ties in
    index order: what a stable descending sort of all of them would put first, at the cost of a
    top-k (a beam step ranks beam_width * vocab candidates, over half a million for a large
    vocabulary, where a full sort on the host took tens of milliseconds per request)."""
    k = min(k, totals.numel())
    if k == 0:
        return []
    kth = torch.topk(totals, k, sorted=False).values.min()
    # Every finite entry at least as good as the k-th, so that ties with it are all considered
    # (one mask on the logits' device: deciding whether the k-th is finite would wait for it).
    picked = torch.nonzero((totals >= kth) & (totals > -math.inf)).flatten()
    ranked = sorted(zip((-totals[picked]).tolist(), picked.tolist()))[:k]
    return [(-negated, index) for negated, index in ranked]
