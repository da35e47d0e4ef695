"""Speculative decoding on the GPU (skipped without CUDA): greedy outputs with drafts equal
those without, with CUDA graphs and the overlap scheduler on (the defaults there)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tests.helpers.factories import make_config, make_request

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.sampling.drafter import Drafter, NGramDrafter
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPEC = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=2)


class _HalfRightDrafter(Drafter):
    """Proposes the plain run's continuation with every third position wrong; its proposer does
    the same on the device, from a request's token history (a step built in flight), without
    reading anything back."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(SPEC, 4096)
        self.continuations = continuations
        self.proposer = _HalfRightProposer([list(prompt) + out for prompt, out in continuations.items()])

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        prompt = tuple(request.tokens[: request.orig_prompt_len])
        full = list(prompt) + self.continuations[prompt]
        start = len(request.tokens)
        return [t if (start + i) % 3 else (t + 1) % 2048 for i, t in enumerate(full[start : start + max_drafts])]


class _HalfRightProposer:
    def __init__(self, fulls: list[list[int]]) -> None:
        self.max_draft_len = SPEC.max_draft_len
        width = max(map(len, fulls))
        self.fulls = torch.full((len(fulls), width), -2, dtype=torch.int64)
        for row, full in zip(self.fulls, fulls):
            row[: len(full)] = torch.tensor(full)
        self.lengths = torch.tensor([len(f) for f in fulls])

    def propose(self, tokens, max_drafts):
        raise AssertionError("the drafter proposes on the host itself")

    def propose_batch(self, history, lengths, room):
        device = history.device
        fulls, full_lengths = self.fulls.to(device), self.lengths.to(device)
        width = min(history.shape[1], fulls.shape[1])
        column = torch.arange(width, device=device)
        same = (history[:, None, :width] == fulls[None, :, :width]) | (column >= lengths[:, None, None])  # (S, P, W)
        match = same.all(dim=2) & (lengths[:, None] <= full_lengths[None, :])  # (S, P): the run it continues
        which = match.to(torch.int64).argmax(dim=1)  # (S,)
        positions = lengths[:, None] + torch.arange(self.max_draft_len, device=device)  # (S, K)
        chosen = fulls.index_select(0, which)
        drafts = chosen.gather(1, positions.clamp(max=fulls.shape[1] - 1))
        drafts = torch.where(positions % 3 == 0, (drafts + 1) % 2048, drafts)
        valid = match.any(dim=1)[:, None] & (positions < full_lengths.index_select(0, which)[:, None]) & (
            positions - lengths[:, None] < room[:, None])
        return torch.where(valid, drafts, -1), valid.sum(dim=1)


def _model() -> LlamaForCausalLM:
    return LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["small-random"], dtype="float32", seed=5)).to("cuda")


