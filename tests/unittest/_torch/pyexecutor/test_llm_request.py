"""LlmRequest: context-chunk bookkeeping and preemption (pause)."""

import pytest
from factories import make_request

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState


def test_chunk_size_is_clamped_to_the_remaining_prompt():
    request = make_request(prompt_len=10)
    request.context_chunk_size = 4
    assert request.context_chunk_size == 4
    request.context_chunk_size = 25
    assert request.context_chunk_size == 10

    request.context_current_position = 7
    request.context_chunk_size = 8
    assert request.context_chunk_size == 3  # only 3 prompt tokens are left


def test_zero_chunk_is_allowed():
    request = make_request(prompt_len=10)
    request.context_chunk_size = 0
    assert request.context_chunk_size == 0
    assert not request.is_last_context_chunk


@pytest.mark.parametrize("size", [-1, -100])
def test_negative_chunk_size_is_rejected(size):
    request = make_request(prompt_len=10)
    request.context_chunk_size = 4
    with pytest.raises(ValueError, match="context_chunk_size must be >= 0"):
        request.context_chunk_size = size
    assert request.context_chunk_size == 4  # the rejected value left nothing behind


def test_first_and_last_chunk_are_derived_from_the_current_position():
    request = make_request(prompt_len=12)
    request.context_chunk_size = 4
    assert request.is_first_context_chunk and not request.is_last_context_chunk

    request.move_to_next_context_chunk()
    assert not request.is_first_context_chunk
    request.context_chunk_size = 8
    assert request.is_last_context_chunk

    # Changing the chunk afterwards changes the answer: nothing is cached.
    request.context_chunk_size = 4
    assert not request.is_last_context_chunk


def test_reused_prefix_counts_as_first_chunk():
    request = make_request(prompt_len=12)
    request.prepopulated_prompt_len = request.context_current_position = 8  # what a claim of 8 reused tokens does
    request.context_chunk_size = 4
    assert request.is_first_context_chunk
    assert request.is_last_context_chunk
    assert request.context_remaining_length == 4


def test_move_to_next_context_chunk_advances_by_the_chunk_and_resets_it():
    request = make_request(prompt_len=10)
    request.context_chunk_size = 4
    request.move_to_next_context_chunk()
    assert (request.context_current_position, request.context_chunk_size) == (4, 0)
    assert request.context_remaining_length == 6

    request.context_chunk_size = 100
    request.move_to_next_context_chunk()
    assert request.context_current_position == request.prompt_len == 10
    assert request.context_remaining_length == 0


def test_move_with_a_zero_chunk_makes_no_progress():
    request = make_request(prompt_len=10)
    request.move_to_next_context_chunk()
    assert request.context_current_position == 0


def test_pause_restarts_as_context_and_keeps_generated_tokens():
    request = make_request(prompt_len=6, max_new_tokens=8)
    request.context_chunk_size = 6
    request.move_to_next_context_chunk()
    request.prepopulated_prompt_len = 4
    request.estimated_reusable_tokens = 4
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    for token in (11, 12, 13):
        request.add_new_token(token)

    request.pause()

    assert request.state is LlmRequestState.CONTEXT_INIT
    assert request.prompt_len == 9  # the generated tokens are recomputed as context
    assert request.tokens[6:] == [11, 12, 13]
    assert request.output_token_ids == [11, 12, 13]
    assert request.num_generated_tokens == 3
    assert request.orig_prompt_len == 6
    assert request.max_total_len == 14  # unchanged: the budget of new tokens is not reset
    assert request.context_current_position == 0 and request.context_chunk_size == 0
    assert request.prepopulated_prompt_len == 0 and request.estimated_reusable_tokens == 0
    assert request.is_first_context_chunk
    assert request.num_pauses == 1

    request.pause()
    assert request.num_pauses == 2


def test_finished_states():
    request = make_request(prompt_len=3)
    assert not request.is_finished
    request.state = LlmRequestState.GENERATION_TO_COMPLETE
    assert request.is_generation_in_progress_state and not request.is_finished
    request.set_error("boom")
    assert request.is_finished and request.error == "boom" and request.state is LlmRequestState.ERROR
