"""Beam search on the GPU (skipped without CUDA): the engine's beams on a CUDA device, with CUDA
graphs and the overlap scheduler on (the defaults there), equal the CPU reference of
``test_beam_search``, which recomputes every beam's whole sequence without a KV cache.

The model is the same tiny-random float64 one, moved to the GPU; float64 takes the torch
attention kernels there, so GPU and reference differ by summation order alone. Greedy requests
served in the same batches are the greedy reference's, so the graph-replayed decode steps (greedy
alone) and the eager beam steps agree on one KV pool.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from test_beam_search import PROMPTS, assert_same_beams, beam_request, greedy_reference, model, reference_beam_search, serve

from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@functools.cache
def _gpu_model():
    """The reference's model (CPU-drawn float64 weights), copied to the GPU."""
    return copy.deepcopy(model()).to("cuda")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("tokens_per_block,width", [(4, 2), (16, 4), (1, 3)])
def test_beams_on_the_gpu_equal_the_reference(tokens_per_block: int, width: int, overlap: bool) -> None:
    beams = [beam_request(p, width, 6, end_id=7, num_return_sequences=width) for p in PROMPTS]
    greedy_prompt = tuple(itertools.islice(itertools.cycle((1, 4, 2, 5, 3)), 11))
    greedy = LlmRequest(list(greedy_prompt), max_new_tokens=8, end_id=None)
    final, executor = serve([*beams, greedy], tokens_per_block=tokens_per_block, chunked=True, on_model=_gpu_model(),
                            cuda_graph_config=CudaGraphConfig(), disable_overlap_scheduler=not overlap)
    assert executor.overlap is overlap
    for prompt, request in zip(PROMPTS, beams):
        expected = reference_beam_search(prompt, width, 6, {7})
        assert_same_beams(final[request.request_id], expected, f"GPU, prompt {prompt}, {width} beams")
    assert final[greedy.request_id].error is None
    assert greedy.output_token_ids == greedy_reference(greedy_prompt, 8)
