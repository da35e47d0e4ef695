"""The FP8 KV cache (``KvCacheConfig.dtype: fp8``) on the CPU, where the engine dequantizes on read.

What it must keep: the arithmetic (saturating writes, scales), the invariance that makes reuse
transparent (every read sees the stored values, so chunked, reused and one-shot prefills agree),
the bytes (block copies and the host tier move them unchanged), the capacity (the same bytes hold
twice a bf16 pool's tokens), the quality (SmolLM2's perplexity within 1% of the unquantized
cache's) and the executor's behaviour (greedy outputs and beams equal with reuse, chunking, the
host tier and overlap on or off, under ``recheck``, every invariant checked each step).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from tests.helpers.strategies import examples

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.kv_quant import (
    FP8,
    FP8_MAX,
    KvScales,
    dequantize,
    kv_cache_dtype,
    kv_scales_from_checkpoint,
    quantize,
)
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor import py_executor_creator
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_kv_cache_manager, create_py_executor

MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def model64() -> LlamaForCausalLM:
    return LlamaForCausalLM(MODEL)


# --------------------------------------------------------------------------- arithmetic


def test_quantize_saturates_and_round_trips_within_e4m3_precision():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 500.0, -1e6, 1e-3])
    stored = quantize(x, 1.0)
    assert stored.dtype == FP8
    back = dequantize(stored, 1.0, torch.float32)
    assert torch.isfinite(back).all()  # never NaN: out of range saturates
    assert back[4] == 448.0 and back[5] == -448.0
    normal = (x.abs() >= 2**-6) & (x.abs() <= 448)
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2**-4).all()  # 3 mantissa bits: half an ulp
    # a scale divides on the way in and multiplies on the way out
    assert dequantize(quantize(x[:4] * 8, 8.0), 8.0, torch.float32).tolist() == (back[:4] * 8).tolist()
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16 and kv_cache_dtype("fp8", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_config.dtype"):
        kv_cache_dtype("int8", torch.float32)
    with pytest.raises(ValueError, match="KvCacheConfig.dtype"):
        KvCacheConfig(dtype="fp16")


def test_kv_scales_are_read_by_layer_from_the_checkpoint_names_exporters_write():
    tensors = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # vLLM / llm-compressor
        "model.layers.0.self_attn.v_scale": torch.tensor([2.0]),
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(3.0),  # ModelOpt
        "model.layers.2.self_attn.kv_scale": torch.tensor(4.0),  # one for both
        "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2),
    }
    scales = kv_scales_from_checkpoint(tensors, num_layers=4)
    assert scales == KvScales((0.5, 3.0, 4.0, 1.0), (2.0, 1.0, 4.0, 1.0))
    assert kv_scales_from_checkpoint({"lm_head.weight": torch.zeros(1)}, num_layers=4) is None
    with pytest.raises(ValueError, match="layers.9"):
        kv_scales_from_checkpoint({"model.layers.9.self_attn.k_scale": torch.tensor(1.0)}, num_layers=4)
    with pytest.raises(ValueError, match="finite number > 0"):
        kv_scales_from_checkpoint({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, num_layers=4)
    with pytest.raises(ValueError, match="one number"):
        kv_scales_from_checkpoint({"model.layers.0.self_attn.v_scale": torch.ones(8)}, num_layers=4)


# --------------------------------------------------------------------------- the paged forward


def _forward(model, ids, step, dtype, *, tpb=4, scales=None):
    """Hidden states of one sequence prefilled ``step`` tokens at a time over fresh pools of ``dtype``."""
    length = len(ids)
    blocks = -(-length // tpb)
    shape = model.kv_cache_shape(blocks, tpb)
    k = [torch.zeros(shape, dtype=dtype) for _ in range(model.config.num_layers)]
    v = [torch.zeros(shape, dtype=dtype) for _ in range(model.config.num_layers)]
    from tensorrt_llm._torch.attention_backend.cpu_paged import CpuPlanBuilder

    builder = CpuPlanBuilder(tokens_per_block=tpb, num_blocks=blocks, dtype=model.config.torch_dtype, kv_scales=scales)
    out = []
    for start in range(0, length, step):
        stop = min(length, start + step)
        meta = AttentionMetadata([stop - start], [start], [list(range(blocks))], tpb)
        plan = builder.build(meta.num_new_tokens, meta.num_cached_tokens, meta.block_tables)
        out.append(model.forward_with_plan(ids[start:stop], torch.arange(start, stop), plan, k, v))
    return torch.cat(out), k


def test_every_read_sees_the_stored_values_so_chunking_changes_nothing():
    model = model64()
    ids = torch.randint(1, MODEL.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    whole, pools = _forward(model, ids, 37, FP8)
    assert pools[0].dtype == FP8
    for step in (1, 5, 16):  # decode steps, chunks over a cached prefix
        chunked, _ = _forward(model, ids, step, FP8)
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)
    plain, _ = _forward(model, ids, 37, torch.float64)
    error = (plain - whole).abs().max().item()
    assert 1e-4 < error < 0.5, error  # the cache was quantized, and not to garbage


def test_per_layer_scales_apply_to_their_layer():
    """Layer ``i`` of a plan with scales stores ``quantize(k / k_scale[i])`` and attends to the
    stored values times the scale, for the chunk's own keys and for a prefix read back."""
    from tensorrt_llm._torch.attention_backend.cpu_paged import build_cpu_plan
    from tensorrt_llm._torch.attention_backend.kernels import reference_context_attention

    gen = torch.Generator().manual_seed(4)
    scales = KvScales((1.0, 0.25), (1.0, 3.0))
    tpb, heads, kv_heads, dim = 4, 4, 2, 8
    k_pool = torch.zeros(3, tpb, kv_heads, dim, dtype=FP8)
    v_pool = torch.zeros(3, tpb, kv_heads, dim, dtype=FP8)
    q, k, v = (torch.randn(10, h, dim, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    outputs = []
    for start, stop in ((0, 6), (6, 10)):  # a prefill, then a chunk over its cached prefix
        plan = build_cpu_plan([stop - start], [start], [[2, 0, 1]], tokens_per_block=tpb, num_blocks=3,
                              dtype=torch.float64, kv_scales=scales)
        outputs.append(plan.layer(k_pool, v_pool, 1).attend(q[start:stop], k[start:stop], v[start:stop], 0.3))
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 4, 5])  # positions 0..9 through blocks 2, 0, 1
    stored_k = k_pool.view(-1, kv_heads, dim)[slots]
    assert torch.equal(stored_k.view(torch.uint8), quantize(k, 0.25).view(torch.uint8))
    kd, vd = dequantize(quantize(k, 0.25), 0.25, torch.float64), dequantize(quantize(v, 3.0), 3.0, torch.float64)
    expected = torch.cat([reference_context_attention(q[:6], kd[:6], vd[:6], (6,), (6,), 0.3),
                          reference_context_attention(q[6:], kd, vd, (4,), (10,), 0.3)])
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="per-layer KV scales"):
        plan.layer(k_pool, v_pool)


