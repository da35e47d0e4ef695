"""Completing a forward (``iteration.completion``) on its own: the requests and the KV manager
are real, the sampler's answers are given by hand, as a model runner would return them.

What is checked: tokens appended or written over placeholders, as many as the stop rule keeps;
one response per delivery (the first carries the cached prompt tokens, the last ends the
request and forgets its callback); a request whose sampling failed fails alone; the drafts
count; a forward's tokens never reach a request that is over or starting over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput
from tensorrt_llm._torch.pyexecutor.errors import SamplingError
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.iteration.completion import CompletionHandler, count_drafts, sample
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures
from tensorrt_llm._torch.pyexecutor.iteration.launch import InFlight
from tensorrt_llm._torch.pyexecutor.iteration.records import Drafts
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequestState
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tests.helpers.factories import make_batch, make_config, make_kv_cache_manager, make_request, make_resource_manager, run_alone

P = IN_FLIGHT_TOKEN_ID


@dataclass
class Setup:
    handler: CompletionHandler
    responses: Responses
    failures: Failures
    kv: object
    sent: list[Response] = field(default_factory=list)

    def generating(self, *, prompt_len: int = 8, max_new_tokens: int = 8, **kwargs):
        """A request past its prompt (one token generated, not yet answered), answered into ``sent``."""
        request = make_request(prompt_len=prompt_len, max_new_tokens=max_new_tokens, **kwargs)
        assert run_alone(self.kv, request, SyntheticSampler(1000))
        self.responses.register(request.request_id, lambda _, response: self.sent.append(response))
        return request


@pytest.fixture
def setup() -> Setup:
    config = make_config()
    kv = make_kv_cache_manager(config)
    responses = Responses()
    failures = Failures(config, responses, make_resource_manager(config, kv), clock=lambda: 42.0)
    return Setup(CompletionHandler(kv, responses, failures), responses, failures, kv)


def test_appended_tokens_get_one_response_each_and_the_last_ends_the_request(setup):
    request = setup.generating(max_new_tokens=3)  # one token in, two to go
    prompt = request.orig_prompt_len
    setup.handler.update_requests([(request, None)], [[11]], now=1.0)
    setup.handler.update_requests([(request, None)], [[12]], now=2.0)
    assert request.tokens[prompt + 1:].tolist() == [11, 12]
    assert request.first_token_time == 1.0 and request.finish_time == 2.0
    assert request.state is LlmRequestState.GENERATION_COMPLETE
    # the first response carries the cached prompt tokens; the usual one is a bare Response
    assert setup.sent == [Response(request.request_id, [11], cached_tokens=request.prepopulated_prompt_len),
                          Response(request.request_id, [12], finished=True)]
    assert setup.responses.finished == [request] and request.request_id not in setup.responses.callbacks


def test_the_usual_response_is_a_plain_response(setup):
    request = setup.generating(max_new_tokens=8)
    setup.handler.update_requests([(request, None)], [[5]], now=1.0)
    setup.handler.update_requests([(request, None)], [[6, 7]], now=2.0)  # drafts: several at once
    assert setup.sent[1] == Response(request.request_id, [6, 7]) and type(setup.sent[1]) is Response


def test_a_stop_token_ends_the_request_and_what_follows_is_dropped(setup):
    request = setup.generating(max_new_tokens=8, stop_token_ids=(9,))
    setup.handler.update_requests([(request, None)], [[4, 9, 5]], now=1.0)
    assert request.output_token_ids[-2:] == [4, 9] and request.state is LlmRequestState.GENERATION_COMPLETE
    assert setup.sent[-1].new_token_ids == [4, 9] and setup.sent[-1].finished


def test_placeholders_are_written_over_and_a_shorter_run_pulls_the_later_ones_back(setup):
    request = setup.generating(max_new_tokens=8)
    base = len(request.tokens)
    request.tokens.extend([P, P, P, P])  # forward n: 1 + 2 drafts; forward n+1: one more
    setup.handler.update_requests([(request, 3)], [[21, 22]], now=1.0)  # one draft rejected
    assert request.tokens[base:].tolist() == [21, 22, P]
    assert setup.sent[-1].new_token_ids == [21, 22] and not setup.sent[-1].finished


def test_a_run_that_finishes_drops_every_later_placeholder(setup):
    request = setup.generating(max_new_tokens=2)  # one token in: the next one is its last
    base = len(request.tokens)
    request.tokens.extend([P, P])  # forward n, and forward n+1 already built on it
    setup.handler.update_requests([(request, 1)], [[30]], now=1.0)
    assert request.tokens[base:].tolist() == [30] and request.state is LlmRequestState.GENERATION_COMPLETE


def test_a_request_whose_sampling_failed_fails_alone(setup):
    broken, fine = setup.generating(), setup.generating()
    error = SamplingError(broken.request_id, "the logits are not finite")
    setup.handler.update_requests([(broken, None), (fine, None)], [error, [7]], now=1.0)
    assert broken.state is LlmRequestState.ERROR and broken.error == f"SamplingError: {error}"
    assert broken.finish_time == 42.0  # the failure's own clock reading
    assert fine.tokens[-1] == 7 and fine.state is LlmRequestState.GENERATION_IN_PROGRESS
    assert [r.request_id for r in setup.responses.finished] == [broken.request_id]
    assert [(r.request_id, r.finished, r.error is not None) for r in setup.sent] == [
        (broken.request_id, True, True), (fine.request_id, False, False)]


def test_drafts_are_counted_as_verified_and_accepted():
    a, b, c = (make_request(prompt_len=4) for _ in range(3))
    live = [(a, None), (b, None), (c, None)]
    sampled = [[1, 2], SamplingError(b.request_id, "broken"), [3]]
    targets = {a.request_id: [1, 2, 5, 6], b.request_id: [1, 1]}  # c verified none
    assert count_drafts(live, sampled, targets) == Drafts(verified=3, accepted=1)


class _Recording(SyntheticSampler):
    def __init__(self) -> None:
        super().__init__(1000)
        self.asked: list[int] = []

    def sample_batch(self, requests, output):
        self.asked = [r.request_id for r in requests]
        return super().sample_batch(requests, output)


def test_a_forward_feeds_no_request_that_is_over_or_starts_over(setup):
    done, dropped, live = setup.generating(), setup.generating(), setup.generating()
    done.state = LlmRequestState.GENERATION_COMPLETE  # finished while the forward ran
    batch = make_batch(generation=[done, dropped, live])
    flight = InFlight(None, batch, [done, dropped, live], [None, None, None], None)
    sampler = _Recording()
    got, sampled = sample(sampler, flight, ForwardOutput(logits={}), dropping={dropped.request_id})
    assert got == [(live, None)] and sampler.asked == [live.request_id] and len(sampled) == 1
