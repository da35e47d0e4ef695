"""Drafts pay under the overlap scheduler: on the CPU with overlap forced on, the n-gram drafter's
acceptance stays what it is without overlap, and greedy outputs with drafts equal those without.

The CPU torch engine runs each forward at launch, so with ``disable_overlap_scheduler=False`` it
builds forward n+1 while forward n's tokens have not reached the requests, exactly as the CUDA
engine does; the drafts of a step built in flight are proposed when it is launched, from the
tokens n produced (``ForwardInputs.resolve`` with the proposer's batch form, the one the GPU runs).
A drafter that drafted from n's unverified drafts instead collapsed to an acceptance of about 0.04
against 0.46 without overlap on :func:`test_acceptance_with_overlap_is_acceptance_without`'s workload.

``tiny-random`` falls into short cycles under greedy decoding, which is where prompt lookup pays:
a real model whose outputs repeat, without a checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from tests.helpers import factories
from tests.helpers.strategies import examples

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLOAT32 = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32")
PROMPTS = [[(i * 37 + j * 11) % 500 + 1 for j in range(12)] for i in range(4)]  # their outputs fall into cycles
DECISIVE = 1e-3  # smallest top-2 logit gap along a greedy path for its argmaxes to survive float32 rounding


def _model():
    return factories.served_model(FLOAT32)


def _serve(model, prompts, spec: SpeculativeConfig | None, *, overlap: bool, max_tokens: int = 64, tokens_per_block: int = 8):
    config = ExecutorConfig(max_num_tokens=256, max_seq_len=256, max_batch_size=8, speculative_config=spec,
                            disable_overlap_scheduler=not overlap,
                            kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, num_blocks=512))
    executor = create_py_executor(config, model=model)
    assert executor.overlap == overlap
    requests = [LlmRequest(input_token_ids=list(p), max_new_tokens=max_tokens) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    stats = executor.iteration_stats
    verified = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_draft_tokens for s in stats)
    return [tuple(r.output_token_ids) for r in requests], verified, accepted


def test_acceptance_with_overlap_is_acceptance_without():
    model = _model()
    spec = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=3)
    plain, _, _ = _serve(model, PROMPTS, None, overlap=True)
    without, verified_without, accepted_without = _serve(model, PROMPTS, spec, overlap=False)
    with_overlap, verified, accepted = _serve(model, PROMPTS, spec, overlap=True)
    assert with_overlap == without == plain
    acceptance_without = accepted_without / verified_without
    assert acceptance_without > 0.3, "the workload must reward prompt lookup for the comparison to mean anything"
    assert accepted / verified >= 0.9 * acceptance_without, (accepted, verified, accepted_without, verified_without)
    # and as many tokens come from drafts: the same forwards are saved
    assert accepted >= 0.9 * accepted_without


def _greedy_margin(model, prompt: tuple[int, ...], output: tuple[int, ...]) -> float:
    """The smallest gap between the best and second-best logit where ``output`` was picked."""
    with torch.inference_mode():
        logits = model.forward_full(torch.tensor(prompt + output, dtype=torch.long))[len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values  # (len(output), 2)
    return float((top[:, 0] - top[:, 1]).min()) if len(output) else float("inf")


_MODEL = None


@settings(max_examples=examples(1 / 15, 8), deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 4),
    max_draft_len=st.integers(1, 4),
    ngram=st.integers(1, 3),
    tokens_per_block=st.sampled_from([1, 4, 16]),
    max_tokens=st.integers(1, 40),
)
def test_outputs_with_drafts_equal_outputs_without_under_overlap(data, batch, max_draft_len, ngram, tokens_per_block,
                                                               max_tokens):
    """float32, overlap on in both runs; compared only where the greedy path's logits are
    decisive (float32 GEMMs of other shapes, a verification step's against a decode step's, may
    round a near-tie the other way: no bit-equality across batch shapes is promised)."""
    global _MODEL
    if _MODEL is None:
        _MODEL = _model()
    unit = st.lists(st.integers(1, 60), min_size=1, max_size=6)
    prompts = [tuple(data.draw(unit) * data.draw(st.integers(1, 4))) for _ in range(batch)]  # repeats: drafts found
    spec = SpeculativeConfig(max_draft_len=max_draft_len, max_matching_ngram_size=ngram)
    plain, _, _ = _serve(_MODEL, prompts, None, overlap=True, max_tokens=max_tokens, tokens_per_block=tokens_per_block)
    margin = min(_greedy_margin(_MODEL, p, out) for p, out in zip(prompts, plain))
    assume(margin > DECISIVE)
    drafted, verified, accepted = _serve(_MODEL, prompts, spec, overlap=True, max_tokens=max_tokens,
                                         tokens_per_block=tokens_per_block)
    note(f"drafts verified {verified}, accepted {accepted}")
    assert drafted == plain
