"""The n-gram drafter and greedy verification, alone; speculation through ``LLM(...)``."""

from __future__ import annotations

import dataclasses

from tests.helpers import factories
import numpy as np
import pytest
import yaml

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import DecodingType, ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts
from tensorrt_llm._torch.speculative.verification import accept_greedy
from tensorrt_llm.llmapi.config_fields import from_mapping
from tensorrt_llm.llmapi.llm import LLM, SamplingParams
from tensorrt_llm.llmapi.llm_args import LlmArgs

MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")


def propose(tokens, max_draft_len=3, n=3):
    return propose_ngram_drafts(np.asarray(tokens, dtype=np.int64), max_draft_len, n)


def test_the_longest_recurring_suffix_proposes_what_followed_it():
    #        a  b  c  x  y  z  a  b  c
    assert propose([1, 2, 3, 7, 8, 9, 1, 2, 3]) == [7, 8, 9]
    # only "c" recurs (n = 1) when "b c" does not
    assert propose([3, 5, 6, 2, 3]) == [5, 6, 2]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    # "1 2" occurred at 0 (then 7 7) and "2" alone at 5 (then 4): the 2-gram's continuation wins
    assert propose([1, 2, 7, 7, 9, 2, 4, 1, 2], max_draft_len=2, n=2) == [7, 7]


def test_the_most_recent_occurrence_wins_and_proposals_stop_at_the_sequence_end():
    assert propose([5, 1, 5, 2, 5], max_draft_len=4, n=1) == [2, 5]
    assert propose([4, 4], max_draft_len=3, n=2) == [4]


def test_nothing_recurs_nothing_is_proposed():
    assert propose([1, 2, 3, 4]) == []
    assert propose([9]) == []
    assert propose([1, 2, 1], max_draft_len=0) == []


@pytest.mark.parametrize(
    "drafts, targets, tokens",
    [
        ([], [5], [5]),  # no drafts: the one greedy token
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, then the bonus token
        ([5, 9, 7], [5, 6, 7, 8], [5, 6]),  # rejected at the second: the target's token there
        ([4, 6, 7], [5, 6, 7, 8], [5]),  # rejected at once: one token, as without drafts
    ],
)
def test_accept_greedy_keeps_the_accepted_run_and_the_targets_next_token(drafts, targets, tokens):
    assert accept_greedy(drafts, targets) == tokens


def test_accept_greedy_needs_one_target_per_draft_and_one_more():
    with pytest.raises(ValueError, match="2 drafts need 3"):
        accept_greedy([1, 2], [1, 2])


def test_speculative_config_is_a_yaml_mapping_and_refuses_what_it_cannot_do():
    options = yaml.safe_load("speculative_config: {decoding_type: NGram, max_draft_len: 3, max_matching_ngram_size: 2}")
    args = from_mapping(LlmArgs, options)
    assert args.executor.speculative_config == SpeculativeConfig(DecodingType.NGRAM, 3, 2)
    with pytest.raises(ValueError, match="decoding_type"):
        from_mapping(LlmArgs, {"speculative_config": {"decoding_type": "Eagle3"}})
    with pytest.raises(ValueError, match="max_draft_len"):
        SpeculativeConfig(max_draft_len=0)
    with pytest.raises(ValueError, match="typo"):
        from_mapping(LlmArgs, {"speculative_config": {"typo": 1}})


def serve(prompts, params, **options):
    with LLM(MODEL, max_num_tokens=48, max_seq_len=128, kv_cache_config=KvCacheConfig(tokens_per_block=4),
             **options) as llm:
        outputs = [h.result(timeout=60).outputs[0].token_ids for h in [llm.generate_async(p, params) for p in prompts]]
        return outputs, llm.iteration_stats