# --------------------------------------------------------------------------- bytes and capacity


def test_block_copies_and_the_host_tier_move_fp8_bytes_unchanged():
    storage = KVCacheStorage(num_layers=2, num_blocks=6, num_host_blocks=3, block_shape=(4, 2, 8), dtype=FP8)
    raw = storage.pools.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    raw[:, :, 2, 0, 0, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # NaN encodings: must survive as bytes
    original = raw[:, :, 2].clone()
    storage.offload(2, 1)
    storage.onboard(1, 4)
    storage.copy_block(4, 5)
    assert torch.equal(storage.host.view(torch.uint8)[1], original)
    assert torch.equal(raw[:, :, 4], original) and torch.equal(raw[:, :, 5], original)
    assert storage.bytes_per_token == 2 * 2 * 2 * 8  # one byte an element


def test_an_fp8_pool_holds_twice_the_tokens_of_a_16_bit_pool_in_the_same_bytes(monkeypatch):
    monkeypatch.setattr(py_executor_creator, "DEFAULT_KV_CACHE_BYTES", 1 << 20)  # the CPU's cap, made small
    model = LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="bfloat16"))
    config = ExecutorConfig(max_batch_size=64, max_seq_len=8192)
    pools = {}
    for name in ("auto", "fp8"):
        kv = create_kv_cache_manager(dataclasses.replace(config, kv_cache_config=KvCacheConfig(dtype=name)), model=model)
        pools[name] = (kv.num_blocks, kv.storage.bytes_per_token, kv.storage.pools.nbytes)
    (blocks16, per_token16, bytes16), (blocks8, per_token8, bytes8) = pools["auto"], pools["fp8"]
    assert per_token8 * 2 == per_token16 == MODEL.kv_bytes_per_token // 4  # bf16 -> fp8, against the float64 preset
    assert blocks8 == 2 * blocks16 and bytes8 == bytes16 == 1 << 20


