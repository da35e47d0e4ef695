"""Drafts under the overlap scheduler, piece by piece: a verification step as decode rows, the next
forward built as if every draft were accepted, and the engine moving it back over the rejected
ones (on the host: ``ForwardInputs.resolve``; on the device: ``device_verification``, checked here on
CPU tensors against a plan built where the drafts really stopped).

The executor-level properties (greedy outputs equal plain decoding with overlap on, the budget
invariants after every step) are ``test_property_speculative.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.factories import make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.attention_backend.paged import PagedPlanBuilder
from tensorrt_llm._torch.pyexecutor.engine.interface import ForwardOutput, picks_of
from tensorrt_llm._torch.pyexecutor.engine.inputs import PAD_TOKEN_ID, ForwardInputs
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequestState
from tensorrt_llm._torch.speculative.device_verification import accept_on_device, move_back_, positions_after_acceptance
from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts
from tensorrt_llm._torch.speculative.verification import accept_greedy


class _Tables:
    """The one question ForwardInputs asks a KV manager, answered from a dict."""

    def __init__(self, tables: dict[int, list[int]]) -> None:
        self.tables = tables

    def block_table(self, request) -> list[int]:
        return self.tables[request.request_id]


def _generation(prompt_len: int, generated: list[int], drafts: list[int], *, first_draft: int = 0, seed: int = 0):
    request = make_request(prompt_len=prompt_len, max_new_tokens=64, seed=seed)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.complete_context_chunk(prompt_len)
    request.tokens.extend(generated)
    request.py_draft_tokens = list(drafts)
    if first_draft:
        request.max_draft_len, request.is_first_draft = first_draft, True
    return request


def test_a_verification_step_is_one_decode_row_per_position_over_the_requests_table():
    plain = _generation(5, [7], [])
    verifying = _generation(9, [3], [11, 12, 13])
    first = _generation(4, [8], [21], first_draft=3)
    inputs = ForwardInputs(_Tables({plain.request_id: [1, 2], verifying.request_id: [3, 4, 5], first.request_id: [6, 7]}))
    inputs.append_generation([plain, verifying, first])
    new, cached, tables = inputs.attention_batch()
    assert new == [1] * 9
    assert cached == [5, 9, 10, 11, 12, 4, 5, 6, 7]  # the first draft's padding too
    assert tables[1:5] == [[3, 4, 5]] * 4 and tables[5:] == [[6, 7]] * 4
    assert inputs.input_ids == [7, 3, 11, 12, 13, 8, 21, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert inputs.verified_drafts() == {verifying.request_id: [11, 12, 13], first.request_id: [21]}
    assert [inputs.sampling_input_id(i) for i in range(3)] == [7, 3, 8]
    assert [inputs.sampling_position(i) for i in range(3)] == [5, 9, 4]


def test_resolve_fills_the_in_flight_token_and_moves_a_speculative_request_back():
    """Built on a forward in flight that verifies 3 drafts (tokens end with 4 placeholders), the
    request's step starts after them; that forward accepted 1 draft (rejected 2): the step moves
    back 2 positions and takes the token after the accepted draft."""
    request = _generation(6, [5], [31, 32])
    request.tokens.extend([IN_FLIGHT_TOKEN_ID] * 4)
    plain = _generation(3, [4, IN_FLIGHT_TOKEN_ID], [])
    inputs = ForwardInputs()
    inputs.append_generation([request, plain])
    assert inputs.in_flight == [(0, 0), (3, 1)]
    assert inputs.position_ids == [10, 11, 12, 4]
    assert inputs.in_flight_slots == {0: 3}
    # the forward in flight accepted one draft (31), then picked 99: its run is two of the four tokens
    inputs.resolve({request.request_id: 99, plain.request_id: 77}, {request.request_id: [31, 99]})
    assert inputs.input_ids == [99, 31, 32, 77]
    assert inputs.position_ids == [8, 9, 10, 4]
    assert inputs.num_cached_tokens == [8, 4]


def test_picks_of_a_host_forward_accept_greedily():
    output = ForwardOutput(logits={}, greedy_tokens={1: 5, 2: 9, 3: 4, 4: 6},
                           draft_targets={1: [5, 6, 7, 8], 3: [4, 1]}, verified_drafts={1: [5, 6, 0], 3: [2], 4: [3, 3]})
    picks = picks_of(output)
    assert picks.tokens[1] == 7 and picks.runs[1] == [5, 6, 7]  # accepted 5, 6; the target after them
    assert picks.tokens[2] == 9 and 2 not in picks.runs
    assert picks.tokens[3] == 4 and picks.runs[3] == [4]
    assert picks.runs[4] == (6,)  # an engine without a model: every draft rejected, its own pick


def test_resolve_proposes_the_engine_drafts_from_the_tokens_the_previous_forward_produced():
    """A step with three draft slots, built while the forward before it verifies two drafts (its
    tokens end with three placeholders): resolve hands the proposal the request's known tokens
    followed by that forward's run, never the drafts it was verifying."""
    request = _generation(2, [], [IN_FLIGHT_TOKEN_ID] * 3)
    del request.tokens[:]
    request.tokens.extend([1, 2, 3, 4, 5, 6, 7, 1, IN_FLIGHT_TOKEN_ID, IN_FLIGHT_TOKEN_ID, IN_FLIGHT_TOKEN_ID])
    inputs = ForwardInputs()
    inputs.append_generation([request])
    assert [tuple(e) for e in inputs.engine_drafts] == [(0, 1, 3, 8)]
    seen = []

    def propose(histories, rooms):
        seen.append((histories, rooms))
        return [propose_ngram_drafts(np.asarray(h), room, 2) for h, room in zip(histories, rooms)]

    # the forward in flight verified drafts [9, 9] (wrong): it accepted none and picked 2
    inputs.resolve({request.request_id: 2}, {request.request_id: [2]}, propose)
    assert seen == [([[1, 2, 3, 4, 5, 6, 7, 1, 2]], [3])]
    assert inputs.input_ids == [2, 3, 4, 5]  # the run's last token, then the drafts after "1 2"
    assert inputs.position_ids == [8, 9, 10, 11]  # moved back over the two slots not accepted
    assert inputs.verified_drafts() == {request.request_id: [3, 4, 5]}


