"""What a launch writes on its requests (``iteration.launch``), what admission does with what
the loop hands a step (``iteration.admission``), and the statistics log (``iteration.stats``).

Real requests, a real KV manager and real prepared batches; a forward is launched by hand.
"""

from __future__ import annotations

import logging

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.response import Response
from tensorrt_llm._torch.pyexecutor.iteration.admission import Admission
from tensorrt_llm._torch.pyexecutor.iteration.failures import Failures
from tensorrt_llm._torch.pyexecutor.iteration.launch import advance, budget_bound, drop_in_flight_tokens, record_prepared
from tensorrt_llm._torch.pyexecutor.iteration.responses import Responses
from tensorrt_llm._torch.pyexecutor.iteration.stats import IterationStats, StatsLog
from tensorrt_llm._torch.pyexecutor.kv_cache.values import ClaimRecord
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, DeferReason, LlmRequestState, RequestCounters
from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch
from tensorrt_llm._torch.pyexecutor.scheduled_requests import Deferral
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tests.helpers.factories import make_batch, make_config, make_kv_cache_manager, make_request, make_resource_manager, run_alone

P = IN_FLIGHT_TOKEN_ID


def _generating(kv, **kwargs):
    request = make_request(prompt_len=8, **kwargs)
    assert run_alone(kv, request, SyntheticSampler(1000))
    return request


# ---- record_prepared: what prepare_resources decided, on the requests ----------------
def test_deferrals_reuse_and_a_resumption_are_recorded_on_their_requests():
    kv = make_kv_cache_manager()
    budget, capacity, reusing, resumed = (make_request(prompt_len=12) for _ in range(4))
    resumed.complete_context_chunk(8)
    resumed.preempt()  # 8 positions had KV
    prepared = PreparedBatch(
        scheduled=make_batch([reusing, resumed]),
        deferred=[Deferral(budget, DeferReason.BUDGET, cost=12), Deferral(capacity, DeferReason.CAPACITY)],
        claims=[ClaimRecord(reusing, 8, 8, 12), ClaimRecord(resumed, 4, 4, 12, onboarded_tokens=4)],
    )
    assert record_prepared(prepared, iteration=5) is prepared
    assert budget.py_budget_deferred and budget.counters == RequestCounters(
        budget_deferrals=1, consecutive_budget_deferrals=1, max_consecutive_budget_deferrals=1)
    assert capacity.counters == RequestCounters(capacity_deferrals=1) and not capacity.py_budget_deferred
    assert reusing.prepopulated_prompt_len == reusing.context_current_position == 8
    assert reusing.counters == RequestCounters()  # never preempted: nothing to count
    assert resumed.counters == RequestCounters(pauses=1, preemptions=1, recomputed_tokens=4, onboarded_tokens=4,
                                               resumed_iteration=5)


# ---- advance: requests move past the forward ----------------------------------------
def test_without_overlap_a_forward_moves_requests_on_and_writes_no_placeholder():
    kv = make_kv_cache_manager()
    first, last, gen = make_request(prompt_len=12), make_request(prompt_len=6), _generating(kv)
    batch = make_batch([(first, 8), last], [gen])
    flight = advance(batch, pending=None, launch=None, can_pick=None)
    assert (first.context_current_position, first.state) == (8, LlmRequestState.CONTEXT_INIT)
    assert (last.context_current_position, last.state) == (6, LlmRequestState.GENERATION_IN_PROGRESS)
    assert flight.sampling == [last, gen] and flight.slots == [None, None] and not flight.overlappable
    assert flight.request_ids == {first.request_id, last.request_id, gen.request_id}
    assert P not in gen.tokens and P not in last.tokens


