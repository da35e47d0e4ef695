"""Completing a forward: its tokens reach its requests, and their responses go out.

::

    InFlight + ForwardOutput ─► sample(sampler, ...): the requests that still want its tokens (one
                                that finished while it ran gets nothing), and the sampler's answer for each
        ─► count_drafts (speculative decoding): drafts verified and accepted ─► Drafts
        ─► update_requests, per request, by the sampler's answer:
               SamplingError   its logits or settings are broken: it fails alone (``failures``)
               BeamStep        advance_beams: beams, tokens (beam 0's), KV forks; one response at the end
               tokens, slot    fill: written over its placeholders (overlap), as many as the stop rule keeps
               tokens, None    appended, as many as the stop rule keeps
           and each gets its response (the last one ends it: ``Responses.finish``)
    then the executor: resource_manager.update_resources(batch)

Whether a request is over is :func:`~stop_rule.finish`'s answer on every path. The usual
request (tokens appended, not its first, not its last) is answered inside the loop with one
call to its callback: this runs for every generated token. Placeholders and what a forward in
flight cannot know: see ``launch``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Collection, Mapping

from tensorrt_llm._torch.pyexecutor.errors import SamplingError
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures
from tensorrt_llm._torch.pyexecutor.iteration.launch import InFlight
from tensorrt_llm._torch.pyexecutor.iteration.records import Drafts
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.llm_request import (
    LlmRequest,
    LlmRequestState,
    num_in_flight_tokens,
    token_array,
)
from tensorrt_llm._torch.pyexecutor.sampling.beam_search import BeamStep
from tensorrt_llm._torch.pyexecutor.sampling.stop_rule import finish

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput
    from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# ``LlmRequest.is_finished`` is ``state`` being one of these; the per-forward loops compare
# identities instead (a property call, or an Enum's Python-level hash, per request per forward).
_COMPLETE, _ERROR = LlmRequestState.GENERATION_COMPLETE, LlmRequestState.ERROR

# Response(request_id, tokens) for the one response per generated token: the named tuple's
# own constructor is a Python function (its defaults), tuple.__new__ is the C one; the fields
# after the first two take their declared defaults.
_new_tuple = tuple.__new__
_RESPONSE_DEFAULTS = tuple(Response._field_defaults.values())
assert Response._fields[2:] == tuple(Response._field_defaults), "every Response field after the tokens has a default"

# What sample returns: each request that takes the forward's tokens, with its placeholder count
# (None: its tokens are appended), and the sampler's answer for each, in the same order.
Live = list[tuple[LlmRequest, "int | None"]]


def sample(sampler: Sampler, flight: InFlight, output: ForwardOutput, dropping: Collection[int] = ()) -> tuple[Live, list]:
    """The requests of ``flight`` that still want its tokens (with their placeholder counts), and
    what ``sampler`` returned for each. A request that finished while the forward was in flight,
    or one in ``dropping`` (it starts over: this forward was built on a failed one's tokens), gets
    nothing from it (upstream drops it)."""
    live = [(r, slot) for r, slot in zip(flight.sampling, flight.slots)
            if r.state is not _COMPLETE and r.state is not _ERROR and (not dropping or r.request_id not in dropping)]
    if output.prompt_logits:  # before sampling: a request's first response carries its prompt's
        sampler.record_prompt_logprobs([c.request for c in flight.batch.context_chunks], output)
    return live, sampler.sample_batch([r for r, _ in live], output)


class CompletionHandler:
    """Hands a completed forward's tokens to its requests and answers them (on the executor's thread)."""

    def __init__(self, kv_cache_manager: KVCacheManager, responses: Responses, failures: Failures) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.responses = responses
        self.failures = failures

    def update_requests(self, live: Live, sampled: list, now: float) -> None:
        """Write each sampled token over its placeholder (or append it); respond. ``now``: one
        instant for every token of the forward."""
        callbacks = self.responses.callbacks
        for (request, slot), tokens in zip(live, sampled):
            if tokens.__class__ is not list:  # the usual answer, a list of tokens, is told by one check
                if isinstance(tokens, SamplingError):  # this request's logits or settings are broken, not the batch's
                    logger.error("%s", tokens)
                    self.failures.fail(request, tokens)
                    continue
                if isinstance(tokens, BeamStep):
                    self._advance_beams(request, tokens, now)
                    continue
            if slot is not None:
                self._fill(request, slot, tokens, now)
                continue
            sequence = request.tokens
            kept, finished = finish(request, tokens, len(sequence))
            if kept < len(tokens):
                tokens = tokens[:kept]
            if kept == 1:  # the usual delivery: array.append is half the cost of extend's iterator
                sequence.append(tokens[0])
            else:
                sequence.extend(tokens)
            if finished or request.first_token_time is None:
                self._deliver(request, tokens, finished, now)
                continue
            callback = callbacks.get(request.request_id)
            if callback is not None:
                callback(request, _new_tuple(Response, (request.request_id, tokens, *_RESPONSE_DEFAULTS)))

    def _fill(self, request: LlmRequest, width: int, tokens: list[int], now: float) -> None:
        """Write the sampled tokens over this forward's ``width`` placeholders (the first of the
        trailing ones: a later forward's follow), as many as the stop rule keeps; a run shorter
        than its placeholders (rejected drafts) pulls the later ones back, as the engine moved that
        forward back. When the run ends the request drops every later placeholder (that forward's
        tokens for it will be dropped). Respond."""
        sequence = request.tokens
        start = len(sequence) - num_in_flight_tokens(sequence)
        kept, finished = finish(request, tokens, start)
        if kept < len(tokens):
            tokens = tokens[:kept]
        if width == 1:
            sequence[start] = tokens[0]
        else:
            sequence[start : start + width] = token_array(tokens)
        if finished:
            del sequence[start + len(tokens) :]
        self._deliver(request, tokens, finished, now)

    def _advance_beams(self, request: LlmRequest, step: BeamStep, now: float) -> None:
        """Apply a beam-search step: the request's beams, its tokens (beam 0's, so that its length
        is every beam's), its KV (each new beam's tables are its parent's). Nothing is sent until
        the search is over: a beam's tokens are not final while a better beam may replace it. Then
        the one response carries the returned beams, and ``tokens`` ends with the best one's."""
        state = step.state
        request.py_beams = state
        best = state.results[0] if state.done else state.live[0]
        del request.tokens[request.orig_prompt_len :]
        request.tokens.extend(best.tokens)
        if not state.done:
            if request.first_token_time is None:
                request.first_token_time = now
            self.kv_cache_manager.sequences.fork_beams(request, step.parents)
            return
        self._deliver(request, list(best.tokens), True, now, beams=state.results)

    def _deliver(
        self, request: LlmRequest, tokens: list[int], finished: bool, now: float, *, beams: tuple | None = None
    ) -> None:
        """Respond with ``tokens``; a request's first response carries its cached prompt tokens,
        its last one ends it."""
        cached = request.prepopulated_prompt_len if request.first_token_time is None or beams is not None else None
        if request.first_token_time is None:
            request.first_token_time = now
        if finished:
            request.state = _COMPLETE
            request.finish_time = now
            callback = self.responses.end(request)
        else:
            callback = self.responses.callbacks.get(request.request_id)
        if callback is not None:
            callback(request, Response(request.request_id, tokens, finished, beams=beams, cached_tokens=cached))


def count_drafts(live: Live, sampled: list, targets: Mapping[int, list[int]]) -> Drafts:
    """Drafts the forward verified, and how many the sampler accepted (before the stop rule)."""
    verified = accepted = 0
    for (request, _), tokens in zip(live, sampled):
        picks = targets.get(request.request_id)
        if picks is not None and not isinstance(tokens, SamplingError):
            verified += len(picks) - 1
            accepted += len(tokens) - 1
    return Drafts(verified, accepted)