@pytest.mark.usefixtures("one_torch_thread")
def test_llm_with_ngram_speculation_generates_what_it_generates_without():
    """Repeating prompts (the n-gram drafter finds matches) through LLM(...): the same tokens,
    with drafts verified; a request that samples does not speculate, and is served."""
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [1, 2, 3, 4] * 3 + [1], [3, 9, 27, 11, 4]]
    params = SamplingParams(max_tokens=16)
    plain, _ = serve(prompts, params)
    spec = SpeculativeConfig(max_draft_len=3, max_matching_ngram_size=2)
    speculative, stats = serve(prompts, params, speculative_config=spec)
    assert speculative == plain
    assert sum(s.num_draft_tokens for s in stats) > 0
    sampled, stats = serve(prompts[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=3), speculative_config=spec)
    assert len(sampled[0]) == 8 and sum(s.num_draft_tokens for s in stats) == 0


class _WrongDrafter(Drafter):
    """Proposes a token unlike greedy decoding's at every position: every draft is rejected."""

    def __init__(self, config: SpeculativeConfig, continuation: tuple[int, ...]) -> None:
        super().__init__(config, 128)
        self.continuation = continuation

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        start = len(request.tokens)
        return [(t + 1) % MODEL.vocab_size for t in self.continuation[start : start + max_drafts]]


@pytest.mark.usefixtures("one_torch_thread")
def test_rejected_drafts_roll_back_their_blocks_and_never_reach_the_prefix_tree():
    """tokens_per_block 2, max_draft_len 4: the first-draft step writes positions 4..8 (five
    blocks); all four drafts are rejected, so the blocks past the sequence's 6 tokens go back.
    A second request whose prompt is the first's whole output reuses its committed blocks and
    still decodes exactly as greedy decoding does."""
    spec = SpeculativeConfig(max_draft_len=4)
    config = ExecutorConfig(max_num_tokens=32, max_seq_len=128, speculative_config=spec,
                            kv_cache_config=KvCacheConfig(tokens_per_block=2, num_blocks=40))
    model = factories.served_model(MODEL)
    prompt = (3, 9, 27, 11)
    want = tuple(factories.greedy_reference(model, prompt, 8))
    executor = create_py_executor(config, model=model, drafter=_WrongDrafter(spec, prompt + want))
    kv = executor.kv_cache_manager
    request = LlmRequest(input_token_ids=list(prompt), max_new_tokens=8)
    executor.enqueue_request(request)
    executor.step()  # the prompt: one token
    assert request.is_first_draft and len(request.tokens) == 5
    iteration = executor.step()  # first draft: 1 + max_draft_len positions, all drafts rejected
    assert iteration.stats.forward_tokens == 5 and iteration.stats.num_draft_tokens == 4
    assert iteration.stats.num_accepted_draft_tokens == 0
    assert len(request.tokens) == 6 and kv.sequences.num_held_blocks(request) == 3  # not the 5 the forward wrote
    executor.run_until_idle()
    assert tuple(request.output_token_ids) == want
    kv.check_integrity()

    follow = LlmRequest(input_token_ids=list(prompt + want), max_new_tokens=4)
    before = len(executor.iteration_stats)
    executor.enqueue_request(follow)
    executor.run_until_idle()
    assert sum(s.reuse_claimed_tokens for s in executor.iteration_stats[before:]) >= len(prompt)
    assert tuple(follow.output_token_ids) == tuple(factories.greedy_reference(model, prompt + want, 4))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_request_whose_draft_slots_do_not_fit_runs_without_speculation():
    """Chunked prefill off, max_num_tokens 8: a 6-token prompt fits, its 4 draft slots would
    not (a last chunk may carry drafts): it is served as without speculation, not refused."""
    spec = SpeculativeConfig(max_draft_len=4)
    config = ExecutorConfig(max_num_tokens=8, max_seq_len=64, speculative_config=spec,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=16))
    model = factories.served_model(MODEL)
    executor = create_py_executor(config, model=model)
    request = LlmRequest(input_token_ids=[3, 9, 27, 11, 4, 5], max_new_tokens=4)
    executor.enqueue_request(request)
    executor.run_until_idle()
    assert request.error is None and request.max_draft_len == 0
    assert request.output_token_ids == factories.greedy_reference(model, [3, 9, 27, 11, 4, 5], 4)


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_requests_whose_forwards_fail_start_over_and_generate_the_same_tokens():
    """Every third forward raises (fault injection): its requests start over as context, their
    drafts dropped, and still generate what they generate without faults or speculation."""
    from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig

    prompts = [[5, 6, 7, 8, 9, 10] * 3, [1, 2, 3, 4] * 3 + [1], [3, 9, 27, 11, 4]]
    params = SamplingParams(max_tokens=12)
    plain, _ = serve(prompts, params)
    faulty, stats = serve(prompts, params, max_forward_retries=8, speculative_config=SpeculativeConfig(max_draft_len=3),
                          fault_injection=FaultInjectionConfig(forward_error_every=3))
    assert faulty == plain
    assert sum(s.num_retried_requests for s in stats) > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_drafts_share_forwards_with_prompt_logprobs_and_requests_that_need_their_logits_do_not_speculate():
    """One forward holds draft rows and a chunk's prompt rows (both after the sampling rows):
    the outputs, the prompt log-probabilities and the sampled logprobs equal those without
    speculation; a request with logprobs (its logits needed on the host) is not speculated on."""
    spec = SpeculativeConfig(max_draft_len=3, max_matching_ngram_size=2)

    def run(**options):
        with LLM(MODEL, max_num_tokens=48, max_seq_len=128, kv_cache_config=KvCacheConfig(tokens_per_block=4),
                 **options) as llm:
            first = llm.generate_async([5, 6, 7, 8, 9, 10] * 3, SamplingParams(max_tokens=16))
            rest = [llm.generate_async([1, 2, 3, 4] * 3 + [1], SamplingParams(max_tokens=16, prompt_logprobs=1)),
                    llm.generate_async([3, 9, 27, 11, 4], SamplingParams(max_tokens=8, logprobs=1))]
            outputs = [h.result(timeout=60) for h in [first, *rest]]
            return outputs, llm.iteration_stats

    plain, _ = run()
    speculative, stats = run(speculative_config=spec)
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]
    # float64, but batches of other shapes: equal up to the last bits
    got, want = speculative[1].prompt_logprobs, plain[1].prompt_logprobs
    assert [e is None for e in got] == [e is None for e in want] and len(got) == 13
    assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-9)
    got, want = speculative[2].outputs[0].logprobs, plain[2].outputs[0].logprobs
    assert [e.token for e in got] == [e.token for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-9)
    assert sum(s.num_draft_tokens for s in stats) > 0