def _generate(model, prompts, drafter: Drafter | None, max_new_tokens: int = 16, **config):
    config = make_config(max_num_tokens=96, tokens_per_block=8, num_blocks=256, max_batch_size=8,
                         cuda_graph_config=CudaGraphConfig(), speculative_config=SPEC if drafter else None, **config)
    executor = create_py_executor(config, model=model, drafter=drafter)
    requests = [make_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    drafts = sum(s.num_draft_tokens for s in executor.iteration_stats)
    return [r.output_token_ids for r in requests], drafts


def _acceptance(model, prompts, overlap: bool) -> tuple[list, float]:
    config = make_config(max_num_tokens=96, tokens_per_block=8, num_blocks=512, max_batch_size=8,
                         cuda_graph_config=CudaGraphConfig(), speculative_config=SPEC,
                         disable_overlap_scheduler=not overlap)
    executor = create_py_executor(config, model=model)
    assert executor.overlap == overlap
    requests = [make_request(p, max_new_tokens=64) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    stats = executor.iteration_stats
    verified = sum(s.num_draft_tokens for s in stats)
    return [r.output_token_ids for r in requests], sum(s.num_accepted_draft_tokens for s in stats) / max(verified, 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_drafts_on_the_gpu_give_the_tokens_of_plain_decoding(overlap: bool) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(2048) for _ in range(40)]
    prompts = [shared + [rng.randrange(2048) for _ in range(rng.randrange(1, 50))] for _ in range(5)]
    prompts.append([rng.randrange(2048) for _ in range(12)] * 4)  # repeats: the n-gram drafter finds matches
    model = _model()
    plain, _ = _generate(model, prompts, None, disable_overlap_scheduler=not overlap)
    continuations = {tuple(p): out for p, out in zip(prompts, plain)}
    for drafter in (_HalfRightDrafter(continuations), NGramDrafter(SPEC, 4096)):
        speculative, drafts = _generate(model, prompts, drafter, disable_overlap_scheduler=not overlap)
        assert drafts > 0
        assert speculative == plain, type(drafter).__name__


def test_verification_steps_replay_decode_graphs_and_stay_under_overlap() -> None:
    """With drafts, every decode graph size is captured, generation-only steps replay them (each
    draft position a decode row), forwards are launched on drafts still in flight (the overlap
    scheduler stays on, the engine drafting them on the device), and the outputs are plain
    decoding's."""
    from tensorrt_llm._torch.pyexecutor.llm_request import num_in_flight_tokens

    rng = random.Random(5)
    prompts = [[rng.randrange(2048) for _ in range(10)] * 3 for _ in range(3)]
    model = _model()
    plain, _ = _generate(model, prompts, None)
    config = make_config(max_num_tokens=96, tokens_per_block=8, num_blocks=256, max_batch_size=8,
                         cuda_graph_config=CudaGraphConfig(), speculative_config=SPEC)
    drafter = _HalfRightDrafter({tuple(p): out for p, out in zip(prompts, plain)})
    executor = create_py_executor(config, model=model, drafter=drafter)
    assert executor.overlap
    runner = executor.model_engine.graph_runner
    # every size up to 8 requests x (1 + 4) rows, captured at warm-up (a collection inside a capture
    # once failed the size-24 one: cuda_graph_runner.garbage_collection_paused)
    assert runner.captured_sizes == runner.batch_sizes and runner.batch_sizes[-1] == 40
    requests = [make_request(p, max_new_tokens=16) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    replays_before = executor.model_engine.graph_runner.num_replays
    on_drafts_in_flight = verify_steps = 0
    while executor.has_work:
        waiting = {r.request_id: num_in_flight_tokens(r.tokens) for r in executor.active_requests}
        iteration = executor.step()
        if iteration is None:
            continue
        batch = iteration.batch
        on_drafts_in_flight += any(waiting.get(r.request_id, 0) > 1 for r in batch.generation_requests)
        verify_steps += not batch.context_chunks and any(r.py_draft_tokens for r in batch.generation_requests)
    assert [r.output_token_ids for r in requests] == plain
    assert on_drafts_in_flight > 0, "no forward was launched on drafts still in flight"
    assert executor.model_engine.graph_runner.num_replays - replays_before >= verify_steps > 0


def test_n_gram_drafts_drafted_on_the_device_keep_their_acceptance_under_overlap() -> None:
    """tiny-random in float32 falls into short cycles, where prompt lookup pays: with the overlap
    scheduler the engine drafts each step built in flight on the device from the tokens the model
    produced, so acceptance stays what it is without overlap (drafting from the drafts in flight
    collapsed it to a tenth), and the outputs are plain decoding's."""
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32")).to("cuda")
    prompts = [[(i * 37 + j * 11) % 500 + 1 for j in range(12)] for i in range(4)]
    plain, _ = _generate(model, prompts, None, max_new_tokens=64)
    without, acceptance_without = _acceptance(model, prompts, overlap=False)
    with_overlap, acceptance = _acceptance(model, prompts, overlap=True)
    assert with_overlap == without == plain
    assert acceptance_without > 0.3
    assert acceptance >= 0.9 * acceptance_without, (acceptance, acceptance_without)


def test_the_fused_drafting_kernel_is_the_reference_on_the_gpu() -> None:
    """The n-gram drafting kernel of steps built in flight (``speculative/triton_drafting.py``),
    compiled for the GPU, on the random cases the interpreted test runs: drafts, counts, history
    rows and draft slots equal the numpy reference's, nothing else written."""
    from tests.helpers.interpreted_drafting import run_case

    failed = [case for case in (run_case(seed, "cuda") for seed in range(30)) if not case["ok"]]
    assert not failed, failed


def test_the_engine_drafts_steps_in_flight_with_the_fused_kernel() -> None:
    """After warm-up (which compiles every variant of the kernel) the engine drafts with it, and
    a run with drafts in flight never waited for a staging buffer."""
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32")).to("cuda")
    config = make_config(max_num_tokens=96, tokens_per_block=8, num_blocks=512, max_batch_size=8,
                         cuda_graph_config=CudaGraphConfig(), speculative_config=SPEC)
    executor = create_py_executor(config, model=model)
    engine = executor.model_engine
    assert engine._drafting is not None and engine._drafting.fused, "the fused kernel did not compile: see the log"
    requests = [make_request([(i * 37 + j * 11) % 500 + 1 for j in range(12)], max_new_tokens=48) for i in range(3)]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests)
    assert sum(s.num_draft_tokens for s in executor.iteration_stats) > 0
    assert engine._staging.num_waits == 0
