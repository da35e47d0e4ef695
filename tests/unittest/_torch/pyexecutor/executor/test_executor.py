"""PyExecutor end to end: upstream's overshoot reproduced (and fixed by ``recheck``), bad
input, streaming, cancellation, shutdown and seeded sampling.

The overshoot scenarios run twice: on the simulated engine, stepped by hand, and through
``LLM`` with the real torch model, where the executor runs on its own thread.
"""

import random
import re

import pytest
from tests.helpers.factories import greedy_reference, make_config, make_request, make_sim_executor, served_model
from tests.helpers.invariants import ExecutorChecker

from tensorrt_llm._torch.pyexecutor.engine.inputs import prepare_tp_inputs
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.errors import ExecutorShutdown, InvalidRequestError, TokenBudgetExceeded
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState, token_array
from tensorrt_llm.llmapi import KvCacheConfig, RequestError

# ---- the evicted-discount scenario (DESIGN.md §1) -----------------------------------
# tokens_per_block 4, 28 blocks, max_num_tokens 30, chunked prefill, FCFS.
#   A (24 tokens = 6 blocks) finishes and its blocks are cached; then D (32 tokens)
#   finishes, so A's blocks are the coldest in LRU. In one batch come B (78 unrelated
#   tokens) and C = A's prompt + 2 tokens. B gets the largest chunk, 28; C is estimated to
#   reuse 24 tokens and charged its 2-token tail: 30 in all. Allocating B's whole prompt
#   (20 blocks) takes the 14 free blocks and evicts A's 6; C's claim finds nothing, so its
#   chunk runs all 26 tokens: 28 + 26 = 54, an overshoot of 24.
EVICTED = dict(tokens_per_block=4, num_blocks=28, max_num_tokens=30)
C_TAIL = [5, 6]
OVERSHOOT_MESSAGE = "total_num_tokens (54) should be less than or equal to max_num_tokens (30)"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt_of(length, seed):
    """Token ids inside the tiny model's vocabulary (512), distinct per seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(length)]


A, D, B = prompt_of(24, 1), prompt_of(32, 2), prompt_of(78, 3)
C = A + C_TAIL


def sim_after_a_and_d(policy):
    executor = make_sim_executor(make_config(token_budget_policy=policy, **EVICTED))
    checker = ExecutorChecker(executor)
    for prompt in (A, D):
        checker.submit(make_request(prompt, max_new_tokens=2))
        checker.drain()
    assert executor.kv_cache_manager.pool.num_cached == 14  # A's 6 blocks (coldest), D's 8
    return executor, checker


def test_evicted_discount_overshoots_under_none():
    executor, _ = sim_after_a_and_d("none")
    b, c = make_request(B, max_new_tokens=2), make_request(C, max_new_tokens=2)

    # One iteration, done by hand: schedule, prepare_resources, _prepare_tp_inputs.
    scheduled = executor.scheduler.schedule_request([b, c])
    assert scheduled.context_requests == [b, c]
    assert scheduled.estimated_reusable == {b.request_id: 0, c.request_id: 24}
    assert scheduled.charges == {b.request_id: 28, c.request_id: 2}
    prepared = executor.resource_manager.prepare_resources(scheduled)
    assert [(claim.estimated_reusable_tokens, claim.reused_tokens) for claim in prepared.claims] == [(0, 0), (24, 0)]
    assert [(chunk.start, chunk.size) for chunk in prepared.scheduled.context_chunks] == [(0, 28), (0, 26)]

    with pytest.raises(TokenBudgetExceeded) as error:
        prepare_tp_inputs(prepared.scheduled, executor.kv_cache_manager, executor.config.max_num_tokens)
    assert str(error.value) == OVERSHOOT_MESSAGE
    assert error.value.overshoot == 24


def test_executor_survives_the_overshoot_under_none():
    executor, checker = sim_after_a_and_d("none")
    b, c = make_request(B, max_new_tokens=2), make_request(C, max_new_tokens=2)
    checker.submit(b)
    checker.submit(c)
    checker.step()

    stats = executor.iteration_stats[-1]
    assert (stats.forward_tokens, stats.overshoot) == (54, 24)
    assert stats.error == OVERSHOOT_MESSAGE and stats.num_failed_requests == 2
    for request in (b, c):
        assert checker.final[request.request_id].error == f"TokenBudgetExceeded: {OVERSHOOT_MESSAGE}"
    health = executor.health()
    assert health.budget_violations == 1 and health.last_error == OVERSHOOT_MESSAGE

    later = make_request(C, max_new_tokens=3)
    checker.submit(later)
    checker.drain()
    assert later.error is None and later.num_generated_tokens == 3


def test_recheck_cuts_instead_and_serves_the_same_output():
    executor, checker = sim_after_a_and_d("recheck")
    b, c = make_request(B, max_new_tokens=2), make_request(C, max_new_tokens=4, request_id=777_001)
    checker.submit(b)
    checker.submit(c)
    iteration = checker.step()

    # C's full cost (26) does not fit the 2 tokens B's 28 leave. C expects to reuse 24 of its
    # 26 tokens, so one unit (4) would finish it: B gives 4 back, C is cut to [0, 4). B's
    # allocation then evicts C's prefix, and C runs its 4 tokens: 24 + 4 <= 30.
    assert [(ch.request, ch.start, ch.size) for ch in iteration.batch.context_chunks] == [(b, 0, 24), (c, 0, 4)]
    assert iteration.prepared.deferred == []
    assert (iteration.stats.num_budget_cuts, iteration.stats.forward_tokens) == (2, 28)
    assert c.context_current_position == 4

    checker.drain()
    assert all(stats.overshoot == 0 for stats in executor.iteration_stats)
    assert max(stats.forward_tokens for stats in executor.iteration_stats) <= 30
    assert c.counters.budget_deferrals == 0
    assert c.error is None and b.error is None

    alone = make_sim_executor(make_config(token_budget_policy="recheck", **EVICTED))
    c_alone = make_request(C, max_new_tokens=4, request_id=777_001)
    alone.enqueue_request(c_alone)
    alone.run_until_idle()
    assert c.output_token_ids == c_alone.output_token_ids and len(c.output_token_ids) == 4


# ---- the same through LLM and the real model ----------------------------------------
def evicted_discount_llm(policy):
    return LLM(
        "tiny-random",
        dtype="float64",
        max_num_tokens=EVICTED["max_num_tokens"],
        enable_chunked_prefill=True,
        token_budget_policy=policy,
        kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=EVICTED["num_blocks"]),
    )


def test_overshoot_through_llm_fails_the_batch_and_keeps_serving():
    params = SamplingParams(max_tokens=2)
    with evicted_discount_llm("none") as llm:
        llm.generate(A, params)
        llm.generate(D, params)
        with pytest.raises(RequestError) as error:
            llm.generate([B, C], params)  # one submission: B and C are fetched into one batch
        assert OVERSHOOT_MESSAGE in str(error.value)
        assert error.value.message == f"TokenBudgetExceeded: {OVERSHOOT_MESSAGE}"

        health = llm.health()
        assert health.alive and health.budget_violations == 1 and health.failed_batches == 1
        assert [s.overshoot for s in llm.iteration_stats if s.overshoot] == [24]

        later = llm.generate(C, SamplingParams(max_tokens=3))
        assert later.finished and later.error is None and len(later.outputs[0].token_ids) == 3
        assert llm.health().budget_violations == 1


def test_recheck_through_llm_cuts_and_matches_the_reference():
    params = SamplingParams(max_tokens=2)
    with evicted_discount_llm("recheck") as llm:
        llm.generate(A, SamplingParams(max_tokens=2))
        llm.generate(D, SamplingParams(max_tokens=2))
        out_b, out_c = llm.generate([B, C], params)  # one submission: one batch
        stats = llm.iteration_stats
        assert sum(s.num_budget_cuts for s in stats) == 2 and sum(s.num_budget_deferrals for s in stats) == 0
        assert all(s.overshoot == 0 and s.forward_tokens <= 30 for s in stats)
        assert llm.health().budget_violations == 0
    model = served_model("tiny-random", dtype="float64")
    assert out_b.outputs[0].token_ids == greedy_reference(model, B, 2)
    assert out_c.outputs[0].token_ids == greedy_reference(model, C, 2)


# ---- the whole-prompt hit -----------------------------------------------------------
@pytest.mark.parametrize("tpb", [4, 8])
@pytest.mark.parametrize(
    "policy, partial, overshoots",
    [("none", False, True), ("recheck", False, False), ("none", True, False)],
    ids=["none", "recheck", "none-with-partial-reuse"],
)
def test_whole_prompt_hit(tpb, policy, partial, overshoots):
    # A block-aligned prompt, fully cached, is estimated fully reusable and charged 1 token.
    # Its claim stops at prompt_len - 1: without partial reuse the last block is recomputed.
    # B's chunk (3 blocks) leaves exactly that 1 token of budget.
    max_num_tokens = 3 * tpb + 1
    executor = make_sim_executor(
        make_config(
            tokens_per_block=tpb,
            max_num_tokens=max_num_tokens,
            num_blocks=64,
            enable_partial_reuse=partial,
            token_budget_policy=policy,
        )
    )
    checker = ExecutorChecker(executor)
    prompt = prompt_of(4 * tpb, seed=4)
    checker.submit(make_request(prompt, max_new_tokens=2))
    checker.drain()

    b, again = make_request(prompt_len=10 * tpb), make_request(prompt, max_new_tokens=2)
    checker.submit(b)
    checker.submit(again)
    checker.step()
    stats = executor.iteration_stats[-1]
    assert stats.scheduled_tokens == max_num_tokens
    if overshoots:
        assert stats.overshoot == tpb - 1
        assert again.error and "TokenBudgetExceeded" in again.error
    else:
        assert stats.overshoot == 0 and stats.forward_tokens <= max_num_tokens
        checker.drain()
        assert again.error is None and again.num_generated_tokens == 2
        if policy == "recheck":
            # the repeat's whole-prompt bound does not fit the 1 token left; one block (what
            # finishes it once its 3 cached blocks are claimed) does, with a block b gives back
            assert (stats.num_budget_cuts, stats.num_budget_deferrals) == (2, 0)


# ---- request lifecycle edge cases ---------------------------------------------------
def test_a_request_finishing_with_its_last_chunk_leaves_its_prompt_cached():
    executor = make_sim_executor(make_config(tokens_per_block=4, num_blocks=16))
    prompt = prompt_of(16, seed=5)
    one_token = make_request(prompt, max_new_tokens=1)  # done in the iteration of its only chunk
    executor.enqueue_request(one_token)
    executor.run_until_idle()
    assert one_token.state is LlmRequestState.GENERATION_COMPLETE
    kv = executor.kv_cache_manager
    assert kv.pool.num_cached == 4
    assert kv.match(make_request(prompt + [1])).reusable_tokens == 16


def test_cancelled_and_finished_requests_free_their_blocks():
    executor = make_sim_executor(make_config(max_num_tokens=16))
    checker = ExecutorChecker(executor)
    long, short = make_request(prompt_len=40, max_new_tokens=50), make_request(prompt_len=5, max_new_tokens=2)
    checker.submit(long)
    checker.submit(short)
    for _ in range(6):
        checker.step()
    assert executor.kv_cache_manager.is_allocated(long)
    checker.cancel(long.request_id)
    checker.drain()
    assert checker.final[long.request_id].cancelled and long.is_cancelled
    assert 0 < long.num_generated_tokens < 50
    assert checker.final[short.request_id].error is None


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(tokens=[]), "prompt is empty"),
        (dict(prompt_len=4, max_new_tokens=0), "max_tokens must be >= 1"),
        (dict(tokens=[1, 2, 5000]), "outside the vocabulary"),
        (dict(prompt_len=4, beam_width=9), "beam width 9"),
        (dict(prompt_len=4000, max_new_tokens=200), "exceeds max_seq_len"),
        (dict(prompt_len=300, max_new_tokens=4), "KV blocks"),
    ],
)
def test_invalid_request_enqueued_directly_fails_alone(bad, reason):
    executor = make_sim_executor(make_config(num_blocks=64))
    checker = ExecutorChecker(executor)
    invalid = make_request(**bad)
    valid = make_request(prompt_len=6, max_new_tokens=3)
    checker.submit(invalid)
    checker.submit(valid)
    checker.drain()
    response = checker.final[invalid.request_id]
    assert response.finished and response.error.startswith("InvalidRequestError") and reason in response.error
    assert checker.tokens[invalid.request_id] == []
    assert valid.error is None and valid.num_generated_tokens == 3


# ---- LLM: bad input, streaming, cancellation, sampling, shutdown --------------------
@pytest.fixture(scope="module")
def llm():
    # Chunked prefill off: a prompt longer than max_num_tokens is then invalid. Batch-invariant: the
    # tests below compare a request's tokens with a rerun that reuses its cached prefix, or with
    # itself in a batch (float32 tiny-random: only the mode makes those the same bits everywhere).
    with LLM(
        "tiny-random",
        batch_invariant=True,
        max_num_tokens=64,
        max_seq_len=128,
        enable_chunked_prefill=False,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, num_blocks=64),
    ) as served:
        yield served


GOOD = prompt_of(12, seed=6)


@pytest.mark.parametrize(
    "prompt, params, problem",
    [
        ([], SamplingParams(), "the prompt is empty"),
        ([1] * 129, SamplingParams(), "prompt length 129 exceeds max_seq_len 128"),
        ([1] * 100, SamplingParams(max_tokens=40), r"max_tokens 40 exceeds max_seq_len 128"),
        ([1] * 65, SamplingParams(), "prompt length 65 exceeds max_num_tokens 64 and chunked prefill is off"),
        (GOOD, SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        ([1, 2, 512], SamplingParams(), r"token id 512 is outside the vocabulary \[0, 512\)"),
        ([1, -3], SamplingParams(), "token id -3 is outside the vocabulary"),
        ([1, 2.5], SamplingParams(), "integer token ids"),
        (GOOD, SamplingParams(beam_width=65), "beam width 65 is not implemented by this engine"),
    ],
)
def test_bad_input_raises_before_anything_is_queued(llm, monkeypatch, prompt, params, problem):
    queued = []
    enqueue = llm.executor.enqueue_requests
    monkeypatch.setattr(llm.executor, "enqueue_requests", lambda pairs: (queued.extend(r for r, _ in pairs), enqueue(pairs))[1])

    with pytest.raises(ValueError, match=problem):
        llm.generate([GOOD, prompt], params)  # the good prompt first: it must not be queued either
    with pytest.raises(ValueError, match=problem):
        llm.generate_async(prompt, params)
    assert queued == []

    out = llm.generate(GOOD, SamplingParams(max_tokens=3))  # still serving
    assert len(out.outputs[0].token_ids) == 3 and len(queued) == 1


def test_text_prompts_are_rejected(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate_async("hello", SamplingParams())


def test_streaming_yields_every_token_then_the_final_output(llm):
    params = SamplingParams(max_tokens=6)
    lengths, finished = [], []
    for out in llm.generate_async(GOOD, params):
        lengths.append(len(out.outputs[0].token_ids))
        finished.append(out.finished)
    assert lengths == [1, 2, 3, 4, 5, 6]
    assert finished == [False] * 5 + [True]
    streamed = out.outputs[0]
    assert streamed.finish_reason == "length"
    assert streamed.token_ids == llm.generate(GOOD, params).outputs[0].token_ids


def test_stop_token_ends_generation(llm):
    full = llm.generate(GOOD, SamplingParams(max_tokens=8)).outputs[0].token_ids
    stop_at = full.index(full[3])  # the first occurrence of the 4th token
    out = llm.generate(GOOD, SamplingParams(max_tokens=8, end_id=full[3])).outputs[0]
    assert out.token_ids == full[: stop_at + 1] and out.finish_reason == "stop"


def test_abort_cancels_mid_stream(llm):
    handle = llm.generate_async(prompt_of(20, seed=7), SamplingParams(max_tokens=100))
    for out in handle:
        if len(out.outputs[0].token_ids) == 2:
            handle.abort()
    final = handle.result(timeout=10)  # a cancelled request is not an error
    assert final.finished and final.outputs[0].finish_reason == "cancelled"
    assert 2 <= len(final.outputs[0].token_ids) < 100
    assert llm.generate(GOOD, SamplingParams(max_tokens=2)).outputs[0].token_ids  # still serving


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    first = llm.generate(GOOD, params).outputs[0].token_ids
    assert llm.generate(GOOD, params).outputs[0].token_ids == first
    batch = llm.generate([GOOD, prompt_of(30, seed=8), GOOD], params)  # batched with others, concurrently
    assert batch[0].outputs[0].token_ids == batch[2].outputs[0].token_ids == first
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=99)
    assert llm.generate(GOOD, other_seed).outputs[0].token_ids != first


def test_shutdown_fails_pending_requests_and_refuses_new_ones():
    llm = LLM("tiny-random", max_seq_len=1024, max_num_tokens=64, kv_cache_config=KvCacheConfig(num_blocks=64))
    running = llm.generate_async(prompt_of(16, seed=9), SamplingParams(max_tokens=900))
    queued = [llm.generate_async(prompt_of(8, seed=10 + i), SamplingParams(max_tokens=900)) for i in range(3)]
    llm.shutdown()
    for handle in (running, *queued):
        with pytest.raises(RequestError, match="ExecutorShutdown"):
            handle.result(timeout=10)
    with pytest.raises(ExecutorShutdown):
        llm.generate_async(GOOD, SamplingParams())
    assert llm.health().alive is False
    assert llm.executor.load().kv.num_held == 0  # drained: every block free or cached


def test_an_iteration_is_budget_bound_while_prompt_tokens_are_left_after_its_batch():
    executor = make_sim_executor(make_config(tokens_per_block=4, max_num_tokens=16, num_blocks=32))
    executor.enqueue_request(make_request(prompt_len=40, max_new_tokens=3))
    executor.run_until_idle()
    # chunks [0, 16), [16, 32) leave prompt tokens behind; [32, 40) and the two decodes do not
    assert [(s.forward_tokens, s.budget_bound) for s in executor.iteration_stats] == [
        (16, True), (16, True), (8, False), (1, False), (1, False)
    ]


@pytest.mark.parametrize(
    "tokens, bad",
    [([1, 2, 3], None), ([], None), ([True, 2], None), ([3, -1, -3], -1), ([1, 10, 11], 10), ([1, 2**62], 2**62),
     ([2, -2**62], -2**62)],
)
def test_first_bad_token_names_the_first_offender(tokens, bad):
    from tensorrt_llm._torch.pyexecutor.executor.validation import first_bad_token

    assert first_bad_token(token_array(tokens), 10) == bad


@pytest.mark.parametrize("tokens, bad", [([1, 2.5, 99], 2.5), ([1, "a"], "a"), ([2.0], 2.0), ([1, 2**70], 2**70),
                                         ([1, 2**63], 2**63), ([2, -2**70], -2**70)])
def test_ids_that_are_not_64_bit_integers_are_refused_when_the_request_is_built(tokens, bad):
    with pytest.raises(InvalidRequestError, match=re.escape(f"request 77: token ids must be integers: token id {bad!r}")):
        LlmRequest(tokens, max_new_tokens=1, request_id=77)