# ---- speculation that does not pay stops (SpeculativeConfig's upstream fields) ------------------


@pytest.mark.parametrize(
    "fields, problem",
    [({"acceptance_rate_threshold": 1.5, "acceptance_rate_window_size": 4}, r"\[0, 1\]"),
     ({"acceptance_rate_threshold": -0.1}, r"\[0, 1\]"),
     ({"acceptance_rate_threshold": 0.5, "acceptance_rate_window_size": 0}, "window_size"),
     ({"max_concurrency": 0}, "max_concurrency")],
)
def test_speculation_limits_refuse_what_they_cannot_mean(fields, problem):
    with pytest.raises(ValueError, match=problem):
        SpeculativeConfig(**fields)


class _NoDrafter(Drafter):
    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        return [0] * max_drafts


def _generating(n: int) -> list[LlmRequest]:
    requests = [LlmRequest([1, 2, 3], max_new_tokens=8) for _ in range(n)]
    drafter = _NoDrafter(SpeculativeConfig(max_draft_len=2), 128)
    for request in requests:
        assert drafter.admit(request)
        request.complete_context_chunk(request.prompt_len)
        request.state = LlmRequestState.GENERATION_IN_PROGRESS  # as the executor moves it on
    return requests


def test_above_max_concurrency_an_iteration_gets_no_drafts():
    drafter = _NoDrafter(SpeculativeConfig(max_draft_len=2, max_concurrency=2), 128)
    requests = _generating(3)
    assert all(r.is_first_draft for r in requests)
    drafter.prepare_draft_tokens(requests)
    assert [r.py_draft_tokens for r in requests] == [[], [], []]
    assert not any(r.is_first_draft for r in requests), "a skipped iteration runs plain steps: no first-draft padding"
    drafter.prepare_draft_tokens(requests[:2])
    assert [r.py_draft_tokens for r in requests[:2]] == [[0, 0], [0, 0]]
    assert all(r.max_draft_len == 2 for r in requests), "still speculative: only this iteration is skipped"