def test_blocks_in_memory_doubles_when_a_block_takes_half_the_bytes() -> None:
    """The GPU pool's sizing (``free_gpu_memory_fraction`` of the free memory): the same bytes hold
    twice the blocks of half the size, up to one for the rounding down."""
    for free in (10**9, 148_000_000_000, 7 * 2**30 + 12345):
        bf16, fp8 = py_executor_creator.blocks_in_memory(free, 0.05, 65536), py_executor_creator.blocks_in_memory(free, 0.05, 32768)
        assert fp8 in (2 * bf16, 2 * bf16 + 1)


def test_the_start_up_line_and_the_metrics_say_what_the_pool_holds():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from tensorrt_llm.llmapi.llm import LLM
    from tensorrt_llm.serve.metrics import ServerMetrics

    llm = LLM("tiny-random", dtype="float32", kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=64, dtype="fp8"))
    try:
        line = llm.describe()
        assert "1024 tokens" in line and "float8_e4m3fn" in line and "0.125 KiB/token" in line, line
        text = generate_latest(ServerMetrics(llm.executor, kv_bytes_per_token=llm.kv_bytes_per_token).registry).decode()
        assert "trtllm_kv_cache_pool_tokens 1024.0" in text
        assert "trtllm_kv_cache_bytes_per_token 128.0" in text  # 2 (K, V) x 2 layers x 2 heads x 16 dims x 1 byte
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------- scales derived at start-up


@torch.inference_mode()
def test_derived_scales_are_each_layers_largest_k_and_v_over_the_calibration_prefill():
    """``calibrate_kv_scales``: per layer, max |K| after RoPE and max |V| over the calibration
    sequences, times the headroom, over 448, rounded up to a power of two; the maxima recomputed
    here from the layers' own pieces."""
    from tensorrt_llm._torch.models.kv_calibration import HEADROOM, calibrate_kv_scales, calibration_token_ids

    model = model64()
    sequences, source = calibration_token_ids(None, MODEL.vocab_size)
    assert source == "random token ids" and calibration_token_ids(None, MODEL.vocab_size)[0] == sequences  # seeded
    derived = calibrate_kv_scales(model, sequences, source)
    k_max, v_max = [0.0] * MODEL.num_layers, [0.0] * MODEL.num_layers
    for ids in sequences:
        ids = torch.tensor(ids)
        x, cos, sin = model.model.embed(ids, torch.arange(len(ids)))
        for i, layer in enumerate(model.model.layers):
            q, k, v = layer.attention_inputs(x, cos, sin)  # RoPE applied (the plain layer)
            k_max[i], v_max[i] = max(k_max[i], float(k.abs().max())), max(v_max[i], float(v.abs().max()))
            x = layer.finish(x, layer.attend(q, k, v, cos, sin, None))
    for scales, largest in ((derived.scales.k, k_max), (derived.scales.v, v_max)):
        for scale, m in zip(scales, largest):
            assert math.frexp(scale)[0] == 0.5  # a power of two: only the exponent moves
            assert m * HEADROOM / FP8_MAX <= scale < 2 * m * HEADROOM / FP8_MAX
    assert derived.tokens == sum(len(s) for s in sequences)
    assert "random token ids" in derived.describe() and "per layer" in derived.describe()


def test_calibration_text_goes_through_the_tokenizer(smollm2_tokenizer):
    from tensorrt_llm._torch.models.kv_calibration import CALIBRATION_TEXT, calibration_token_ids

    sequences, source = calibration_token_ids(smollm2_tokenizer, 49152)
    assert source == "built-in text" and len(sequences) == len(CALIBRATION_TEXT)
    assert sequences[0] == smollm2_tokenizer.encode(CALIBRATION_TEXT[0])


def test_the_start_up_line_says_the_scales_were_derived_or_are_one():
    from tensorrt_llm.llmapi.llm import LLM, SamplingParams

    for calculate, expected in ((True, "KV scales derived at start-up, per layer"), (False, "KV scales 1.0")):
        kv = KvCacheConfig(tokens_per_block=16, num_blocks=64, dtype="fp8", calculate_kv_scales=calculate)
        llm = LLM("tiny-random", dtype="float32", kv_cache_config=kv)
        try:
            assert expected in llm.describe(), llm.describe()
            stored = llm.executor.kv_cache_manager.storage.kv_scales
            assert (stored is not None and stored == llm.kv_scales) if calculate else stored is None
            assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=3)).outputs[0].token_ids) == 3
        finally:
            llm.shutdown()


