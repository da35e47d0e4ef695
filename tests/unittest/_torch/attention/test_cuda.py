"""The CUDA path against float32/float64 references: run on a machine with a GPU (skipped elsewhere).

    PYTHONPATH=. python -m pytest tests/unittest/_torch/attention/test_cuda.py -q

Error measure: ||out - ref|| / ||ref|| over fresh random inputs, outputs poisoned with NaN first
(an unwritten row shows). float32 lands far below 1e-4; bf16 between 1e-3 and 1e-2.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from tests.helpers.factories import make_config, make_request
from tests.helpers.paged_batches import random_paged_batch, rel_err
from tensorrt_llm._torch.attention_backend import build_plan
from tensorrt_llm._torch.models import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


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
    """Mixed batches (Triton context + Triton decode; float32: SDPA + Triton decode in IEEE)."""
    tpb, num_blocks = 32, 600
    rng = random.Random(heads[0] + heads[2])
    for trial in range(6):
        requests, tables = random_paged_batch(rng, num_blocks, tpb, max_ctx=3000, sizes=(1, 7), decode_share=0.4,
                                             shuffle=True)
        new, cached = [n for _, n in requests], [c for c, _ in requests]
        err = _layer_error(new, cached, tables, heads, num_blocks, tpb, dtype, seed=trial)
        assert err < tol, f"trial {trial}: {requests} rel err {err:.2e}"


def _small(dtype: str) -> LlamaForCausalLM:
    """CPU-drawn weights, so the CPU and CUDA models hold the same numbers."""
    return LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["small-random"], dtype=dtype, seed=5))


def _generate(model, prompts, graphs: bool | CudaGraphConfig, replays: list | None = None, **config):
    """Greedy outputs of ``prompts``; ``replays``, if given, gets the engine's piecewise replays."""
    graph_config = graphs if isinstance(graphs, CudaGraphConfig) else CudaGraphConfig() if graphs else None
    config = make_config(
        max_num_tokens=96, tokens_per_block=8, num_blocks=256, max_batch_size=8,
        cuda_graph_config=graph_config, **config,
    )
    executor = create_py_executor(config, model=model)
    requests = [make_request(p, max_new_tokens=12) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    runner = executor.model_engine.piecewise_runner
    if replays is not None:
        replays.append(runner.num_replays if runner is not None else 0)
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


@pytest.mark.parametrize("dtype, overlap", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_piecewise_graphs_give_the_tokens_of_eager_mixed_forwards(dtype: str, overlap: bool) -> None:
    """Mixed forwards (chunks with decodes) replayed piecewise, padded to the captured token
    counts, give the greedy tokens of the same forwards run eagerly: all of them in float32; in
    bf16 (the Triton context kernel between the pieces) a near-tie may flip one request's."""
    prompts = _prompts()
    model = _small(dtype).to(CUDA)
    replays: list[int] = []
    eager = _generate(model, prompts, graphs=CudaGraphConfig(capture_num_tokens=[]), disable_overlap_scheduler=not overlap)
    piecewise = _generate(model, prompts, graphs=CudaGraphConfig(capture_num_tokens=[16, 48, 96]), replays=replays,
                          disable_overlap_scheduler=not overlap)
    assert replays[0] > 0, "no forward replayed piecewise"
    same = sum(a == b for a, b in zip(eager, piecewise))
    assert same == len(prompts) if dtype == "float32" else same >= len(prompts) - 1


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


@pytest.mark.parametrize("tiles", [(128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_triton_context_kernel_matches_float64_reference(tiles, heads) -> None:
    """The Triton context kernel under several tile shapes (the default first) on packed chunks
    with and without prefixes, lengths on and off the tiles' edges: bf16 against float64, and
    against flash-2 on the same bf16 inputs."""
    pytest.importorskip("triton")
    from tensorrt_llm._torch.attention_backend.kernels import flash_varlen, reference_context_attention
    from tensorrt_llm._torch.attention_backend.triton_context import ContextConfig, context_attention_triton

    hq, hkv, d = heads
    q_lens, k_lens = (300, 2, 64, 129, 1000), (300, 1500, 64, 700, 1013)
    gen = torch.Generator().manual_seed(sum(tiles))
    q = torch.randn(sum(q_lens), hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(k_lens), hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(k_lens), hkv, d, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=CUDA)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device=CUDA)
    qc, kc, vc = (t.to(CUDA, torch.bfloat16) for t in (q, k, v))
    got = context_attention_triton(qc, kc, vc, cu_q, cu_k, max(q_lens), d**-0.5, config=ContextConfig(*tiles))
    reference = reference_context_attention(q, k, v, q_lens, k_lens, d**-0.5)
    assert rel_err(got, reference) < 1e-2
    flash = flash_varlen(qc, kc, vc, cu_q, cu_k, q_lens, k_lens, d**-0.5)
    assert rel_err(got, flash) < 1e-2


def test_host_tier_round_trip_on_cuda() -> None:
    from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

    storage = KVCacheStorage(num_layers=3, num_blocks=6, num_host_blocks=4, block_shape=(8, 2, 16),
                             dtype=torch.bfloat16, device=CUDA)
    storage.before_compute()  # the test writes the pools itself
    storage.pools.normal_()
    before = storage.pools[:, :, 2].clone()
    storage.offload(2, 3)  # on the copy stream, after the writes above
    storage.before_compute()
    storage.pools[:, :, 2].zero_()  # ordered after the offload
    storage.onboard(3, 5)  # after the zeroing (the copy stream waits for it), from the offloaded copy
    storage.copy_block(5, 1)  # on the compute stream, after the onboard
    assert torch.equal(storage.pools[:, :, 5], before) and torch.equal(storage.pools[:, :, 1], before)
    storage.synchronize()  # before the host reads the tier
    assert torch.equal(storage.k_host[1][3].to(CUDA), before[0, 1])


# ---- the host tier's copy stream (kv_storage's module docstring) ------------------------------------

_SLEEP_CYCLES = 2_000_000_000  # about a second of one GPU thread: a forward that runs long


def _tier_storage(**sizes):
    """A host tier with blocks of 4 MiB (float32), so that a copy takes long enough to race with."""
    from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

    shape = dict(num_layers=8, num_blocks=8, num_host_blocks=4, block_shape=(64, 8, 128)) | sizes
    storage = KVCacheStorage(**shape, dtype=torch.float32, device=CUDA)
    storage.before_compute()  # the test writes the pools itself
    storage.pools.normal_()
    return storage


def test_host_tier_copies_wait_for_the_compute_work_on_their_blocks() -> None:
    """An offload of a block the forward in flight writes waits for that forward; the next forward
    does not overwrite the slot before the offload has read it, and reads an onboarded block only
    once it has landed. Each wrong order would race with a copy of 4 MiB behind a long kernel."""
    storage = _tier_storage()
    storage.before_compute([[1, 2]])  # forward n uses blocks 1 and 2 ...
    torch.cuda._sleep(_SLEEP_CYCLES)  # ... runs long ...
    storage.pools[:, :, 1].fill_(7.0)  # ... and writes block 1 last
    storage.offload(1, 0)  # block 1 is forward n's: the offload waits for all of it
    storage.before_compute([[1]])  # forward n+1 takes block 1's slot
    storage.pools[:, :, 1].fill_(-1.0)
    storage.onboard(0, 3)  # block 1's offloaded content into block 3
    storage.before_compute([[3]])  # forward n+2 reads block 3
    got = storage.pools[:, :, 3].clone()
    storage.synchronize()
    torch.cuda.synchronize()
    assert bool((storage.host[0] == 7.0).all()), "the offload read block 1 before forward n wrote it, or after n+1 did"
    assert bool((got == 7.0).all()), "forward n+2 read block 3 before its onboard landed"
    assert bool((storage.pools[:, :, 1] == -1.0).all())
    assert storage.num_copy_stream_tail_waits == 1  # the offload of forward n's block; the onboard waited for M only


def test_host_tier_copies_run_beside_the_forward_in_flight() -> None:
    """Offloads and onboards of blocks the forward in flight does not use run while it runs (the
    copy stream waits for the forwards before it only), and the next forward sees their result."""
    storage = _tier_storage()
    expected = storage.pools[:, :, 5].clone()
    storage.offload(5, 1)  # warms the copy path up (the copy stream's device buffers)
    storage.synchronize()
    storage.before_compute([[0, 1]])  # forward n uses blocks 0 and 1, for about a second
    torch.cuda._sleep(_SLEEP_CYCLES)
    forward_done = torch.cuda.Event()
    forward_done.record()
    storage.offload(5, 2)
    storage.onboard(2, 6)
    storage.synchronize()  # the host waits for the copies alone
    assert not forward_done.query(), "the copies waited for the forward in flight"
    storage.before_compute([[6]])  # forward n+1 reads block 6
    assert torch.equal(storage.pools[:, :, 6], expected)
    assert storage.num_copy_stream_tail_waits == 1  # the first copy only (after the test's own writes)


def test_host_tier_batches_equal_the_copies_one_by_one() -> None:
    """Offloads and onboards issued as batches (onboards staged as they come; at issue one gather,
    a transfer per run of host slots, one scatter) give what the copies give one by one: runs of
    slots and single slots, an onboard of a slot an offload of the batch writes (which issues the
    batch first), a slot offloaded into again while the onboard that freed it is pending, and
    full batches issued before the next copy joins."""
    storage = _tier_storage(num_blocks=12, num_host_blocks=8, max_batch_blocks=6)
    pools = storage.pools.clone()
    host = storage.host.to(CUDA)
    ops = [("off", 0, 0), ("off", 1, 1),
           ("on", 1, 10),  # reads host slot 1, which the pending offload writes: batch 1 is issued first
           ("off", 7, 1),  # slot 1 again, while the onboard that read it is pending (staged already)
           ("off", 2, 2), ("off", 3, 3), ("off", 4, 4), ("off", 5, 6),  # 6 copies: batch 2
           ("on", 6, 9), ("on", 0, 11), ("on", 3, 0), ("on", 4, 2), ("on", 2, 7), ("on", 1, 5)]  # batch 3
    for kind, a, b in ops:
        if kind == "off":
            storage.offload(a, b)
            host[b] = pools[:, :, a]
        else:
            storage.onboard(a, b)
            pools[:, :, b] = host[a]
    storage.synchronize()
    storage.before_compute()
    assert storage.num_batches == 3
    assert torch.equal(storage.pools, pools)
    assert torch.equal(storage.host.to(CUDA), host)


def _tier_prompts() -> list[list[int]]:
    """Prompts sharing a prefix, each followed by a long one that evicts it (to the host tier)."""
    rng = random.Random(11)
    shared = [rng.randrange(2048) for _ in range(70)]
    prompts = []
    for _ in range(4):
        prompts.append(shared + [rng.randrange(2048) for _ in range(rng.randrange(10, 40))])
        prompts.append([rng.randrange(2048) for _ in range(290)])
    return prompts


@pytest.mark.parametrize("graphs, overlap, ahead", [(True, True, 0), (False, True, 0), (True, False, 0), (True, True, 12)])
def test_host_tier_under_eviction_gives_the_cpu_tokens(graphs: bool, overlap: bool, ahead: int) -> None:
    """A pool of 40 blocks and a host tier: prefixes are offloaded and onboarded again while
    forwards run (overlap), and the greedy tokens are the CPU's with a pool that never evicts.
    ``ahead``: ``offload_ahead_blocks``, whose copies run beside the forward just launched."""
    from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

    prompts = _tier_prompts()
    cpu = _generate(_small("float32"), prompts, graphs=False)
    model = _small("float32").to(CUDA)
    bytes_per_block = KVCacheStorage.bytes_per_block(model.config.num_layers, model.kv_cache_shape(1, 8)[1:],
                                                     torch.float32)
    config = make_config(
        max_num_tokens=96, tokens_per_block=8, num_blocks=40, max_batch_size=8,
        cuda_graph_config=CudaGraphConfig() if graphs else None, disable_overlap_scheduler=not overlap,
    )
    kv_config = dataclasses.replace(config.kv_cache_config, host_cache_size=64 * bytes_per_block,
                                    offload_ahead_blocks=ahead)
    executor = create_py_executor(dataclasses.replace(config, kv_cache_config=kv_config), model=model)
    kv, moved_ahead = executor.kv_cache_manager, []
    offload_ahead = kv.offload_ahead
    kv.offload_ahead = lambda: moved_ahead.append(offload_ahead()) or moved_ahead[-1]  # counted
    requests = [make_request(p, max_new_tokens=12) for p in prompts]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    pool = executor.kv_cache_manager.pool
    assert pool.num_offloads > 0 and pool.num_onboards > 0, (pool.num_offloads, pool.num_onboards)
    assert (sum(moved_ahead) > 0) == (ahead > 0), "offload_ahead moved blocks exactly when a reserve is set"
    assert [r.output_token_ids for r in requests] == cpu


# ---- pinned staging of a launch's inputs ------------------------------------------------------------


def test_pinned_staging_copies_arrays_and_never_rewrites_a_pending_buffer() -> None:
    import numpy as np

    from tensorrt_llm._torch.attention_backend.staging import PinnedStaging

    staging = PinnedStaging(CUDA, capacity=1024)  # small: the third array makes it grow
    arrays = [np.arange(10, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4),
              np.arange(500, dtype=np.int64), np.zeros((0,), dtype=np.int64)]
    with staging.step():
        torch.cuda._sleep(_SLEEP_CYCLES // 4)  # the copies below wait behind this on the stream
        first = [staging.to_device(a) for a in arrays]
        into = torch.full((3, 8), -1, dtype=torch.int32, device=CUDA)
        staging.copy_to(into[:, :4], arrays[1])  # a strided destination
    with staging.step():  # the other buffer
        second = staging.to_device(arrays[0] + 100)
    with staging.step():  # the first buffer again: its copies may still be pending, so it waits
        third = staging.to_device(arrays[0] + 200)
    assert staging.num_waits == 1
    for array, tensor in zip(arrays, first):
        assert tensor.device.type == "cuda" and tensor.shape == array.shape
        assert torch.equal(tensor.cpu(), torch.from_numpy(array))
    assert torch.equal(into[:, :4].cpu(), torch.from_numpy(arrays[1])) and bool((into[:, 4:] == -1).all())
    assert torch.equal(second.cpu(), torch.from_numpy(arrays[0] + 100))
    assert torch.equal(third.cpu(), torch.from_numpy(arrays[0] + 200))
