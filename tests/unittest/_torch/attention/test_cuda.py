"""The CUDA path against float32/float64 references: run on a machine with a GPU (skipped elsewhere).

    PYTHONPATH=. python -m pytest tests/unittest/_torch/attention/test_cuda.py -q

Error measure: ||out - ref|| / ||ref|| over fresh random inputs, outputs poisoned with NaN first
(an unwritten row shows). float32 lands far below 1e-4; bf16 between 1e-3 and 1e-2.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from factories import make_config, make_request
from tensorrt_llm._torch.attention_backend import build_plan
from tensorrt_llm._torch.models import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "an output row was never written"
    return float((out - ref).norm() / ref.norm())


def _random_batch(rng: random.Random, num_blocks: int, tpb: int, max_ctx: int):
    requests = []
    for _ in range(rng.randrange(1, 7)):
        kind = rng.random()
        if kind < 0.4:
            requests.append((rng.randrange(0, max_ctx), 1))  # decode
        elif kind < 0.7:
            requests.append((0, rng.randrange(2, 300)))  # fresh prefill
        else:
            requests.append((rng.randrange(1, max_ctx), rng.randrange(2, 200)))  # chunk over a prefix
    rng.shuffle(requests)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // tpb))] for c, n in requests]
    return requests, tables


def _layer_error(new, cached, tables, heads, num_blocks, tpb, dtype, seed) -> float:
    """One attention layer on CUDA in ``dtype`` (fast kernels) against the CPU in float64
    (reference kernels), on fresh random q, k, v and pools: the relative error."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    t = sum(new)
    q = torch.randn(t, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    k_pool = torch.randn(num_blocks, tpb, hkv, d, generator=gen, dtype=torch.float64)
    v_pool = torch.randn(num_blocks, tpb, hkv, d, generator=gen, dtype=torch.float64)

    def run(device, dt):
        plan = build_plan(new, cached, tables, tokens_per_block=tpb, num_blocks=num_blocks, num_kv_heads=hkv,
                          device=device)
        layer = plan.layer(k_pool.to(device, dt), v_pool.to(device, dt))
        return layer.attend(q.to(device, dt), k.to(device, dt), v.to(device, dt), d**-0.5)

    return rel_err(run(CUDA, dtype), run("cpu", torch.float64))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (4, 2, 16)])
def test_layer_attention_matches_float64_reference(dtype, tol, heads) -> None:
    """Mixed batches (flash varlen + Triton decode; float32: SDPA + Triton in IEEE)."""
    tpb, num_blocks = 32, 600
    rng = random.Random(heads[0] + heads[2])
    for trial in range(6):
        requests, tables = _random_batch(rng, num_blocks, tpb, max_ctx=3000)
        new, cached = [n for _, n in requests], [c for c, _ in requests]
        err = _layer_error(new, cached, tables, heads, num_blocks, tpb, dtype, seed=trial)
        assert err < tol, f"trial {trial}: {requests} rel err {err:.2e}"


def _small(dtype: str) -> LlamaForCausalLM:
    """CPU-drawn weights, so the CPU and CUDA models hold the same numbers."""
    return LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["small-random"], dtype=dtype, seed=5))


def _generate(model, prompts, graphs: bool, **config):
    config = make_config(
        max_num_tokens=96, tokens_per_block=8, num_blocks=256, max_batch_size=8,
        cuda_graph_config=CudaGraphConfig() if graphs else None, **config,
    )
    executor = create_py_executor(config, model=model)
    requests = [make_request(p, max_new_tokens=12) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    return [r.output_token_ids for r in requests]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(2048) for _ in range(70)]
    return [shared + [rng.randrange(2048) for _ in range(rng.randrange(1, 90))] for _ in range(5)] + [
        [rng.randrange(2048) for _ in range(200)]
    ]


@pytest.mark.parametrize("graphs", [True, False])
def test_float32_engine_generates_the_cpu_tokens(graphs: bool) -> None:
    prompts = _prompts()
    cpu = _generate(_small("float32"), prompts, graphs=False)
    gpu = _generate(_small("float32").to(CUDA), prompts, graphs=graphs)
    assert gpu == cpu


@pytest.mark.parametrize("graphs", [True, False])
def test_overlap_gives_the_tokens_of_the_plain_loop(graphs: bool) -> None:
    """The overlap scheduler feeds each in-flight token from the device (graph or eager
    inputs); greedy outputs equal the plain loop's."""
    prompts = _prompts()
    model = _small("float32").to(CUDA)
    plain = _generate(model, prompts, graphs=graphs, disable_overlap_scheduler=True)
    overlapped = _generate(model, prompts, graphs=graphs, disable_overlap_scheduler=False)
    assert overlapped == plain


def test_bfloat16_forward_close_to_float32_reference() -> None:
    tokens = torch.tensor(_prompts()[0])
    ref = _small("float32").forward_full(tokens)  # (L, vocab) on the CPU
    out = _small("bfloat16").to(CUDA).forward_full(tokens.to(CUDA))
    assert rel_err(out.float(), ref) < 3e-2


def test_graph_replay_equals_eager_decode() -> None:
    prompts = _prompts()
    eager = _generate(_small("bfloat16").to(CUDA), prompts, graphs=False)
    graph = _generate(_small("bfloat16").to(CUDA), prompts, graphs=True)
    same = sum(a == b for a, b in zip(eager, graph))
    assert same >= len(prompts) - 1  # bf16: a near-tie may flip one greedy pick, not more


def test_llm_on_cuda_defaults_to_bfloat16_and_serves() -> None:
    from tensorrt_llm.llmapi.llm import LLM, SamplingParams

    with LLM("small-random", device="cuda", max_num_tokens=128, max_batch_size=4) as llm:
        assert llm.model_config.dtype == "bfloat16"
        outs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=6))
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
        sampled = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
        assert len(sampled.outputs[0].token_ids) == 4


def test_weights_drawn_on_the_device_are_reproducible() -> None:
    config = LlamaConfig(dtype="bfloat16", seed=9)
    a = LlamaForCausalLM(config, device=CUDA).state_dict()
    b = LlamaForCausalLM(config, device=CUDA).state_dict()
    assert all(t.is_cuda for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("prefix", [0, 1000])
def test_single_chunk_matches_float64_reference(prefix: int) -> None:
    """One long chunk, fresh or over a prefix (blocks in reverse order): bf16 vs float64."""
    tpb, new, num_blocks = 32, 700, 64
    tables = [list(range(num_blocks))[::-1][: -(-(prefix + new) // tpb)]]
    err = _layer_error([new], [prefix], tables, (32, 8, 128), num_blocks, tpb, torch.bfloat16, seed=prefix)
    assert err < 2e-2, f"rel err {err:.2e}"


def test_host_tier_round_trip_on_cuda() -> None:
    from tensorrt_llm._torch.pyexecutor.kv_storage import KVCacheStorage

    storage = KVCacheStorage(num_layers=3, num_blocks=6, num_host_blocks=4, block_shape=(8, 2, 16),
                             dtype=torch.bfloat16, device=CUDA)
    storage.pools.normal_()
    before = storage.pools[:, :, 2].clone()
    storage.offload(2, 3)  # asynchronous
    storage.pools[:, :, 2].zero_()  # ordered after the copy on the stream
    storage.onboard(3, 5)
    storage.copy_block(5, 1)
    assert torch.equal(storage.pools[:, :, 5], before) and torch.equal(storage.pools[:, :, 1], before)
    assert torch.equal(storage.k_host[1][3].to(CUDA), before[0, 1])
