"""The remaining_budget re-check (``budget.recheck.recheck_remaining_budget``) on hand-made values:
charge order, full costs, cuts before deferrals, priority of requests deferred earlier; and, as a
property over random batches, its contract: what it admits fits, what it cuts keeps a unit, what it
defers is untouched, and a request deferred before is admitted whenever its full chunk fits."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.budget.recheck import cut_to_fit, recheck_remaining_budget
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk


def in_generation(prompt_len=4, **kwargs):
    request = make_request(prompt_len=prompt_len, **kwargs)
    request.complete_context_chunk(prompt_len)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.add_new_token(7)
    return request


def first(prompt_len, size, *, drafts=0):
    request = make_request(prompt_len=prompt_len)
    request.py_draft_tokens = [5] * drafts
    return ContextChunk.of(request, size)


def recheck(generation=(), later=(), firsts=(), *, max_num_tokens=32, can_shift=True, unit=4, tpb=4,
            estimated_reusable=None):
    return recheck_remaining_budget(
        list(generation), list(later), list(firsts), max_num_tokens,
        reuse_can_shift=can_shift, cut_unit=unit, tokens_per_block=tpb, estimated_reusable=estimated_reusable,
    )


def test_fixed_costs_are_charged_first_and_everything_that_fits_is_admitted_as_is():
    gens = [in_generation(beam_width=2), in_generation()]  # 2 + 1
    a, b = first(10, 10), first(12, 8)
    decision = recheck(gens, firsts=[a, b], max_num_tokens=32)
    assert decision.generation == gens
    assert decision.chunks == {a.request.request_id: a, b.request.request_id: b}
    assert (decision.charged, decision.remaining_budget, decision.deferred, decision.cut) == (21, 11, [], [])


def test_an_overflowing_first_chunk_is_cut_to_the_largest_unit_multiple_that_fits():
    gens = [in_generation() for _ in range(3)]
    chunk = first(40, 32)  # full cost 32 > the 29 left
    decision = recheck(gens, firsts=[chunk], max_num_tokens=32)
    cut = decision.chunks[chunk.request.request_id]
    assert (cut.start, cut.size) == (0, 28) and decision.cut == [cut]
    assert decision.charged == 31 and not decision.deferred


def test_a_cut_keeps_the_drafts_a_reuse_shift_could_add_to_its_bound():
    chunk = first(40, 32, drafts=2)
    decision = recheck(firsts=[chunk], max_num_tokens=29)
    cut = decision.chunks[chunk.request.request_id]
    assert cut.size == 24 and cut.cost(reuse_can_shift=True) == 26 == decision.charged
    # without reuse the window cannot move: the cut chunk is not the last and carries no drafts
    exact = recheck(firsts=[chunk], max_num_tokens=29, can_shift=False)
    assert exact.chunks[chunk.request.request_id].size == 28 and exact.charged == 28


def test_a_request_for_which_not_one_unit_fits_is_deferred_untouched():
    gens = [in_generation() for _ in range(29)]
    chunk = first(40, 32)
    decision = recheck(gens, firsts=[chunk], max_num_tokens=32)  # 3 left < one unit of 4
    assert decision.deferred == [(chunk.request, 32)] and decision.chunks == {}
    assert chunk.request.context_current_position == 0


def test_without_cuts_an_overflowing_chunk_is_deferred():
    chunk = first(40, 32)
    decision = recheck(firsts=[chunk], max_num_tokens=20, unit=0)
    assert decision.deferred == [(chunk.request, 32)]


def test_a_last_chunk_is_cut_below_the_end_of_its_prompt():
    chunk = first(16, 16, drafts=3)  # last chunk: 16 + 3 drafts
    decision = recheck(firsts=[chunk], max_num_tokens=17, can_shift=False)
    cut = decision.chunks[chunk.request.request_id]
    assert (cut.size, cut.is_last, cut.cost()) == (16 - 4, False, 12)


def test_requests_deferred_earlier_come_first():
    owed, fresh = first(20, 20), first(20, 20)
    owed.request.record_budget_deferral()
    decision = recheck(firsts=[fresh, owed], max_num_tokens=24, unit=0)
    assert list(decision.chunks) == [owed.request.request_id]
    assert decision.deferred == [(fresh.request, 20)]


def test_later_chunks_are_charged_exactly_before_first_chunks():
    later = ContextChunk(make_request(prompt_len=30), 8, 8)
    chunk = first(20, 20, drafts=2)
    decision = recheck(later=[later], firsts=[chunk], max_num_tokens=29)
    assert decision.chunks[later.request.request_id] == later
    # 21 left: 20 + 2 drafts does not fit; 16 tokens + the 2 drafts a reuse shift could add do
    assert decision.chunks[chunk.request.request_id].size == 16


@pytest.mark.parametrize(
    "start, room, unit, end",
    [
        (0, 29, 4, 28),
        (10, 9, 4, 16),  # a window moved onto a claimed prefix ends on a block boundary
        (10, 1, 4, None),  # no boundary within reach: not even a block fits
        (0, 3, 4, None),
    ],
)
def test_cut_to_fit(start, room, unit, end):
    chunk = ContextChunk(make_request(prompt_len=64), start, 40)
    cut = cut_to_fit(chunk, room, unit, reuse_can_shift=False)
    assert (cut.end if cut else None) == end


def test_a_chunk_expecting_reuse_is_cut_to_finish_its_prompt_with_room_from_an_earlier_chunk():
    long = first(400, 64)  # expects no reuse: its prompt continues next iteration anyway
    reuser = first(100, 100)  # expects 90 cached tokens: 10 left, one unit finishes it
    decision = recheck(
        firsts=[long, reuser], max_num_tokens=68, unit=8, tpb=8,
        estimated_reusable={reuser.request.request_id: 90},
    )
    # 4 tokens were left after the long chunk; the reuser needs 16 (2 units) to finish if its
    # reuse materialises: the long chunk gives 16 back
    assert decision.chunks[long.request.request_id].size == 48
    assert decision.chunks[reuser.request.request_id].size == 16
    assert decision.charged == 64 and not decision.deferred


def test_room_is_taken_only_when_all_of_it_can_be_had():
    long = first(400, 8)  # one unit: it has nothing to give
    reuser = first(100, 100)
    decision = recheck(
        firsts=[long, reuser], max_num_tokens=12, unit=8, tpb=8,
        estimated_reusable={reuser.request.request_id: 90},
    )
    assert decision.chunks[long.request.request_id].size == 8
    assert decision.deferred == [(reuser.request, 100)]  # 4 left: not even one unit


@st.composite
def batches(draw):
    """Generation steps and first chunks (some deferred before, some with drafts), a budget, a unit."""
    unit = draw(st.sampled_from([1, 4, 16]))
    generation = [in_generation(beam_width=draw(st.integers(1, 3))) for _ in range(draw(st.integers(0, 4)))]
    firsts = []
    for _ in range(draw(st.integers(1, 6))):
        prompt_len = draw(st.integers(1, 96))
        chunk = first(prompt_len, draw(st.integers(1, prompt_len)), drafts=draw(st.sampled_from([0, 0, 2])))
        chunk.request.py_budget_deferred = draw(st.booleans())
        firsts.append(chunk)
    return generation, firsts, draw(st.integers(1, 128)), unit, draw(st.booleans())


@given(batches())
def test_the_recheck_keeps_its_contract_on_any_batch(batch):
    generation, firsts, budget, unit, chunked = batch
    before = {c.request.request_id: (c.start, c.size) for c in firsts}
    decision = recheck(generation, firsts=firsts, max_num_tokens=budget, unit=unit if chunked else 0, tpb=unit)
    admitted = [decision.chunks[c.request.request_id] for c in firsts if c.request.request_id in decision.chunks]
    charged = sum(map(forward_cost, decision.generation)) + sum(c.cost(reuse_can_shift=True) for c in admitted)
    # what it admits fits, charged at full cost (reuse not discounted)
    assert charged == decision.charged <= budget
    deferred = {r.request_id for r, _ in decision.deferred}
    for chunk in firsts:
        rid = chunk.request.request_id
        assert (rid in deferred) != (rid in decision.chunks)  # each first chunk: admitted or deferred
        if rid in decision.chunks:
            ran = decision.chunks[rid]
            assert ran.start == chunk.start and 1 <= ran.size <= chunk.size
            if ran.size < chunk.size:  # a cut chunk ends on a unit boundary and is not the last
                assert chunked and ran.end % unit == 0 and not ran.is_last
        # the re-check decides; it never moves a request
        assert (chunk.start, chunk.size) == before[rid]
    # a request deferred before goes first: if its whole chunk fits beside the generation steps, it runs
    fixed = sum(map(forward_cost, decision.generation))
    room = budget - fixed
    for chunk in firsts:  # in scheduler order, the requests deferred before take the room first
        if not chunk.request.py_budget_deferred:
            continue
        if chunk.request.request_id in decision.chunks:
            room -= decision.chunks[chunk.request.request_id].cost(reuse_can_shift=True)
        else:
            assert chunk.cost(reuse_can_shift=True) > room, "deferred twice although its chunk fitted"
