"""The device sampling pass on a GPU (skipped without CUDA): the CPU's answers, graphs or not.

    PYTHONPATH=. python -m pytest tests/unittest/_torch/pyexecutor/sampling/test_device_sampling_cuda.py -q

- The keyed noise is the same integers on the GPU as on the CPU, and the pass draws the CPU's
  tokens from the same float64 rows (every filter, penalties, logprobs).
- The pass (the part a decode graph captures) runs without a single host sync.
- Served end to end (tiny-random in float64, whose GPU forward differs from the CPU's by
  summation order alone): seeded sampled requests, with penalties, ``min_tokens`` and logprobs,
  beside greedy ones, give the CPU engine's tokens with CUDA graphs on or off and the overlap
  scheduler on or off; with graphs on, the sampling graphs are what replayed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.factories import make_config, make_request

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import mix32, row_keys, sampling_columns
from tensorrt_llm._torch.pyexecutor.engine.sampling_pass import device_columns, exponentials, sample_rows
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import device_pick
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
CONFIGS = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=20),
           SamplingConfig(temperature=1.2, top_p=0.8, logprobs=3), SamplingConfig(temperature=1.0, min_p=0.05),
           SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
           SamplingConfig(logprobs=0, presence_penalty=0.5)]


def to_cuda(array):
    return torch.from_numpy(array).to(CUDA)


def test_the_noise_is_the_same_integers_on_the_gpu():
    keys = torch.tensor([row_keys(seed, position)[1] for seed, position in [(0, 0), (7, 3), (2**64 - 1, 99)]])
    index = torch.arange(4096)
    assert torch.equal(mix32(keys[:, None] ^ index).cpu(), mix32(keys.to(CUDA)[:, None] ^ index.to(CUDA)).cpu())
    cpu, gpu = exponentials(keys, index), exponentials(keys.to(CUDA), index.to(CUDA)).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-14, atol=0)


def test_the_pass_on_the_gpu_draws_the_cpus_tokens():
    vocab = 1000
    requests = [make_request([1, 2, 3, 3], sampling_config=CONFIGS[i % len(CONFIGS)], max_new_tokens=64)
                for i in range(70)]
    for i, request in enumerate(requests):
        request.tokens.extend([5, 9, 5][: i % 4])
    logits = torch.randn(70, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    columns = sampling_columns(requests, vocab)
    cpu_tokens, cpu = device_pick(logits, columns, torch.from_numpy, None)
    gpu_tokens, gpu = device_pick(logits.to(CUDA), columns, to_cuda, None)
    assert gpu_tokens.cpu().tolist() == cpu_tokens.tolist()
    assert torch.allclose(gpu.logprob.cpu(), cpu.logprob, rtol=0, atol=1e-12)
    assert torch.equal(gpu.top_ids.cpu(), cpu.top_ids)


def test_the_pass_does_not_sync_with_the_host():
    vocab = 4096
    requests = [make_request([1, 2], sampling_config=CONFIGS[i % 5], max_new_tokens=8) for i in range(32)]
    columns = sampling_columns(requests, vocab)
    params = device_columns(to_cuda(columns.floats), to_cuda(columns.longs), to_cuda(columns.top_p_rows), torch.float32)
    logits = torch.randn(32, vocab, device=CUDA, dtype=torch.bfloat16)
    sample_rows(logits, params, columns.plan)  # warm-up (kernel loading)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample_rows(logits, params, columns.plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _serve(model, requests, *, graphs: bool, overlap: bool):
    config = make_config(max_num_tokens=128, tokens_per_block=8, num_blocks=128, max_batch_size=8,
                         cuda_graph_config=CudaGraphConfig() if graphs else None, disable_overlap_scheduler=not overlap)
    executor = create_py_executor(config, model=model)
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    return [(r.output_token_ids, [(e.token, [i for i, _ in e.top]) for e in r.py_logprobs]) for r in requests], executor


def _requests():
    prompts = [[1 + (7 * i + 3 * j) % 500 for j in range(5 + i)] for i in range(len(CONFIGS))]
    return [make_request(p, sampling_config=SamplingConfig(**{**_fields(c), "seed": 11 + i,
                                                                "min_tokens": 3 if i == 2 else 0}),
                         max_new_tokens=10, end_id=5)
            for i, (p, c) in enumerate(zip(prompts, CONFIGS))]


def _fields(config: SamplingConfig) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logprobs")
    return {name: getattr(config, name) for name in names}


def _tiny() -> LlamaForCausalLM:
    """tiny-random in float64, drawn on the CPU (the GPU copy holds the same numbers)."""
    return LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64"))


@pytest.mark.parametrize("graphs, overlap", [(True, True), (True, False), (False, True)])
def test_served_sampled_requests_give_the_cpu_engines_tokens(graphs, overlap):
    expected, _ = _serve(_tiny(), _requests(), graphs=False, overlap=False)
    got, executor = _serve(_tiny().to(CUDA), _requests(), graphs=graphs, overlap=overlap)
    assert got == expected
    runner = executor.model_engine.graph_runner
    if graphs:
        assert runner.num_sampling_replays > 0, "no decode step sampled from its graph"
