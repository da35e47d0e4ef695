"""The paged forward of the Llama model must equal the no-cache reference, whatever the paging.

Each test plays the model engine by hand through ``PagedRunner``: it owns the K/V pools, hands
out blocks in a shuffled order, builds ``AttentionMetadata`` for a flat forward and splits the
logits back per request. The reference is always ``forward_full`` on the request's whole
sequence, in float64, so any paging mistake shows up far above rounding noise.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.models import (
    MODEL_PRESETS,
    AttentionMetadata,
    LlamaConfig,
    LlamaForCausalLM,
)

TOL = 1e-9  # float64: paged and reference differ only by summation order


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(dtype="float64", seed=1))


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class PagedRunner:
    """The engine, by hand: pools, a shuffled free list, and each request's table and progress."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int = 32,
        tokens_per_block: int = 4,
        seed: int = 0,
        fill: float = 0.0,
    ) -> None:
        self.model = model
        self.tpb = tokens_per_block
        shape = model.kv_cache_shape(num_blocks, tokens_per_block)
        dtype = model.config.torch_dtype
        layers = model.config.num_layers
        self.k_cache = [torch.full(shape, fill, dtype=dtype) for _ in range(layers)]
        self.v_cache = [torch.full(shape, fill, dtype=dtype) for _ in range(layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # block tables are a random permutation
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def add(self, rid: str, blocks: list[int] | None = None, num_cached: int = 0) -> None:
        """Start a request; ``blocks``/``num_cached``: a reused prefix already in the pools."""
        blocks = list(blocks or [])
        self.free = [b for b in self.free if b not in blocks]
        self.tables[rid] = blocks
        self.cached[rid] = num_cached

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One flat forward: ``chunks`` maps request -> its new tokens, in flat order."""
        ids, pos = [], []
        for rid, tokens in chunks.items():
            end = self.cached[rid] + len(tokens)
            while len(self.tables[rid]) * self.tpb < end:
                self.tables[rid].append(self.free.pop())
            ids += tokens
            pos += range(self.cached[rid], end)
        meta = AttentionMetadata(
            num_new_tokens=[len(t) for t in chunks.values()],
            num_cached_tokens=[self.cached[rid] for rid in chunks],
            block_tables=[list(self.tables[rid]) for rid in chunks],
            tokens_per_block=self.tpb,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(pos, dtype=torch.int64),
            meta,
            self.k_cache,
            self.v_cache,
        )
        logits = self.model.compute_logits(hidden)  # (T, vocab)
        out, start = {}, 0
        for rid, tokens in chunks.items():
            out[rid] = logits[start : start + len(tokens)]
            start += len(tokens)
            self.cached[rid] += len(tokens)
        return out


def full_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    return model.forward_full(torch.tensor(tokens, dtype=torch.int64))


def run_chunked(runner: PagedRunner, rid: str, tokens: list[int], sizes: list[int]) -> torch.Tensor:
    assert sum(sizes) == len(tokens)
    runner.add(rid)
    outs, start = [], 0
    for size in sizes:
        outs.append(runner.step({rid: tokens[start : start + size]})[rid])
        start += size
    return torch.cat(outs)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("hidden_size", -1),
        ("num_layers", 0),
        ("num_heads", 0),
        ("num_kv_heads", 0),
        ("head_dim", 0),
        ("head_dim", 15),
        ("intermediate_size", 2.5),
        ("max_position_embeddings", 0),
        ("num_layers", True),
        ("rope_theta", 0.0),
        ("rms_norm_eps", -1e-6),
        ("dtype", "int8"),
        ("dtype", "half"),
        ("seed", "0"),
    ],
)
def test_config_rejects_bad_field_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**{field: value})


def test_config_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="num_heads.*num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)


def test_config_dtype_and_presets() -> None:
    assert LlamaConfig().torch_dtype == torch.float32
    assert LlamaConfig(dtype="float64").torch_dtype == torch.float64
    assert MODEL_PRESETS["tiny-random"] == LlamaConfig()
    small = MODEL_PRESETS["small-random"]
    assert (small.hidden_size, small.num_layers, small.vocab_size) == (256, 4, 2048)
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.seed = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_new_tokens=[1, 2], num_cached_tokens=[0], block_tables=[[0]]), "one entry"),
        (dict(num_new_tokens=[5], num_cached_tokens=[0], block_tables=[[0]]), "block_tables"),
        (dict(num_new_tokens=[1], num_cached_tokens=[4], block_tables=[[0]]), "block_tables"),
        (dict(num_new_tokens=[-1], num_cached_tokens=[0], block_tables=[[0]]), "num_new_tokens"),
        (dict(num_new_tokens=[1], num_cached_tokens=[-1], block_tables=[[0]]), "num_cached_tokens"),
        (dict(num_new_tokens=[8], num_cached_tokens=[0], block_tables=[[3, 3]]), "twice"),
        (dict(num_new_tokens=[1], num_cached_tokens=[0], block_tables=[[-2]]), "block ids"),
        (dict(num_new_tokens=[1], num_cached_tokens=[0], block_tables=[[0]], tokens_per_block=0),
         "tokens_per_block"),
    ],
)
def test_metadata_rejects_inconsistent_input(kwargs: dict, field: str) -> None:
    kwargs.setdefault("tokens_per_block", 4)
    with pytest.raises(ValueError, match=field):
        AttentionMetadata(**kwargs)


def test_metadata_allows_spare_blocks_and_shared_prefix_blocks() -> None:
    meta = AttentionMetadata(
        num_new_tokens=[2, 1],
        num_cached_tokens=[4, 4],
        block_tables=[[7, 1, 9], [7, 2]],
        tokens_per_block=4,
    )
    assert (meta.num_requests, meta.num_tokens) == (2, 3)


# --------------------------------------------------------------------------- weights


def test_same_seed_same_weights_different_seed_different() -> None:
    a = LlamaForCausalLM(LlamaConfig(seed=7)).state_dict()
    b = LlamaForCausalLM(LlamaConfig(seed=7)).state_dict()
    c = LlamaForCausalLM(LlamaConfig(seed=8)).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)


def test_init_leaves_global_rng_alone() -> None:
    before = torch.get_rng_state()
    LlamaForCausalLM(LlamaConfig(seed=3))
    assert torch.equal(before, torch.get_rng_state())


def test_float32_weights_are_float64_weights_rounded() -> None:
    w32 = LlamaForCausalLM(LlamaConfig(dtype="float32")).state_dict()
    w64 = LlamaForCausalLM(LlamaConfig(dtype="float64")).state_dict()
    for name in w64:
        assert w32[name].dtype == torch.float32 and w64[name].dtype == torch.float64
        assert torch.equal(w32[name], w64[name].to(torch.float32)), name


def test_weights_do_not_require_grad(model: LlamaForCausalLM) -> None:
    assert not any(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------- paged == full


def test_chunks_mid_block_and_single_token_match_full(model: LlamaForCausalLM) -> None:
    tokens = random_tokens(23, seed=0)
    # tokens_per_block=4: chunks start at 0, 3, 4, 5, 11, 12, 20; those at 3, 5 and 11 start
    # mid-block, those at 3, 4 and 11 are a single token.
    sizes = [3, 1, 1, 6, 1, 8, 3]
    runner = PagedRunner(model, num_blocks=16, tokens_per_block=4, seed=5)
    paged = run_chunked(runner, "r", tokens, sizes)
    assert paged.dtype == torch.float64
    assert max_diff(paged, full_logits(model, tokens)) < TOL


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 40),
    tokens_per_block=st.sampled_from([1, 2, 3, 4, 8]),
    cuts=st.sets(st.integers(1, 39), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_property_any_chunking_any_block_order_matches_full(
    model: LlamaForCausalLM, length: int, tokens_per_block: int, cuts: set[int], seed: int
) -> None:
    bounds = [0, *sorted(c for c in cuts if c < length), length]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    note(f"sequence of {length} tokens, {tokens_per_block} tokens/block, chunk sizes {sizes}")
    tokens = random_tokens(length, seed)
    runner = PagedRunner(model, num_blocks=48, tokens_per_block=tokens_per_block, seed=seed)
    paged = run_chunked(runner, "r", tokens, sizes)
    note(f"block table {runner.tables['r']}")
    assert max_diff(paged, full_logits(model, tokens)) < TOL


def test_two_requests_in_one_forward_do_not_affect_each_other(model: LlamaForCausalLM) -> None:
    a, b = random_tokens(19, seed=1), random_tokens(14, seed=2)
    b_other = random_tokens(14, seed=3)
    # Both requests draw from one shuffled free list, so their blocks interleave in the pool.
    plan = [({"a": 5, "b": 3}), ({"b": 6, "a": 1}), ({"a": 7, "b": 1}), ({"b": 4, "a": 6})]

    def run(b_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        runner = PagedRunner(model, num_blocks=24, tokens_per_block=4, seed=11)
        runner.add("a")
        runner.add("b")
        done = {"a": 0, "b": 0}
        outs: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
        seqs = {"a": a, "b": b_tokens}
        for step in plan:
            chunks = {rid: seqs[rid][done[rid] : done[rid] + n] for rid, n in step.items()}
            for rid, logits in runner.step(chunks).items():
                outs[rid].append(logits)
                done[rid] += len(chunks[rid])
        assert done == {"a": len(a), "b": len(b_tokens)}
        assert set(runner.tables["a"]).isdisjoint(runner.tables["b"])
        return torch.cat(outs["a"]), torch.cat(outs["b"])

    out_a, out_b = run(b)
    assert max_diff(out_a, full_logits(model, a)) < TOL
    assert max_diff(out_b, full_logits(model, b)) < TOL

    # Different tokens for b, same schedule: a's logits do not move.
    out_a2, out_b2 = run(b_other)
    assert max_diff(out_a2, out_a) < 1e-12
    assert max_diff(out_b2, full_logits(model, b_other)) < TOL


def _batched_schedule_matches_full(model: LlamaForCausalLM, schedule: list[dict[str, int]], lengths: dict[str, int]) -> None:
    """Run ``schedule`` (per step: request -> new tokens) on NaN-filled pools; every request's
    logits must equal the reference on its whole sequence (a stray read, even a masked one of
    another request's padding, would turn them into NaN)."""
    seqs = {rid: random_tokens(n, seed=i + 40) for i, (rid, n) in enumerate(lengths.items())}
    runner = PagedRunner(model, num_blocks=sum(-(-n // 4) for n in lengths.values()) + 2, tokens_per_block=4,
                         seed=9, fill=float("nan"))
    for rid in seqs:
        runner.add(rid)
    done = dict.fromkeys(seqs, 0)
    outs: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    for step in schedule:
        chunks = {rid: seqs[rid][done[rid] : done[rid] + n] for rid, n in step.items()}
        for rid, logits in runner.step(chunks).items():
            outs[rid].append(logits)
            done[rid] += len(chunks[rid])
    for rid, tokens in seqs.items():
        assert done[rid] == len(tokens), rid
        assert max_diff(torch.cat(outs[rid]), full_logits(model, tokens)) < TOL, rid


def test_batched_cpu_attention_over_mixed_lengths(model: LlamaForCausalLM) -> None:
    # Step 1: prefills of very different lengths (one group each where padding would be wasteful,
    # shared where not). Step 2: decodes of lengths 2 to 61 beside a chunk over a cached prefix
    # and an empty request: several decode groups, padded keys and queries in each.
    lengths = {"long": 62, "mid": 24, "short": 3, "tiny": 2, "chunked": 30, "idle": 5}
    schedule = [
        {"long": 60, "mid": 22, "short": 1, "tiny": 1, "chunked": 10, "idle": 5},
        {"tiny": 1, "long": 1, "chunked": 12, "short": 1, "mid": 1, "idle": 0},
        {"chunked": 8, "long": 1, "mid": 1, "short": 1},
    ]
    _batched_schedule_matches_full(model, schedule, lengths)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_any_batch_of_requests_matches_full(model: LlamaForCausalLM, data) -> None:
    """Several requests, each split into chunks at random, advanced together in random steps."""
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6), label="lengths")
    rids = [f"r{i}" for i in range(len(lengths))]
    remaining = dict(zip(rids, lengths))
    schedule = []
    while any(remaining.values()):
        step = {}
        for rid in data.draw(st.permutations(rids), label="order"):
            if remaining[rid] and not data.draw(st.booleans(), label=f"{rid} waits"):
                step[rid] = data.draw(st.integers(1, remaining[rid]), label=f"{rid} chunk")
                remaining[rid] -= step[rid]
        if step:
            schedule.append(step)
    note(f"lengths {dict(zip(rids, lengths))}, steps (request: new tokens) {schedule}")
    _batched_schedule_matches_full(model, schedule, dict(zip(rids, lengths)))


def test_decode_groups_bound_their_padding() -> None:
    from tensorrt_llm._torch.attention_backend.cpu_paged import build_cpu_plan

    # 60 decodes of ~100 positions and two of 4,000: padding every short one to 4,000 would read
    # 40x their keys; the plan keeps the long ones apart.
    k_lens = [100 + i for i in range(60)] + [4000, 3990]
    tables = [list(range(sum(-(-k // 32) for k in k_lens[:r]), sum(-(-k // 32) for k in k_lens[: r + 1]))) for r in range(62)]
    plan = build_cpu_plan([1] * 62, [k - 1 for k in k_lens], tables, tokens_per_block=32, num_blocks=10_000)
    padded = sum(g.num_seqs * g.k_len for g in plan.groups)
    assert padded <= 1.5 * sum(k_lens) + 4096 * len(plan.groups) and len(plan.groups) <= 3
    assert sorted(int(r) for g in plan.groups for r in (range(62)[g.out_rows] if isinstance(g.out_rows, slice) else g.out_rows)) == list(range(62))


def test_reused_prefix_blocks_give_full_logits(model: LlamaForCausalLM) -> None:
    prefix = random_tokens(12, seed=4)  # three full blocks of 4
    first = prefix + random_tokens(5, seed=5)
    second = prefix + random_tokens(9, seed=6)
    runner = PagedRunner(model, num_blocks=16, tokens_per_block=4, seed=2)
    run_chunked(runner, "first", first, [len(first)])

    runner.add("second", blocks=runner.tables["first"][:3], num_cached=len(prefix))
    paged = runner.step({"second": second[len(prefix) :]})["second"]
    assert runner.tables["second"][:3] == runner.tables["first"][:3]
    assert max_diff(paged, full_logits(model, second)[len(prefix) :]) < TOL


def test_partly_reused_block_copied_then_extended(model: LlamaForCausalLM) -> None:
    # Partial reuse: the KV manager copies the partly matching block and the request resumes
    # mid-block, overwriting the copy's tail; the source block must stay intact.
    shared = random_tokens(14, seed=7)  # 3 full blocks + 2 tokens of the 4th
    first = shared + random_tokens(6, seed=8)
    second = shared + random_tokens(7, seed=9)
    runner = PagedRunner(model, num_blocks=16, tokens_per_block=4, seed=3)
    run_chunked(runner, "first", first, [10, 10])
    copy = runner.free.pop()
    source = runner.tables["first"][3]
    for pool in runner.k_cache + runner.v_cache:
        pool[copy] = pool[source]
    runner.add("second", blocks=runner.tables["first"][:3] + [copy], num_cached=len(shared))
    paged = runner.step({"second": second[14:17], "first": []})["second"]
    paged = torch.cat([paged, runner.step({"second": second[17:]})["second"]])
    assert max_diff(paged, full_logits(model, second)[14:]) < TOL

    # "first" still decodes correctly from its untouched blocks.
    nxt = runner.step({"first": [3]})["first"]
    assert max_diff(nxt, full_logits(model, first + [3])[-1:]) < TOL


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_paged_decode_equals_greedy_full(dtype: str) -> None:
    model = LlamaForCausalLM(LlamaConfig(dtype=dtype, seed=2))
    prompt = random_tokens(9, seed=10)
    steps = 12

    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    expected = seq[len(prompt) :]

    runner = PagedRunner(model, num_blocks=16, tokens_per_block=4, seed=4)
    runner.add("r")
    logits = runner.step({"r": prompt})["r"]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(logits[-1].argmax()))
        logits = runner.step({"r": generated[-1:]})["r"]
    assert generated == expected


# --------------------------------------------------------------------------- cache discipline


def test_never_reads_slots_beyond_request_length(model: LlamaForCausalLM) -> None:
    # Every slot starts as NaN; a single stray read (even a masked one) would poison the output.
    tokens = random_tokens(10, seed=12)
    runner = PagedRunner(model, num_blocks=8, tokens_per_block=4, seed=6, fill=float("nan"))
    runner.add("r", blocks=[runner.free.pop() for _ in range(5)])  # spare blocks, never touched
    paged = torch.cat([runner.step({"r": tokens[:5]})["r"], runner.step({"r": tokens[5:]})["r"]])
    assert max_diff(paged, full_logits(model, tokens)) < TOL
    table = runner.tables["r"]
    written = torch.cat([runner.k_cache[0][b] for b in table[:3]]).reshape(12, -1)  # (12, kv*hd)
    assert not written[:10].isnan().any() and written[10:].isnan().all()
    assert all(runner.k_cache[0][b].isnan().all() for b in table[3:])


def test_forward_under_inference_mode(model: LlamaForCausalLM) -> None:
    tokens = random_tokens(7, seed=13)
    runner = PagedRunner(model, tokens_per_block=2)
    with torch.inference_mode():
        paged = run_chunked(runner, "r", tokens, [4, 3])
    assert max_diff(paged, full_logits(model, tokens)) < TOL


def test_forward_rejects_mismatched_inputs(model: LlamaForCausalLM) -> None:
    meta = AttentionMetadata([3], [0], [[0]], tokens_per_block=4)
    ids = torch.tensor([1, 2, 3])
    pos = torch.arange(3)
    shape = model.kv_cache_shape(2, 4)
    layers = model.config.num_layers
    good = [torch.zeros(shape, dtype=torch.float64) for _ in range(layers)]

    def fwd(ids=ids, pos=pos, meta=meta, k=good, v=good):
        return model(ids, pos, meta, k, v)

    fwd()  # the baseline is accepted
    with pytest.raises(ValueError, match="input_ids"):
        fwd(ids=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="position_ids"):
        fwd(pos=torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        fwd(k=[torch.zeros(shape, dtype=torch.float32) for _ in range(layers)])
    with pytest.raises(ValueError, match="shape"):
        fwd(v=[torch.zeros(model.kv_cache_shape(2, 8), dtype=torch.float64)] * layers)
    with pytest.raises(ValueError, match="one pool per layer"):
        fwd(k=good[:1])
    with pytest.raises(ValueError, match="hold 2 blocks"):
        fwd(meta=AttentionMetadata([3], [0], [[5]], tokens_per_block=4))
    with pytest.raises(ValueError, match="same KV slot"):
        fwd(ids=torch.tensor([1, 2, 3, 4]), pos=torch.tensor([0, 1, 0, 1]),
            meta=AttentionMetadata([2, 2], [0, 0], [[1], [1]], tokens_per_block=4))
    with pytest.raises(ValueError, match="input_ids"):
        fwd(ids=torch.tensor([1, 2, 512]))


def test_kv_cache_shape(model: LlamaForCausalLM) -> None:
    cfg = model.config
    assert model.kv_cache_shape(10, 16) == (10, 16, cfg.num_kv_heads, cfg.head_dim)


# --------------------------------------------------------------------------- float16 weights (CPU)


@pytest.mark.parametrize("biases", [False, True], ids=["no bias", "q/k/v and o biases"])
def test_float16_weights_multiply_by_the_float32_weights_rounded(biases: bool) -> None:
    # float16-weights keeps activations, norms, embedding and KV in float32 and rounds only the
    # linear layers' weights: it computes what float32 computes on weights rounded to float16
    # (q/k/v stacked into one call with their biases, gate/up into another).
    config = LlamaConfig(seed=5, dtype="float16-weights", qkv_bias=biases, o_bias=biases)
    assert config.torch_dtype == torch.float32 and config.packs_linear_weights
    packed = LlamaForCausalLM(config)
    rounded = LlamaForCausalLM(dataclasses.replace(config, dtype="float32"))
    assert not rounded.config.packs_linear_weights
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                param.copy_(param.half().float())
    tokens = torch.tensor(random_tokens(20, seed=14))
    # every linear layer runs fbgemm's float16 GEMM: q/k/v and gate/up stacked, the rest alone
    layers = packed.config.num_layers
    assert packed.linear_formats.formats == (("float16 (fbgemm)", 7 * layers + 1, 2 * sum(
        m.weight.numel() for m in packed.modules() if isinstance(m, Linear))),)
    assert max_diff(packed.forward_full(tokens), rounded.forward_full(tokens)) < 1e-4
    # The paged path runs the same packed layers.
    paged = run_chunked(PagedRunner(packed, tokens_per_block=4), "r", tokens.tolist(), [9, 1, 10])
    assert max_diff(paged, packed.forward_full(tokens)) < 1e-4


def test_float16_packing_needs_float32_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="float32 weight on the CPU"):
        Linear(8, 8, dtype=torch.float64).pack_float16()
