"""``_prepare_tp_inputs``: positions per request kind (equal to ``forward_cost``) and the
budget assertion's exact message."""

import pytest
from tests.helpers.factories import VOCAB, make_batch, make_config, make_kv_cache_manager, make_request, prepare_alone

from tensorrt_llm._torch.pyexecutor.engine.inputs import prepare_tp_inputs
from tensorrt_llm._torch.pyexecutor.engine.logit_rows import draft_targets
from tensorrt_llm._torch.pyexecutor.errors import TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import PAD_TOKEN_ID
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine


def engine_for(max_num_tokens=256, **overrides):
    config = make_config(max_num_tokens=max_num_tokens, **overrides)
    kv = make_kv_cache_manager(config)
    return SimulatedModelEngine(max_num_tokens, kv, vocab_size=VOCAB), kv


def in_generation(kv, request, *, new_tokens=1):
    """Prefill ``request`` alone, then leave it in generation with ``new_tokens`` sampled."""
    allocation = prepare_alone(kv, request)
    assert not allocation.deferred
    request.complete_context_chunk(request.prompt_len)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    for i in range(new_tokens):
        request.add_new_token(100 + i)
    kv.commit(allocation.scheduled)
    return request


def build(engine, kv, *, context=(), generation=()):
    """Allocate the batch (``context`` as in ``make_batch``) and build its inputs."""
    allocation = kv.prepare_resources(make_batch(context, generation))
    assert not allocation.deferred, allocation
    for claim in allocation.claims:
        if claim.reused_tokens:
            claim.request.reuse_prefix(claim.reused_tokens)
    return prepare_tp_inputs(allocation.scheduled, kv, engine.max_num_tokens)


def test_context_chunk_appends_its_chunk():
    engine, kv = engine_for()
    request = make_request(prompt_len=20)
    inputs = build(engine, kv, context=[(request, 8)])
    assert inputs.num_new_tokens == [8] == [forward_cost(request, 8)]
    assert inputs.input_ids == request.tokens[:8].tolist()
    assert inputs.position_ids == list(range(8))
    assert inputs.samples == [False]  # a non-last chunk produces no token


def test_later_chunk_starts_where_the_last_one_stopped():
    engine, kv = engine_for()
    request = make_request(prompt_len=20)
    build(engine, kv, context=[(request, 8)])
    request.complete_context_chunk(8)
    inputs = build(engine, kv, context=[(request, 100)])  # clamped to the 12 tokens left
    assert inputs.num_new_tokens == [12] == [forward_cost(request, 100)]
    assert inputs.position_ids == list(range(8, 20))
    assert inputs.num_cached_tokens == [8]
    assert inputs.samples == [True]


def test_last_chunk_carries_the_draft_tokens():
    engine, kv = engine_for()
    request = make_request(prompt_len=6)
    request.py_draft_tokens = [5, 6, 7]
    inputs = build(engine, kv, context=[request])
    assert inputs.num_new_tokens == [9] == [forward_cost(request, 6)]
    assert inputs.input_ids == request.tokens[:6].tolist() + [5, 6, 7]
    assert inputs.position_ids == list(range(9))


def test_non_last_chunk_leaves_the_drafts_out():
    engine, kv = engine_for()
    request = make_request(prompt_len=16)
    request.py_draft_tokens = [5, 6]
    inputs = build(engine, kv, context=[(request, 8)])
    assert inputs.num_new_tokens == [8] == [forward_cost(request, 8)]
    assert forward_cost(request, 8, reuse_can_shift=True) == 10  # reuse could have made it the last chunk


def test_chunk_after_reuse_starts_at_the_reused_prefix():
    engine, kv = engine_for(enable_partial_reuse=False)
    first = in_generation(kv, make_request(prompt_len=12))
    kv.free(first)  # its 3 prompt blocks stay cached
    request = make_request(first.input_token_ids + [1, 2])
    inputs = build(engine, kv, context=[(request, 14)])
    assert request.prepopulated_prompt_len == 12
    assert inputs.num_new_tokens == [2] == [forward_cost(request, 14)]
    assert inputs.input_ids == [1, 2]
    assert inputs.position_ids == [12, 13]
    assert inputs.num_cached_tokens == [12]


@pytest.mark.parametrize("beam_width", [1, 2, 4])
def test_plain_generation_appends_one_position_per_beam(beam_width):
    engine, kv = engine_for()
    request = in_generation(kv, make_request(prompt_len=5, beam_width=beam_width))
    inputs = build(engine, kv, generation=[request])
    assert inputs.num_new_tokens == [beam_width] == [forward_cost(request)]
    assert inputs.input_ids == [request.tokens[-1]] * beam_width
    assert inputs.num_cached_tokens == [5]  # the newest token (position 5) has no KV yet


