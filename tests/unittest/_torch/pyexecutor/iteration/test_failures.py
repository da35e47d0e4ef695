"""Failure handling (``iteration.failures``) on its own, over a real KV manager and real requests.

The decisions are values (:func:`retry_or_fail`, :func:`restart_refusal`); :class:`Failures`
carries them out: a request fails once, with its error, one final response and no
placeholder left; a batch's failure is counted for ``Health``; a failed forward's requests
start over with their KV freed, or fail once their retries in a row are spent.
"""

from __future__ import annotations

import pytest

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError, TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures, restart_refusal, retry_or_fail
from tensorrt_llm._torch.pyexecutor.iteration.records import BatchFailure
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequestState
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tests.helpers.factories import make_config, make_kv_cache_manager, make_request, make_resource_manager, run_alone


def _failures(**config_overrides):
    config = make_config(**config_overrides)
    kv = make_kv_cache_manager(config)
    responses = Responses()
    sent: list[Response] = []
    failures = Failures(config, responses, make_resource_manager(config, kv), clock=lambda: 7.0)
    return failures, kv, responses, sent


def _generating(kv, responses, sent, **kwargs):
    request = make_request(prompt_len=kwargs.pop("prompt_len", 8), **kwargs)
    assert run_alone(kv, request, SyntheticSampler(1000))
    responses.register(request.request_id, lambda _, response: sent.append(response))
    return request


# ---- the decisions ------------------------------------------------------------------
def test_retry_or_fail_retries_until_the_retries_in_a_row_are_spent():
    fresh, spent, over, dropping = (make_request(prompt_len=4) for _ in range(4))
    for _ in range(2):  # two failed forwards in a row, no token in between
        spent.retry_after_failed_forward()
    over.set_error("failed already")
    decision = retry_or_fail([fresh, spent, over, dropping], max_retries=2, dropping={dropping.request_id})
    assert (decision.retry, decision.fail) == ([fresh], [spent])
    spent.tokens.append(5)  # it generated a token since: its next failure is independent
    assert retry_or_fail([spent], max_retries=2).retry == [spent]
    assert retry_or_fail([fresh], max_retries=0).fail == [fresh]  # retries off


def test_restart_refusal_only_without_chunked_prefill_and_only_past_the_budget():
    request = make_request(prompt_len=10)
    assert restart_refusal(request, "paused", max_num_tokens=10, chunked=False) is None
    assert restart_refusal(request, "paused", max_num_tokens=9, chunked=True) is None
    error = restart_refusal(request, "paused", max_num_tokens=9, chunked=False)
    assert isinstance(error, InvalidRequestError)
    assert str(error) == (f"request {request.request_id}: paused, its context of 10 tokens (prompt + generated)"
                          " exceeds max_num_tokens 9 and chunked prefill is off")


# ---- carrying them out --------------------------------------------------------------
def test_a_request_fails_once_without_its_placeholders():
    failures, kv, responses, sent = _failures()
    request = _generating(kv, responses, sent)
    length = len(request.tokens)
    request.tokens.extend([IN_FLIGHT_TOKEN_ID, IN_FLIGHT_TOKEN_ID])
    failures.fail(request, ValueError("boom"))
    failures.fail(request, ValueError("again"))  # over already: nothing happens
    assert len(request.tokens) == length and request.state is LlmRequestState.ERROR
    assert (request.error, request.finish_time) == ("ValueError: boom", 7.0)
    assert sent == [Response(request.request_id, [], finished=True, error="ValueError: boom")]
    assert responses.finished == [request] and not responses.callbacks


def test_a_failed_batch_is_counted_and_fails_every_request():
    failures, kv, responses, sent = _failures()
    requests = [_generating(kv, responses, sent) for _ in range(3)]
    assert failures.fail_batch(requests[:2], RuntimeError("device lost")) == BatchFailure("device lost", 2)
    overshoot = TokenBudgetExceeded(total_num_tokens=70, max_num_tokens=64)
    assert failures.budget_exceeded(requests[2:], overshoot).num_failed_requests == 1
    assert (failures.num_failed_batches, failures.num_budget_violations) == (2, 1)
    assert failures.last_error == str(overshoot)
    assert all(r.state is LlmRequestState.ERROR for r in requests) and len(sent) == 3


def test_a_failed_forward_starts_its_requests_over_then_fails_them(caplog):
    failures, kv, responses, sent = _failures(max_forward_retries=1)
    request = _generating(kv, responses, sent)
    generated = request.output_token_ids
    retry, failure = failures.forward_failed([request], RuntimeError("xid 79"), iteration=3)
    assert retry == [request] and failure == BatchFailure("xid 79", 0, 1) and failures.num_failed_batches == 1
    failures.start_over(retry, drafter=None)
    # its KV is freed, it recomputes prompt + generated tokens as context, its output goes on
    assert not kv.is_allocated(request) and request.state is LlmRequestState.CONTEXT_INIT
    assert request.prompt_len == len(request.tokens) and request.output_token_ids == generated
    retry, failure = failures.forward_failed([request], RuntimeError("xid 79"), iteration=4)
    assert retry == [] and failure == BatchFailure("xid 79", 1, 0)  # no token since: its retry is spent
    assert request.state is LlmRequestState.ERROR and sent[-1].error == "RuntimeError: xid 79"
    assert "the forward failed" in caplog.text


def test_a_request_that_starts_over_beyond_one_forward_fails_when_chunked_prefill_is_off():
    failures, kv, responses, sent = _failures(enable_chunked_prefill=False, max_num_tokens=8)
    request = _generating(kv, responses, sent, prompt_len=8)  # 8 + 1 generated: no longer fits one forward
    failures.start_over([request], drafter=None)
    assert request.state is LlmRequestState.ERROR and "exceeds max_num_tokens 8" in request.error
    assert not kv.is_allocated(request)


def test_recover_fails_everything_and_keeps_the_error():
    failures, kv, responses, sent = _failures()
    requests = [_generating(kv, responses, sent) for _ in range(2)]
    failures.recover(requests, KeyError("bug"))
    assert failures.last_error == repr(KeyError("bug")) and failures.num_failed_batches == 0
    assert [r.finished for r in sent] == [True, True] and responses.finished == requests


@pytest.mark.parametrize("keep", [set(), {1}])
def test_finished_requests_in_a_forward_in_flight_wait_to_be_freed(keep):
    responses = Responses()
    a, b, c = (make_request(prompt_len=4, request_id=i) for i in range(3))
    for request in (a, b, c):
        responses.end(request)
    freed = responses.take_finished(keep)
    assert freed == [r for r in (a, b, c) if r.request_id not in keep]
    assert responses.finished == [r for r in (a, b, c) if r.request_id in keep]
