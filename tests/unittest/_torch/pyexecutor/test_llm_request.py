"""LlmRequest and ContextChunk: context progress, chunk windows and their reuse shift,
deferral records and preemption (pause)."""

import dataclasses

import pytest
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState, RequestCounters
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk


def test_chunk_is_clamped_to_the_remaining_prompt():
    request = make_request(prompt_len=10)
    assert ContextChunk.of(request, 4).size == 4
    assert ContextChunk.of(request, 25).size == 10

    request.complete_context_chunk(7)
    chunk = ContextChunk.of(request, 8)
    assert (chunk.start, chunk.size, chunk.end) == (7, 3, 10)  # only 3 prompt tokens are left


def test_zero_chunk_is_allowed_and_is_not_last():
    chunk = ContextChunk.of(make_request(prompt_len=10), 0)
    assert chunk.size == 0 and not chunk.is_last


@pytest.mark.parametrize("start, size", [(0, -1), (0, 11), (8, 3), (-1, 2)])
def test_a_window_outside_the_prompt_is_rejected(start, size):
    with pytest.raises(ValueError, match="no chunk"):
        ContextChunk(make_request(prompt_len=10), start, size)


def test_last_chunk_is_derived_from_the_window():
    request = make_request(prompt_len=12)
    assert not ContextChunk.of(request, 4).is_last
    assert ContextChunk.of(request, 12).is_last
    request.complete_context_chunk(4)
    assert ContextChunk.of(request, 8).is_last and not ContextChunk.of(request, 4).is_last


def test_reused_prefix_counts_as_first_chunk():
    request = make_request(prompt_len=12)
    request.reuse_prefix(8)
    assert request.is_first_context_chunk
    assert (request.prepopulated_prompt_len, request.context_current_position) == (8, 8)
    assert request.context_remaining_length == 4
    assert ContextChunk.of(request, 4).is_last
    with pytest.raises(ValueError, match="cannot reuse"):
        request.reuse_prefix(4)  # only a first chunk's allocation reuses, once
    with pytest.raises(ValueError, match="cannot reuse"):
        make_request(prompt_len=12).reuse_prefix(12)  # the last prompt token is always computed


def test_complete_context_chunk_advances_and_never_goes_back():
    request = make_request(prompt_len=10)
    request.complete_context_chunk(4)
    assert (request.context_current_position, request.context_remaining_length) == (4, 6)
    assert not request.is_first_context_chunk
    for bad in (3, 11):
        with pytest.raises(ValueError, match="cannot end"):
            request.complete_context_chunk(bad)
    request.complete_context_chunk(4)  # an empty chunk makes no progress
    request.complete_context_chunk(10)
    assert request.context_remaining_length == 0


@pytest.mark.parametrize(
    "prompt_len, size, reused, window",
    [
        (24, 8, 10, (10, 6)),  # shifted to [10, 18), floored to the block boundary 16: not the last chunk
        (24, 8, 8, (8, 8)),  # block-aligned reuse: the window just moves
        (24, 16, 12, (12, 12)),  # the shift makes it the last chunk: it keeps going to the end
        (24, 8, 20, (20, 4)),  # reuse beyond the chunk: the window moves past it, it does not vanish
        (24, 2, 9, (9, 2)),  # below one block: nothing to floor to, the window keeps its size
        (24, 8, 0, (0, 8)),  # no reuse: unchanged
    ],
)
def test_after_reuse_moves_the_window_onto_the_reused_prefix(prompt_len, size, reused, window):
    chunk = ContextChunk.of(make_request(prompt_len=prompt_len), size).after_reuse(reused, tokens_per_block=4)
    assert (chunk.start, chunk.size) == window
    assert chunk.reused == reused


def test_deferral_records():
    request = make_request(prompt_len=6)
    request.record_budget_deferral()
    request.record_budget_deferral()
    assert request.py_budget_deferred
    assert (request.counters.budget_deferrals, request.counters.consecutive_budget_deferrals) == (2, 2)
    request.record_forward()
    assert not request.py_budget_deferred and request.counters.consecutive_budget_deferrals == 0
    request.record_budget_deferral()
    request.record_capacity_deferral()
    assert request.counters == RequestCounters(budget_deferrals=3, consecutive_budget_deferrals=1,
                                               max_consecutive_budget_deferrals=2, capacity_deferrals=1)


def test_every_count_lives_in_the_one_counters_value():
    """Preemption, resumption and forward retries count into ``counters`` and nowhere else: a
    request's own fields are its settings, tokens, state and outputs."""
    request = make_request(prompt_len=6, max_new_tokens=8)
    request.complete_context_chunk(6)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.add_new_token(11)
    request.preempt()  # 6 prompt + 1 generated: 6 positions had KV
    assert request.counters == RequestCounters(pauses=1, preemptions=1, preempted_computed_tokens=6,
                                               awaiting_resumption=True)
    request.record_resumption(iteration=9, reused_tokens=4, onboarded_tokens=4)
    assert request.counters == RequestCounters(pauses=1, preemptions=1, recomputed_tokens=2, onboarded_tokens=4,
                                               resumed_iteration=9)
    assert request.can_retry_forward(1)
    request.retry_after_failed_forward()
    assert not request.can_retry_forward(1)  # no token since its last retry
    assert (request.counters.forward_retries, request.counters.retries_without_progress) == (1, 1)
    request.add_new_token(12)
    assert request.can_retry_forward(1)
    counted = {f.name for f in dataclasses.fields(RequestCounters)}
    assert not counted & {f.name for f in dataclasses.fields(LlmRequest)}
    assert not {f.name for f in dataclasses.fields(LlmRequest)} & {f"num_{name}" for name in counted}


def test_pause_restarts_as_context_and_keeps_generated_tokens():
    request = make_request(prompt_len=6, max_new_tokens=8)
    request.reuse_prefix(4)
    request.complete_context_chunk(6)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    for token in (11, 12, 13):
        request.add_new_token(token)

    request.pause()

    assert request.state is LlmRequestState.CONTEXT_INIT
    assert request.prompt_len == 9  # the generated tokens are recomputed as context
    assert request.tokens[6:].tolist() == [11, 12, 13]
    assert request.output_token_ids == [11, 12, 13]
    assert request.num_generated_tokens == 3
    assert request.orig_prompt_len == 6
    assert request.max_total_len == 14  # unchanged: the budget of new tokens is not reset
    assert request.context_current_position == 0 and request.prepopulated_prompt_len == 0
    assert request.is_first_context_chunk
    assert request.counters.pauses == 1

    request.pause()
    assert request.counters.pauses == 2


def test_finished_states():
    request = make_request(prompt_len=3)
    assert not request.is_finished
    request.state = LlmRequestState.GENERATION_TO_COMPLETE
    assert request.is_generation_in_progress_state and not request.is_finished
    request.set_error("boom")
    assert request.is_finished and request.error == "boom" and request.state is LlmRequestState.ERROR
