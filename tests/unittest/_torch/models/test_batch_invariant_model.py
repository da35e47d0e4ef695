"""``LlamaConfig(batch_invariant=True)``: the model built with the batch-invariant layers
(``modules/batch_invariant.py``) computes each position's logits to the same bits whatever else
shares its forwards, however its sequence is chunked, whether its prefix was computed or reused,
and at any thread count: every schedule below must give exactly ``forward_full``'s bits.

These run without the executor (the engine by hand, ``test_modeling_llama.PagedRunner``) over
pools filled with NaN, so a read of any slot outside a request's own positions would show.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from test_modeling_llama import PagedRunner, full_logits

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.modules.batch_invariant import InvariantLinear, InvariantRMSNorm
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm.mapping import Mapping
from tests.helpers.strategies import examples

TINY = MODEL_PRESETS["tiny-random"]
# Qwen3's switches (q/k norms, biases) and a head_dim of its own: every swapped layer kind runs.
QWEN_LIKE = dataclasses.replace(TINY, qk_norm=True, qkv_bias=True, o_bias=True, head_dim=24, num_layers=1, seed=3)
DTYPES = ("float32", "bfloat16", "float16-weights", "float64")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def invariant(config: LlamaConfig, **changes) -> LlamaForCausalLM:
    return LlamaForCausalLM(dataclasses.replace(config, batch_invariant=True, **changes))


@pytest.fixture(scope="module")
def models() -> dict[str, LlamaForCausalLM]:
    built = {dtype: invariant(TINY, dtype=dtype) for dtype in DTYPES}
    built["qwen-like"] = invariant(QWEN_LIKE)
    return built


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY.vocab_size) for _ in range(n)]


def test_every_layer_is_swapped_and_the_weights_are_the_same(models):
    model = models["qwen-like"]
    kinds = {type(m) for m in model.modules()}
    assert Linear not in kinds and RMSNorm not in kinds and {InvariantLinear, InvariantRMSNorm} <= kinds
    plain = LlamaForCausalLM(QWEN_LIKE)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    tied = invariant(dataclasses.replace(TINY, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("name", [*DTYPES, "qwen-like"])
def test_the_logits_are_the_default_models_to_its_precision(models, name):
    config = QWEN_LIKE if name == "qwen-like" else dataclasses.replace(TINY, dtype=name)
    ids = torch.tensor(tokens(70, seed=1))
    got = models[name].forward_full(ids).double()
    want = LlamaForCausalLM(config).forward_full(ids).double()
    # a grid of about 2**-21 of each row's largest value; bfloat16 keeps 8 bits either way
    tolerance = 0.1 if name == "bfloat16" else 2e-4
    assert (got - want).abs().max() < tolerance * want.abs().max()


@settings(max_examples=examples(1 / 5, 12), deadline=None)
@given(data=st.data(), name=st.sampled_from([*DTYPES, "qwen-like"]), tpb=st.sampled_from([1, 3, 4, 16]))
def test_any_schedule_gives_forward_fulls_bits(models, data, name, tpb):
    """Several sequences, each in chunks of drawn sizes, interleaved in drawn forwards; one of them
    may reuse another's prefix blocks. Every position's logits equal ``forward_full``'s."""
    model = models[name]
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4), label="lengths")
    seqs = {f"r{i}": tokens(n, seed=100 + i) for i, n in enumerate(lengths)}
    runner = PagedRunner(model, num_blocks=sum(-(-n // tpb) for n in lengths) + 4, tokens_per_block=tpb,
                         seed=data.draw(st.integers(0, 9)), fill=float("nan"))
    shared = None
    if len(seqs) > 1 and data.draw(st.booleans(), label="reuse a prefix"):
        # r1 starts with r0's first whole blocks, then runs on its own: a reused prefix
        blocks = data.draw(st.integers(1, max(1, len(seqs["r0"]) // tpb)), label="blocks reused")
        if blocks * tpb < len(seqs["r0"]):
            seqs["r1"] = seqs["r0"][: blocks * tpb] + seqs["r1"]
            shared = blocks
    done = {rid: 0 for rid in seqs}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    order = list(seqs) if shared is None else [rid for rid in seqs if rid != "r1"]
    for rid in order:
        runner.add(rid)
    while any(done[rid] < len(seqs[rid]) for rid in order):
        step = {}
        for rid in data.draw(st.permutations(order), label="forward order"):
            left = len(seqs[rid]) - done[rid]
            if left and data.draw(st.booleans(), label=f"{rid} in this forward"):
                step[rid] = seqs[rid][done[rid] : done[rid] + data.draw(st.integers(1, left), label=f"{rid} chunk")]
        if not step:
            rid = next(r for r in order if done[r] < len(seqs[r]))
            step[rid] = seqs[rid][done[rid] :]
        for rid, out in runner.step(step).items():
            logits[rid].append(out)
            done[rid] += len(step[rid])
        if shared is not None and "r1" not in order and done["r0"] >= shared * tpb:
            runner.add("r1", runner.tables["r0"][:shared], num_cached=shared * tpb)  # r0's prefix, as cached
            done["r1"] = shared * tpb
            order.append("r1")
    note(f"lengths {lengths}, shared {shared}")
    for rid, tokens_ in seqs.items():
        want = full_logits(model, tokens_)
        start = shared * tpb if rid == "r1" and shared else 0
        assert torch.equal(torch.cat(logits[rid]), want[start:]), rid


def test_the_logits_do_not_depend_on_the_thread_count(models):
    model = models["float32"]
    ids = torch.tensor(tokens(90, seed=2))
    torch.set_num_threads(1)  # the module's fixture restores the count
    one = model.forward_full(ids)
    torch.set_num_threads(2)
    try:
        assert torch.equal(model.forward_full(ids), one)
    finally:
        torch.set_num_threads(1)


def test_a_sharded_layer_is_refused_by_name():
    with pytest.raises(ValueError, match="batch-invariant linear runs on one rank"):
        LlamaForCausalLM(dataclasses.replace(TINY, batch_invariant=True), Mapping(2, 0, 2))


def test_a_layer_kind_without_a_batch_invariant_form_is_refused():
    from tensorrt_llm._torch.modules.batch_invariant import make_batch_invariant

    model = LlamaForCausalLM(TINY)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"layer 'act_fn' \(GELU\) has no batch-invariant form"):
        make_batch_invariant(model, max_positions=16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_is_refused():
    with pytest.raises(ValueError, match="batch_invariant runs on the CPU only"):
        LlamaForCausalLM(dataclasses.replace(TINY, batch_invariant=True, dtype="bfloat16"), device="cuda")