def test_under_overlap_a_picked_token_gets_a_placeholder_per_position():
    kv = make_kv_cache_manager()
    plain, drafting, host = _generating(kv), _generating(kv), _generating(kv)
    drafting.py_draft_tokens = [3, 4]
    lengths = [len(r.tokens) for r in (plain, drafting, host)]
    batch = make_batch(generation=[plain, drafting, host])
    flight = advance(batch, None, None, can_pick=lambda r: r is not host)  # host: its token needs the host's sampler
    assert flight.slots == [1, 3, None] and not flight.overlappable
    assert [len(r.tokens) - n for r, n in zip((plain, drafting, host), lengths)] == [1, 3, 0]
    assert plain.tokens[-1] == drafting.tokens[-1] == P
    drop_in_flight_tokens(drafting)
    assert len(drafting.tokens) == lengths[1]


def test_a_first_draft_step_runs_once_and_a_deferral_is_paid_by_the_forward():
    kv = make_kv_cache_manager()
    request = _generating(kv, max_draft_len=2, is_first_draft=True)
    request.record_budget_deferral()
    advance(make_batch(generation=[request]), None, None, can_pick=None)
    assert not request.is_first_draft and not request.py_budget_deferred


def test_the_budget_bound_an_iteration_that_left_prompt_tokens_behind():
    kv = make_kv_cache_manager()
    waiting, finishing, gen = make_request(prompt_len=20), make_request(prompt_len=4), _generating(kv)
    assert budget_bound(make_batch([(waiting, 8)]), [gen, waiting])  # its prompt goes on after the batch
    assert not budget_bound(make_batch([finishing], [gen]), [gen, finishing])  # every prompt ends in it
    assert budget_bound(make_batch([finishing]), [gen, waiting, finishing])  # one left out entirely


# ---- admission ----------------------------------------------------------------------
def _admission(config=None):
    config = config or make_config()
    kv = make_kv_cache_manager(config)
    responses = Responses()
    failures = Failures(config, responses, make_resource_manager(config, kv), clock=lambda: 3.0)

    def validate(request):
        if request.max_new_tokens < 1:
            raise InvalidRequestError(f"request {request.request_id}: max_tokens must be >= 1")

    return Admission(config, validate, responses, failures, clock=lambda: 3.0), responses


def test_an_invalid_arrival_fails_alone_with_its_reason_and_the_others_are_admitted():
    admission, responses = _admission()
    sent: list[Response] = []
    good, bad = make_request(prompt_len=4), make_request(prompt_len=4, max_new_tokens=0)
    admitted = admission.admit([(good, None), (bad, lambda _, r: sent.append(r))], drafter=None)
    assert admitted == [good] and good.arrival_time == 3.0
    assert bad.state is LlmRequestState.ERROR and sent[0].finished and "max_tokens must be >= 1" in sent[0].error
    assert responses.finished == [bad]


def test_a_cancelled_request_ends_once_without_its_placeholders():
    admission, responses = _admission()
    sent: list[Response] = []
    kv = make_kv_cache_manager()
    request, other = _generating(kv), _generating(kv)
    responses.register(request.request_id, lambda _, r: sent.append(r))
    length = len(request.tokens)
    request.tokens.append(P)
    admission.cancel([request, other], {request.request_id, 999})
    admission.cancel([request, other], {request.request_id})  # over already
    assert request.is_cancelled and request.state is LlmRequestState.GENERATION_COMPLETE
    assert len(request.tokens) == length and request.finish_time == 3.0
    assert sent == [Response(request.request_id, [], finished=True, cancelled=True)]
    assert other.state is LlmRequestState.GENERATION_IN_PROGRESS and responses.finished == [request]


# ---- the statistics log -------------------------------------------------------------
def test_the_log_keeps_a_ring_and_a_failing_listener_stops_nobody(caplog):
    log = StatsLog(maxlen=2)
    heard: list[int] = []

    def broken(stats):
        raise RuntimeError("listener bug")

    log.add_listener(broken)
    log.add_listener(lambda stats: heard.append(stats.iteration))
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            log.publish(IterationStats(iteration=i, start_time=0.0))
    assert [s.iteration for s in log.snapshot()] == [1, 2] and heard == [0, 1, 2]
    assert [r.exc_info[1].args for r in caplog.records] == [("listener bug",)] * 3