def test_resolve_pads_the_slots_a_proposal_leaves_empty():
    request = _generation(3, [7], [IN_FLIGHT_TOKEN_ID] * 2)
    inputs = ForwardInputs()
    inputs.append_generation([request])
    inputs.resolve({}, {}, lambda histories, rooms: [[] for _ in histories])
    assert inputs.input_ids[1:] == [PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert inputs.verified_drafts() == {request.request_id: []}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), st.data()), min_size=1, max_size=6))
def test_device_acceptance_is_accept_greedy(cases):
    drafts_all, targets_all = [], []
    for drafts, data in cases:
        targets = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
        drafts_all.append(drafts)
        targets_all.append(targets)
    # the forward's picks laid out as ForwardInputs.logit_layout does: sampling rows, then draft rows
    tokens, rows = [t[0] for t in targets_all], []
    for targets in targets_all:
        first = len(tokens)
        tokens += targets[1:]
        rows.append((first, len(targets) - 1))
    width = 1 + max(len(d) for d in drafts_all)
    target_rows = np.zeros((len(cases), width), dtype=np.int64)
    draft_tokens = np.full((len(cases), width - 1), -1, dtype=np.int64)
    for s, ((first, count), drafts) in enumerate(zip(rows, drafts_all)):
        target_rows[s] = [s, *range(first, first + count), *[first + count - 1 if count else s] * (width - 1 - count)]
        draft_tokens[s, :count] = drafts
    targets, accepted = accept_on_device(torch.tensor(tokens), torch.from_numpy(target_rows),
                                         torch.from_numpy(draft_tokens))
    for s, (drafts, want) in enumerate(zip(drafts_all, targets_all)):
        run = accept_greedy(drafts, want)
        assert targets[s, : int(accepted[s]) + 1].tolist() == run


