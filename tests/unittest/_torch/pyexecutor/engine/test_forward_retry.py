"""A forward that fails (the engine raised, at launch or on the device) does not fail its
requests at once: each starts over as context, its KV recomputed, up to ``max_forward_retries``
times (``PyExecutor._forward_failed`` / ``_start_over``). Retrying must be invisible in the
output: the tokens are those of a run without the fault, with or without overlap."""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.factories import make_config, make_request, make_sim_executor

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm._torch.pyexecutor.errors import RequestError
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID
from tensorrt_llm._torch.pyexecutor.engine.interface import DeferredForward
from tensorrt_llm.llmapi.llm import LLM, SamplingParams

MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")
PROMPTS = [[3 + i, 4, 5, 6 + i, *range(20, 20 + 3 * i)] for i in range(8)]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _generate(**options) -> tuple[list[list[int]], LLM]:
    # every request fits one forward, so a request that starts over is prefilled (and samples)
    # in the forward right after the failed one
    with LLM(MODEL, max_num_tokens=512, max_seq_len=128, enable_chunked_prefill=True, **options) as llm:
        handles = [llm.generate_async(prompt, PARAMS) for prompt in PROMPTS]
        outputs = [handle.result(timeout=60).outputs[0].token_ids for handle in handles]
    return outputs, llm


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_retried_requests_produce_the_tokens_of_a_run_without_faults(overlap):
    reference, _ = _generate(disable_overlap_scheduler=not overlap)
    # forwards fail 4 apart: every request generates tokens between two failures, so each
    # failure is a first one in a row for it and the default single retry covers them all
    faults = FaultInjectionConfig(forward_error_every=4)
    outputs, llm = _generate(disable_overlap_scheduler=not overlap, fault_injection=faults)
    assert outputs == reference
    retried = sum(s.num_retried_requests for s in llm.executor.iteration_stats)
    assert llm.health().failed_batches == llm.executor.faults_injected()["forward_error"] > 0
    assert retried > 0 and all(s.num_failed_requests == 0 for s in llm.executor.iteration_stats)
    assert llm.executor.load().kv.num_held == 0  # drained: every block free or cached


@pytest.mark.usefixtures("one_torch_thread")
def test_a_forward_that_keeps_failing_fails_its_requests_after_their_retries():
    faults = FaultInjectionConfig(forward_error_every=1)  # every forward fails
    with LLM(MODEL, max_num_tokens=64, max_seq_len=128, fault_injection=faults, max_forward_retries=2) as llm:
        handles = [llm.generate_async(prompt, PARAMS) for prompt in PROMPTS]
        for handle in handles:
            with pytest.raises(RequestError, match="fault injection"):
                handle.result(timeout=60)
        retried = sum(s.num_retried_requests for s in llm.executor.iteration_stats)
        assert retried == 2 * len(PROMPTS)  # each started over twice, then failed


@pytest.mark.usefixtures("one_torch_thread")
def test_without_retries_a_failed_forward_fails_its_requests():
    faults = FaultInjectionConfig(forward_error_every=3)
    with LLM(MODEL, max_num_tokens=64, max_seq_len=128, fault_injection=faults, max_forward_retries=0) as llm:
        handles = [llm.generate_async(prompt, PARAMS) for prompt in PROMPTS]
        errors = []
        for handle in handles:
            try:
                handle.result(timeout=60)
            except RequestError as error:
                errors.append(error.message)
        assert errors and all("fault injection" in message for message in errors)
        assert sum(s.num_retried_requests for s in llm.executor.iteration_stats) == 0


def _fail_on_device(executor, forward_number: int) -> None:
    """The ``forward_number``-th forward launches, then fails when its result is taken."""
    launch, count = executor.model_engine.forward_async, [0]

    def forward_async(batch):
        pending = launch(batch)
        count[0] += 1
        if count[0] != forward_number:
            return pending

        def fail():
            pending.result()
            raise RuntimeError("device lost the forward")

        failing = DeferredForward(fail, None)
        failing.num_tokens = pending.num_tokens
        return failing

    executor.model_engine.forward_async = forward_async


def _serve(overlap: bool, fail_forward: int | None) -> tuple[dict[int, list[int]], object]:
    executor = make_sim_executor(make_config(max_num_tokens=32, num_blocks=64), overlap=overlap)
    if fail_forward is not None:
        _fail_on_device(executor, fail_forward)
    tokens: dict[int, list[int]] = {}
    for i, (prompt_len, max_new) in enumerate([(40, 6), (9, 4), (20, 8), (5, 3)]):
        request = make_request(prompt_len=prompt_len, max_new_tokens=max_new, request_id=500 + i, seed=i)
        tokens[request.request_id] = []
        executor.enqueue_request(request, lambda r, resp: tokens[r.request_id].extend(resp.new_token_ids))
    executor.run_until_idle(1000)
    kv = executor.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free + kv.pool.num_cached == kv.pool.num_blocks
    return tokens, executor


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("fail_forward", [1, 3, 5])
def test_a_forward_failing_on_the_device_is_retried_and_the_next_forward_built_on_it_dropped(overlap, fail_forward):
    reference, _ = _serve(overlap, None)
    tokens, executor = _serve(overlap, fail_forward)
    assert tokens == reference
    assert all(IN_FLIGHT_TOKEN_ID not in t for t in tokens.values())
    assert executor.num_failed_batches == 1
    assert sum(s.num_retried_requests for s in executor.iteration_stats) > 0