def test_generation_with_drafts_appends_the_drafts():
    engine, kv = engine_for()
    request = in_generation(kv, make_request(prompt_len=5, max_draft_len=3))
    request.py_draft_tokens = [8, 9]
    inputs = build(engine, kv, generation=[request])
    assert inputs.num_new_tokens == [3] == [forward_cost(request)]
    assert inputs.input_ids == [request.tokens[-1], 8, 9]
    assert inputs.position_ids == [5, 6, 7]


def test_first_draft_pads_to_max_draft_len():
    engine, kv = engine_for()
    request = in_generation(kv, make_request(prompt_len=5, max_draft_len=4, is_first_draft=True))
    inputs = build(engine, kv, generation=[request])
    assert inputs.num_new_tokens == [5] == [forward_cost(request)]
    assert inputs.input_ids == [request.tokens[-1]] + [PAD_TOKEN_ID] * 4


def test_mixed_batch_total_is_the_sum_of_forward_costs():
    engine, kv = engine_for()
    chunk = make_request(prompt_len=30)
    last = make_request(prompt_len=7)
    last.py_draft_tokens = [1, 2]
    beams = in_generation(kv, make_request(prompt_len=4, beam_width=3))
    drafts = in_generation(kv, make_request(prompt_len=4, max_draft_len=2))
    drafts.py_draft_tokens = [3, 4]
    first_draft = in_generation(kv, make_request(prompt_len=4, max_draft_len=5, is_first_draft=True))
    batch = [chunk, last, beams, drafts, first_draft]
    inputs = build(engine, kv, context=[(chunk, 12), last], generation=[beams, drafts, first_draft])
    assert inputs.num_new_tokens == [12, 9, 3, 3, 6]
    assert inputs.num_new_tokens == [ContextChunk.of(chunk, 12).cost(), forward_cost(last, 7)] + [
        forward_cost(r) for r in batch[2:]
    ]
    assert inputs.total_num_tokens == len(inputs.position_ids) == 33
    assert inputs.requests == batch
    assert inputs.samples == [False, True, True, True, True]


def test_logit_rows_put_the_sampling_rows_first_then_each_verifying_requests_draft_rows():
    """The mixed batch above: sampling rows are each request's last position before its drafts
    and padding; the draft rows follow them, one per draft (padding is never verified)."""
    engine, kv = engine_for()
    chunk = make_request(prompt_len=30)
    last = make_request(prompt_len=7)
    last.py_draft_tokens = [1, 2]
    drafts = in_generation(kv, make_request(prompt_len=4, max_draft_len=2))
    drafts.py_draft_tokens = [3, 4]
    first_draft = in_generation(kv, make_request(prompt_len=4, max_draft_len=5, is_first_draft=True))
    first_draft.py_draft_tokens = [6]
    inputs = build(engine, kv, context=[(chunk, 12), last], generation=[drafts, first_draft])
    # flat positions: chunk 0-11, last 12-20 (prompt 12-18, drafts 19-20), drafts 21-23, first draft 24-29
    rows, request_ids, prompt_spans, spans, beams = inputs.logit_layout()
    assert prompt_spans == beams == []  # no request asked for prompt log-probabilities, none runs beams
    assert request_ids == [last.request_id, drafts.request_id, first_draft.request_id]
    assert rows == [18, 21, 24, 19, 20, 22, 23, 25]
    assert spans == [(last.request_id, 0, 3, 2), (drafts.request_id, 1, 5, 2), (first_draft.request_id, 2, 7, 1)]
    assert inputs.num_drafts == [0, 2, 2, 1]
    picks = [100 + row for row in rows]
    assert draft_targets(picks, spans) == {
        last.request_id: [118, 119, 120], drafts.request_id: [121, 122, 123], first_draft.request_id: [124, 125],
    }


def test_budget_exceeded_message_is_upstreams_assertion():
    engine, kv = engine_for(max_num_tokens=16)
    a, b = make_request(prompt_len=12), make_request(prompt_len=9)
    with pytest.raises(TokenBudgetExceeded) as error:
        build(engine, kv, context=[a, b])
    assert str(error.value) == "total_num_tokens (21) should be less than or equal to max_num_tokens (16)"
    assert (error.value.total_num_tokens, error.value.max_num_tokens, error.value.overshoot) == (21, 16, 5)


def test_exactly_the_budget_is_allowed():
    engine, kv = engine_for(max_num_tokens=16)
    a, b = make_request(prompt_len=12), make_request(prompt_len=4)
    assert build(engine, kv, context=[a, b]).total_num_tokens == 16