@pytest.mark.parametrize("rejected", [(0, 0), (2, 1), (3, 0), (1, 3)])
def test_moving_a_forward_back_equals_building_it_where_the_drafts_stopped(rejected):
    """A forward of a context chunk, a plain decode and two verification steps built on drafts in
    flight (optimistic positions), moved back on the "device" (the host's candidate positions and
    slots, ``positions_after_acceptance``, picked by the count accepted: ``move_back_``), holds the
    positions, KV slots and attended lengths of the same forward built at the true positions."""
    tpb = 4
    tables = [[9, 2], [5, 6, 7], [11, 1, 3, 8], [10, 4, 0]]

    def forward(back: tuple[int, int]):
        # request 0: a 3-token chunk after 2 cached; 1: a decode at 6; 2 and 3: verification
        # steps of 4 rows (3 drafts) built at 9 and 7, moved back by ``back``
        sequences = [(3, 2)] + [(1, 6)] + [(1, 9 - back[0] + j) for j in range(4)] + [(1, 7 - back[1] + j) for j in range(4)]
        owners = [tables[0], tables[1]] + [tables[2]] * 4 + [tables[3]] * 4
        new, cached = [n for n, _ in sequences], [c for _, c in sequences]
        plan = PagedPlanBuilder("cpu", tokens_per_block=tpb, num_blocks=12, num_kv_heads=2).build(new, cached, owners)
        positions = torch.tensor([c + j for n, c in sequences for j in range(n)])
        return plan, positions

    plan, positions = forward((0, 0))
    rows = np.arange(4, 12)  # the flat rows of requests 2 and 3: the eager plan's decode sequences 1 .. 8
    base, candidates = [], []
    for flat, table in ((4, tables[2]), (8, tables[3])):  # each verified 3 drafts in the forward before
        request_base, request_slots = positions_after_acceptance(positions[flat : flat + 4].tolist(), 3, table, 4, tpb)
        base += request_base
        candidates += request_slots
    accepted = torch.tensor([3 - rejected[0]] * 4 + [3 - rejected[1]] * 4)
    move_back_(positions, plan.new_slots, plan.decode.seq_lens, torch.from_numpy(rows), torch.arange(1, 9),
               torch.tensor(base), torch.tensor(candidates).view(8, 4), accepted)
    truth, true_positions = forward(rejected)
    assert torch.equal(positions, true_positions)
    assert torch.equal(plan.new_slots, truth.new_slots)
    assert torch.equal(plan.decode.seq_lens, truth.decode.seq_lens)


def test_a_request_in_flight_gets_draft_slots_never_drafts_from_unverified_tokens():
    """In flight, the host knows the request's tokens only up to the forward in flight: it gives
    it slots for the engine to fill (an engine with a proposer), or no drafts; with all its tokens
    known, the n-gram drafter proposes as usual."""
    from tensorrt_llm._torch.pyexecutor.config import SpeculativeConfig
    from tensorrt_llm._torch.pyexecutor.sampling.drafter import NGramDrafter

    drafter = NGramDrafter(SpeculativeConfig(max_draft_len=3, max_matching_ngram_size=2), 4096)
    request = _generation(2, [], [])
    request.max_draft_len = 3
    del request.tokens[:]
    request.tokens.extend([1, 2, 3, 4, 5, 6, 7, 1, 2])
    drafter.prepare_draft_tokens([request])
    assert request.py_draft_tokens == [3, 4, 5]
    request.tokens.extend([IN_FLIGHT_TOKEN_ID] * 4)  # 3, 4, 5 and the token after them in flight
    drafter.prepare_draft_tokens([request], engine_proposes=True)
    assert request.py_draft_tokens == [IN_FLIGHT_TOKEN_ID] * 3
    drafter.prepare_draft_tokens([request], engine_proposes=False)
    assert request.py_draft_tokens == []


def test_the_decode_graphs_hold_a_full_batch_of_verification_rows():
    from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig

    assert max(CudaGraphConfig().resolve_batch_sizes(8 * (1 + 4))) == 40
