"""The overlap scheduler (``disable_overlap_scheduler=False``): iteration n+1 is scheduled and
prepared while forward n is in flight (see ``py_executor``). The stateful and property suites
run it too (``Overlap*`` machines, ``..._with_overlap_...``); these pin its rules down."""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.factories import make_config, make_request, make_sim_executor

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID
from tensorrt_llm.llmapi.llm import LLM, SamplingParams

MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")


def _serve_sim(overlap: bool, specs):
    executor = make_sim_executor(make_config(max_num_tokens=32, num_blocks=64), overlap=overlap)
    tokens: dict[int, list[int]] = {}
    in_flight_charged = 0
    for i, (prompt_len, max_new) in enumerate(specs):
        request = make_request(prompt_len=prompt_len, max_new_tokens=max_new, request_id=1000 + i, seed=i)
        tokens[request.request_id] = []
        executor.enqueue_request(request, lambda r, resp: tokens[r.request_id].extend(resp.new_token_ids))
    for _ in range(1000):
        if not executor.has_work:
            break
        previous = executor.in_flight_request_ids
        iteration = executor.step()
        if iteration is not None:  # a generation request scheduled while its last forward was in flight
            in_flight_charged += sum(r.request_id in previous for r in iteration.batch.generation_requests)
    assert not executor.has_work
    kv = executor.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free + kv.pool.num_cached == kv.pool.num_blocks
    forwards = sum(1 for s in executor.iteration_stats if s.forward_tokens)
    return tokens, in_flight_charged, forwards


def test_overlap_gives_the_same_tokens_and_forwards_as_the_plain_loop():
    specs = [(40, 5), (9, 1), (70, 7), (5, 3), (33, 2)]
    plain, charged_plain, forwards_plain = _serve_sim(False, specs)
    overlapped, charged, forwards = _serve_sim(True, specs)
    assert overlapped == plain
    assert all(IN_FLIGHT_TOKEN_ID not in t for t in overlapped.values())
    assert charged_plain == 0 and charged > 0, "no generation request was ever scheduled with its token in flight"
    # a request whose in-flight token is its last is not scheduled again: no wasted forward
    assert forwards == forwards_plain


def test_an_iterations_statistics_are_made_once_when_its_forward_completes():
    """Under overlap step n returns its launch; its statistics come with step n+1, made once
    (a frozen value) from that launch and what the completion measured."""
    executor = make_sim_executor(make_config(max_num_tokens=32, num_blocks=64), overlap=True)
    published = []
    executor.add_iteration_listener(published.append)
    executor.enqueue_request(make_request(prompt_len=20, max_new_tokens=3, request_id=1000, seed=1))
    first = executor.step()
    assert first.stats is None and published == []  # in flight
    assert first.launch.forward_tokens == 20 and first.error is None
    executor.step()
    stats = published[0]
    assert (stats.iteration, stats.forward_tokens, stats.start_time) == (
        first.launch.iteration, first.launch.forward_tokens, first.launch.start_time)
    assert stats.num_context_requests == 1 and stats.end_time >= stats.start_time
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.error = "written later"
    executor.run_until_idle()
    assert [s.iteration for s in executor.iteration_stats] == list(range(len(published)))
    plain = make_sim_executor(make_config(max_num_tokens=32, num_blocks=64))
    plain.enqueue_request(make_request(prompt_len=20, max_new_tokens=3, request_id=1000, seed=1))
    assert plain.step().stats == plain.iteration_stats[0]  # without overlap, in the step itself


@pytest.mark.usefixtures("one_torch_thread")
def test_a_request_stopping_while_its_next_step_is_in_flight_drops_that_step():
    """Upstream's way: the stop token's request was also in forward n+1; that token is dropped."""
    prompt = [5, 9, 3, 7, 11, 2, 8]
    with LLM(MODEL, max_num_tokens=64, max_seq_len=64, disable_overlap_scheduler=True) as llm:
        reference = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)).outputs[0].token_ids
    stop = reference[2]
    want = reference[: reference.index(stop) + 1]
    for disable in (True, False):
        with LLM(MODEL, max_num_tokens=64, max_seq_len=64, disable_overlap_scheduler=disable) as llm:
            assert llm.executor.overlap is not disable
            outputs = [llm.generate_async(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop])) for _ in range(3)]
            for handle in outputs:
                output = handle.result(timeout=60).outputs[0]
                assert output.token_ids == want and output.finish_reason == "stop", (disable, output)
        assert llm.executor.load().kv.num_held == 0  # drained: every block free or cached


@pytest.mark.usefixtures("one_torch_thread")
def test_failed_batches_and_nan_logits_under_overlap_fail_only_their_requests():
    faults = FaultInjectionConfig(forward_error_every=6, nan_logits_every=2)
    with LLM(MODEL, max_num_tokens=64, max_seq_len=64, disable_overlap_scheduler=False, fault_injection=faults) as llm:
        handles = [llm.generate_async([3 + i, 4, 5, 6 + i], SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(8)]
        ended = 0
        for handle in handles:
            try:
                output = handle.result(timeout=60).outputs[0]
                assert len(output.token_ids) == 10 and IN_FLIGHT_TOKEN_ID not in output.token_ids
            except Exception as error:  # noqa: BLE001 - a request failed by a fault: it ends with its error
                assert "fault injection" in str(error) or "NonFinite" in str(error) or "not finite" in str(error), error
            ended += 1
        assert ended == len(handles)
        health = llm.health()
        assert health.healthy, health
        assert health.failed_batches >= 1
    assert llm.executor.load().kv.num_held == 0  # drained: every block free or cached


def test_cancelling_a_request_in_flight_frees_it_after_its_forward():
    executor = make_sim_executor(make_config(max_num_tokens=32, num_blocks=64), overlap=True)
    responses = []
    request = make_request(prompt_len=10, max_new_tokens=50)
    executor.enqueue_request(request, lambda r, resp: responses.append(resp))
    for _ in range(4):
        executor.step()
    assert request.request_id in executor.in_flight_request_ids
    executor.cancel_request(request.request_id)
    executor.step()  # cancelled while in flight: its blocks stay held until that forward completes
    assert responses[-1].cancelled and IN_FLIGHT_TOKEN_ID not in request.tokens
    executor.run_until_idle()
    kv = executor.kv_cache_manager
    assert not kv.is_allocated(request)
    kv.check_integrity()
    assert sum(len(r.new_token_ids) for r in responses) == len(request.output_token_ids)


def test_the_cpu_default_is_the_plain_loop():
    assert not make_sim_executor(make_config()).overlap
    assert make_sim_executor(make_config(), overlap=True).overlap