# --------------------------------------------------------------------------- quality


def test_smollm2_perplexity_with_an_fp8_cache_is_within_one_percent(smollm2_path, smollm2_tokenizer):
    from benchmarks.model.perplexity import paged_perplexity, paragraph_ids

    from tensorrt_llm._torch.models.checkpoints.gguf_loader import load_llama_from_gguf

    from tensorrt_llm._torch.models.kv_calibration import calibrate_kv_scales, calibration_token_ids

    model = load_llama_from_gguf(smollm2_path, dtype="float32")
    texts = paragraph_ids(smollm2_tokenizer)
    plain = paged_perplexity(model, texts, kv_cache_dtype_name="auto", chunk_size=16)
    fp8 = paged_perplexity(model, texts, kv_cache_dtype_name="fp8", chunk_size=16)
    derived = calibrate_kv_scales(model, *calibration_token_ids(smollm2_tokenizer, model.config.vocab_size)).scales
    fp8_derived = paged_perplexity(model, texts, kv_cache_dtype_name="fp8", chunk_size=16, kv_scales=derived)
    print(f"perplexity auto {plain:.4f}, fp8 {fp8:.4f}, fp8 with derived scales {fp8_derived:.4f}")
    assert 7 < plain < 30
    assert plain < fp8 < 1.01 * plain, (plain, fp8)  # quantization costs something, and less than 1%
    assert abs(fp8_derived / plain - 1) < 0.01, (plain, fp8_derived)


# --------------------------------------------------------------------------- the executor


@dataclasses.dataclass(frozen=True)
class Workload:
    tokens_per_block: int
    max_num_tokens: int
    chunked: bool
    reuse: bool
    partial: bool
    host_blocks: int
    overlap: bool
    num_blocks: int
    prompts: tuple[tuple[tuple[int, ...], int, int], ...]  # (prompt, max_tokens, beam_width)
    warm: int  # the first ``warm`` prompts are served one at a time (they fill the prefix tree), then the rest together


def _document(doc: int, length: int) -> list[int]:
    return [1 + (doc * 7919 + i * 104729 + (i * i) % 11) % (MODEL.vocab_size - 2) for i in range(length)]