def test_max_concurrency_counts_requests_still_in_their_prompt():
    """A burst above the limit gets no drafts while most of it still prefills: the first requests
    to reach generation run plain steps (upstream counts every active request)."""
    drafter = _NoDrafter(SpeculativeConfig(max_draft_len=2, max_concurrency=2), 128)
    generating = _generating(2)
    prefilling = [LlmRequest([1, 2, 3], max_new_tokens=8) for _ in range(2)]
    for request in prefilling:
        assert drafter.admit(request)
    drafter.prepare_draft_tokens(generating + prefilling)
    assert [r.py_draft_tokens for r in generating] == [[], []]
    assert not any(r.is_first_draft for r in generating), "plain steps: no first-draft padding"
    drafter.prepare_draft_tokens(generating)  # the others finished: at the limit, drafts again
    assert [r.py_draft_tokens for r in generating] == [[0, 0], [0, 0]]


def test_a_window_of_low_acceptance_turns_speculation_off_for_good():
    config = SpeculativeConfig(max_draft_len=2, acceptance_rate_threshold=0.5, acceptance_rate_window_size=3)
    drafter = _NoDrafter(config, 128)
    requests = _generating(2)
    for verified, accepted in ((4, 0), (0, 0), (4, 4)):  # an iteration without drafts is not counted
        drafter.observe(verified, accepted)
    assert drafter.enabled, "the window is not full yet"
    drafter.observe(4, 1)  # 5 of 12 accepted: below one half
    assert not drafter.enabled
    drafter.prepare_draft_tokens(requests)
    assert all(r.max_draft_len == 0 and not r.is_first_draft and not r.py_draft_tokens for r in requests)
    assert not drafter.admit(LlmRequest([1, 2, 3], max_new_tokens=8))
    drafter.observe(4, 4)
    assert not drafter.enabled, "off for good"


@pytest.mark.usefixtures("one_torch_thread")
def test_speculation_that_does_not_pay_stops_and_the_outputs_stay_greedy():
    """The n-gram drafter on tiny-random, whose drafts are often wrong: once an iteration's
    acceptance is below the threshold speculation stops, the requests run on without drafts,
    and the tokens are those of plain greedy decoding."""
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [1, 2, 3, 4] * 3 + [1], [3, 9, 27, 11, 4]]
    params = SamplingParams(max_tokens=24)
    plain, _ = serve(prompts, params)
    always = SpeculativeConfig(max_draft_len=3, max_matching_ngram_size=2)
    _, stats = serve(prompts, params, speculative_config=always)
    verified = sum(s.num_draft_tokens for s in stats)
    assert verified > sum(s.num_accepted_draft_tokens for s in stats), "every draft accepted: nothing to stop"
    last_always = max(i for i, s in enumerate(stats) if s.num_draft_tokens)
    # threshold 1, window 1: the first iteration with a rejected draft stops speculation
    spec = dataclasses.replace(always, acceptance_rate_threshold=1.0, acceptance_rate_window_size=1)
    speculative, stats = serve(prompts, params, speculative_config=spec)
    assert speculative == plain
    with_drafts = [i for i, s in enumerate(stats) if s.num_draft_tokens]
    assert with_drafts, "the drafter found matches: the test tests nothing otherwise"
    first_rejection = next(i for i in with_drafts if stats[i].num_accepted_draft_tokens < stats[i].num_draft_tokens)
    assert with_drafts[-1] == first_rejection < last_always, "no drafts after the first rejection"