@st.composite
def workloads(draw) -> Workload:
    tpb = draw(st.integers(2, 6))
    prompts = []
    for i in range(draw(st.integers(2, 5))):
        prompt = tuple(_document(i % 2 if draw(st.booleans()) else 2, draw(st.integers(1, 5 * tpb)))
                       + draw(st.lists(st.integers(1, MODEL.vocab_size - 1), max_size=tpb)))
        prompts.append((prompt, draw(st.integers(1, 6)), draw(st.sampled_from([1, 1, 1, 2, 3]))))
    reuse = draw(st.booleans())
    longest = max(len(p) + n for p, n, _ in prompts)
    chunked = draw(st.booleans())
    need = max(b * (-(-(len(p) + n) // tpb) + 1) for p, n, b in prompts)  # the largest request alone
    return Workload(
        tokens_per_block=tpb,
        max_num_tokens=draw(st.integers(2 * tpb, 4 * tpb)) if chunked else longest + tpb,
        chunked=chunked,
        reuse=reuse,
        partial=reuse and draw(st.booleans()),
        host_blocks=draw(st.sampled_from([0, 8])),
        overlap=draw(st.booleans()),
        num_blocks=draw(st.integers(need, 2 * need)),
        prompts=tuple(prompts),
        warm=draw(st.integers(0, len(prompts) - 1)),
    )


def _executor(workload: Workload | None, num_blocks: int):
    """An FP8 executor for ``workload``; None: the reference (one request at a time, no reuse,
    no chunking, no host tier)."""
    tpb = workload.tokens_per_block if workload else 4
    bytes_per_block = MODEL.kv_bytes_per_token // 8 * tpb  # float64 -> fp8
    kv = KvCacheConfig(tokens_per_block=tpb, num_blocks=num_blocks, dtype="fp8",
                       enable_block_reuse=bool(workload and workload.reuse),
                       enable_partial_reuse=bool(workload and workload.partial),
                       host_cache_size=(workload.host_blocks if workload else 0) * bytes_per_block)
    config = ExecutorConfig(
        max_batch_size=8, max_seq_len=256, max_num_tokens=workload.max_num_tokens if workload else 256,
        enable_chunked_prefill=bool(workload and workload.chunked), kv_cache_config=kv,
        disable_overlap_scheduler=not (workload and workload.overlap),
    )
    return create_py_executor(config, model=model64())


@functools.lru_cache(maxsize=1024)
def solo(prompt: tuple[int, ...], max_tokens: int, beam_width: int) -> tuple[tuple[int, ...], ...]:
    """The outputs of ``prompt`` served alone with nothing reused (every beam's, best first)."""
    executor = _executor(None, 256)
    responses = []
    executor.enqueue_request(LlmRequest(input_token_ids=list(prompt), max_new_tokens=max_tokens, beam_width=beam_width),
                             lambda request, response: responses.append(response))
    executor.run_until_idle()
    return _outputs(responses)


def _outputs(responses) -> tuple[tuple[int, ...], ...]:
    final = responses[-1]
    assert final.finished and final.error is None, final
    if final.beams:
        return tuple(tuple(beam.tokens) for beam in final.beams)
    return (tuple(t for r in responses for t in r.new_token_ids),)


@settings(max_examples=examples(1 / 5, 15), deadline=None)
@given(workload=workloads())
def test_fp8_outputs_and_beams_do_not_depend_on_reuse_chunking_the_host_tier_or_overlap(workload: Workload):
    """Served together under ``recheck`` (every invariant checked after every step), with
    whatever reuse, chunking, host tier and overlap the workload draws, each request's greedy
    tokens, or beams, equal its solo run's."""
    from tests.helpers.invariants import ExecutorChecker

    checker = ExecutorChecker(_executor(workload, workload.num_blocks))
    requests = []
    for index, (prompt, max_tokens, beams) in enumerate(workload.prompts):
        request = LlmRequest(input_token_ids=list(prompt), max_new_tokens=max_tokens, beam_width=beams)
        checker.submit(request)
        requests.append((request, prompt, max_tokens, beams))
        if index < workload.warm:
            checker.drain()
    checker.drain()
    responses = {rid: response for rid, response in checker.final.items()}
    for request, prompt, max_tokens, beams in requests:
        response = responses[request.request_id]
        got = (tuple(tuple(b.tokens) for b in response.beams) if response.beams
               else (tuple(checker.tokens[request.request_id]),))
        note(f"request {request.request_id}: {got}")
        assert got == solo(prompt, max_tokens, beams), f"request {request.request_id} ({len(prompt)}-token prompt)"
    stats = checker.executor.iteration_stats
    if any(s.reuse_claimed_tokens for s in stats):
        event("reuse claimed")
    pool = checker.executor.kv_cache_manager.pool.stats()
    if pool.num_offloads:
        event("host tier: offloaded")
    if pool.num_onboards:
        event("host tier: onboarded")
    if any(b > 1 for _, _, b in workload.prompts):
        event("beams")


@pytest.mark.parametrize("overlap", [False, True])
def test_fp8_prefixes_back_from_the_host_tier_give_the_same_tokens(overlap: bool):
    """A prefix offloaded to the host tier and onboarded again (its FP8 bytes moved twice) serves
    the same tokens as the solo run that computed everything."""
    workload = Workload(tokens_per_block=4, max_num_tokens=64, chunked=True, reuse=True, partial=True, host_blocks=8,
                        overlap=overlap, num_blocks=7, prompts=(), warm=0)
    executor = _executor(workload, workload.num_blocks)
    doc0, doc1 = tuple(_document(0, 16)), tuple(_document(1, 16))
    outputs = {}
    for prompt in (doc0 + (5,), doc1 + (6,), doc0 + (7, 8)):  # the third reuses the first's prefix, from the host
        responses = []
        executor.enqueue_request(LlmRequest(input_token_ids=list(prompt), max_new_tokens=3),
                                 lambda request, response: responses.append(response))
        executor.run_until_idle()
        outputs[prompt] = _outputs(responses)
    stats = executor.kv_cache_manager.pool.stats()
    assert stats.num_offloads and stats.num_onboards, stats
    assert sum(s.reuse_claimed_tokens for s in executor.iteration_stats) >= 16
    for prompt, got in outputs.items():
        assert got == solo(prompt, 3, 1)
