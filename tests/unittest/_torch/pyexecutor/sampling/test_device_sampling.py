"""The device sampling pass (``engine.sampling_pass``) against the float64 host sampler, row by row.

- **Distributions.** Every filter (temperature, top-k, top-p, min-p) and their combinations, on a
  small vocabulary with known logits: thousands of rows of the same logits at different output
  positions are one batch of independent draws; their histogram is held to the reference's
  probabilities (``TorchSampler._filtered_probs``, float64) by a chi-square test, and never
  holds an id the reference gives probability 0. Small blocks (the race's first level) and the
  default 256 with a padded tail both run.
- **Processing.** Penalties, ``min_tokens`` and a grammar bitmask give the reference's rows
  (``logits_processors`` in float64), and a draw after them follows the reference's distribution.
- **Greedy rows** are the argmax of their raw row, bit for bit, in any batch.
- **Seeds.** A row's token depends on its logits, seed and output position alone: the same in any
  batch, at any place in it. The noise is one integer hash in Python, numpy and torch.
- **Log-probabilities** are the raw row's log-softmax (what the host sampler reported).
- **A decode graph's layout** (columns over the graph's rows, top-p rows padded) gives the eager
  answer (the graph replays these ops over those buffers).

Deterministic: the noise is keyed by literal seeds, so each statistic is the same on every run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import (
    MASK32,
    PassPlan,
    mix32,
    row_keys,
    sampling_columns,
)
from tensorrt_llm._torch.pyexecutor.engine.sampling_pass import (
    device_columns,
    exponentials,
    nucleus_floor,
    process_logits,
    sample_rows,
)
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import device_pick
from tensorrt_llm._torch.pyexecutor.engine.cuda_graph_runner import sampling_inputs_of
from tensorrt_llm._torch.pyexecutor.sampling.logits_processors import (
    apply_penalties,
    forbid_end_before_min_tokens,
    token_logprob,
)
from tensorrt_llm._torch.pyexecutor.sampling.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.sampling_config import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAWS = 12_000
SIGNIFICANCE = 1e-4  # deterministic statistics: a failure is a wrong distribution, not bad luck


def known_logits(vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def request_at(prompt, config: SamplingConfig, generated=(), **kwargs):
    request = make_request(list(prompt), sampling_config=config, max_new_tokens=64, **kwargs)
    for token in generated:
        request.add_new_token(token)
    return request


def draws(row: torch.Tensor, config: SamplingConfig, count: int = DRAWS, *, block: int, seed: int = 7) -> torch.Tensor:
    """``count`` tokens drawn from ``row`` (float32 on the device, as a float32 model's logits),
    one per output position 0..count-1, in one batch."""
    vocab = row.numel()
    base = request_at([1, 2, 3], config)
    columns = sampling_columns([base], vocab)
    assert columns is not None and columns.plan.sample
    floats = np.repeat(columns.floats, count, axis=1)
    longs = np.repeat(columns.longs, count, axis=1)
    keys = np.array([row_keys(seed, position) for position in range(count)], dtype=np.int64)
    longs[2], longs[3] = keys[:, 0], keys[:, 1]
    top_p_rows = np.arange(count, dtype=np.int64) if columns.plan.top_p_rows else np.empty(0, dtype=np.int64)
    plan = columns.plan._replace(top_p_rows=len(top_p_rows))
    logits = row.float().expand(count, vocab).contiguous()
    params = device_columns(torch.from_numpy(floats), torch.from_numpy(longs), torch.from_numpy(top_p_rows), torch.float32)
    return sample_rows(logits, params, plan, block=block).tokens


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    statistic = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=1.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=0.8, top_p=0.7),
    SamplingConfig(temperature=1.2, min_p=0.08),
    SamplingConfig(temperature=0.9, top_k=9, top_p=0.85),
    SamplingConfig(temperature=1.1, top_k=12, min_p=0.03, top_p=0.9),
    SamplingConfig(temperature=1.0, min_p=0.05, top_p=0.6),
]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("vocab, block", [(40, 8), (300, 256)])  # 5 blocks; 2 blocks, the second padded
def test_each_filter_and_combination_draws_the_reference_distribution(config, vocab, block):
    row = known_logits(vocab, seed=vocab)
    reference = TorchSampler._filtered_probs(row.float().double(), config)  # what a float32 model's row gives
    counts = torch.bincount(draws(row, config, block=block), minlength=vocab).double()
    assert counts[reference == 0].sum() == 0, "a token the filters drop was drawn"
    assert chi_square_p(counts, reference) > SIGNIFICANCE


def test_the_block_race_alone_draws_in_proportion_to_block_mass():
    # one block holds almost all the mass: the first level must pick it in that proportion
    row = torch.full((64,), -4.0, dtype=torch.float64)
    row[40:48] = 1.0
    reference = TorchSampler._filtered_probs(row, SamplingConfig(temperature=1.0))
    counts = torch.bincount(draws(row, SamplingConfig(temperature=1.0), block=8), minlength=64).double()
    assert chi_square_p(counts, reference) > SIGNIFICANCE


# ---- processing: penalties, min_tokens, a grammar mask ------------------------------------------


def test_penalties_min_tokens_and_a_mask_give_the_reference_rows_and_distribution():
    vocab = 48
    row = known_logits(vocab, seed=3)
    config = SamplingConfig(temperature=1.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.4,
                            min_tokens=5)
    request = request_at([4, 4, 9, 30], config, generated=[12, 9, 12, 40], end_id=7, stop_token_ids=(11,),
                         guided_grammar=object())  # guided: the sampler hands the engine its mask
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[[1, 2, 3, 20, 12]] = False  # a grammar's answer: these ids cannot come next
    words = _pack(allowed)
    columns = sampling_columns([request], vocab, token_masks={request.request_id: words})
    assert columns.plan.processed and columns.forbidden is not None and columns.masks is not None

    reference = row.clone()
    apply_penalties(reference, config, request)
    forbid_end_before_min_tokens(reference, config, request)
    reference.masked_fill_(~allowed, float("-inf"))

    processed = row.clone()[None]  # float64: the arithmetic is the reference's, operation for operation
    process_logits(processed, columns, torch.from_numpy)
    assert torch.equal(processed[0], reference)

    probs = TorchSampler._filtered_probs(reference, config)
    counts = torch.bincount(draws(reference, config, block=16), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0 and chi_square_p(counts, probs) > SIGNIFICANCE


def test_a_penalized_row_counts_its_in_flight_token_from_its_input_slot():
    vocab = 16
    config = SamplingConfig(frequency_penalty=1.0)  # greedy: the penalty alone decides
    request = request_at([1], config, generated=[5])
    request.tokens.append(-1)  # the placeholder of a token still being sampled (overlap)
    columns = sampling_columns([request], vocab, in_flight=lambda: {0: 3})
    row = torch.zeros((1, vocab), dtype=torch.float64)
    row[0, 5], row[0, 9] = 2.0, 1.5
    input_ids = torch.tensor([0, 0, 0, 9])  # slot 3 carries the in-flight token: 9
    process_logits(row, columns, torch.from_numpy, input_ids)
    assert row[0, 5] == 1.0 and row[0, 9] == 0.5  # 5 counted from the host, 9 from the slot


def _pack(allowed: torch.Tensor) -> np.ndarray:
    """A bool row as llguidance's bitmask: bit i of word w allows id 32 w + i."""
    bits = np.zeros(-(-len(allowed) // 32) * 32, dtype=np.uint64)
    bits[: len(allowed)] = allowed.numpy()
    return (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32).view(np.int32)


# ---- greedy rows, seeds, the noise --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_rows_are_the_argmax_of_their_raw_row_bit_for_bit(dtype):
    vocab = 700
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits[2, [10, 500]] = logits[2].max() + 1  # a tie: the first index, as argmax
    configs = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(logprobs=2),
               SamplingConfig(temperature=0.7, top_p=0.8), SamplingConfig(), SamplingConfig(top_k=1, temperature=1.0)]
    requests = [request_at([1, 2], config) for config in configs]
    columns = sampling_columns(requests, vocab)
    tokens, _ = device_pick(logits, columns, torch.from_numpy, None)
    greedy = [0, 2, 4, 5]
    assert tokens[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
    assert int(tokens[2]) == 10


def test_a_seed_draws_the_same_tokens_in_any_batch():
    vocab = 512
    row = known_logits(vocab, seed=11, scale=1.0).float()
    config = SamplingConfig(temperature=1.0, top_p=0.95, seed=2024)

    def tokens_of(mates: int, place: int) -> list[int]:
        generator = torch.Generator().manual_seed(mates)
        out = []
        for position in range(6):
            requests = [request_at([3, 1], SamplingConfig(temperature=float(1 + i % 3), top_k=7 * i, seed=i))
                        for i in range(mates)]
            target = request_at([3, 1], config, generated=[0] * position)
            requests.insert(place, target)
            logits = torch.randn(len(requests), vocab, generator=generator) * 3
            logits[place] = row
            columns = sampling_columns(requests, vocab)
            out.append(int(device_pick(logits, columns, torch.from_numpy, None)[0][place]))
        return out

    alone = tokens_of(0, 0)
    assert len(set(alone)) > 1  # it draws: a constant would make the comparison empty
    assert tokens_of(3, 1) == alone and tokens_of(17, 17) == alone and tokens_of(8, 0) == alone


def test_the_noise_hash_is_one_function_in_python_numpy_and_torch():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B9, 123456789]
    python = [mix32(v) for v in values]
    assert python == mix32(np.array(values, dtype=np.int64)).tolist() == mix32(torch.tensor(values)).tolist()
    assert python[:3] == [0, 2261973619, 1289417537]  # pinned: the noise may not change silently
    assert all(0 <= h <= MASK32 for h in python)
    # every product in the hash is below 2**63: 32-bit values times multipliers below 2**31
    assert max(values) * 0x735A2D97 < 2**63
    assert row_keys(2**64 - 1, 2**31) == row_keys(2**64 - 1, 2**31)
    assert row_keys(5, 0) != row_keys(5, 1) != row_keys(6, 0)
    e = exponentials(torch.tensor([row_keys(1, 0)[1]]), torch.arange(50_000))
    assert abs(float(e.mean()) - 1.0) < 0.02 and float(e.min()) > 0  # Exp(1), never 0


def test_logprobs_are_the_raw_rows_log_softmax():
    vocab = 96
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    configs = [SamplingConfig(temperature=0.7, logprobs=3, repetition_penalty=2.0),
               SamplingConfig(logprobs=0), SamplingConfig(temperature=1.0)]
    requests = [request_at([1, 2, 3], config) for config in configs]
    columns = sampling_columns(requests, vocab)
    tokens, result = device_pick(logits, columns, torch.from_numpy, None)
    for i in (0, 1):
        expected = token_logprob(logits[i], int(tokens[i]), configs[i].logprobs)
        assert float(result.logprob[i]) == pytest.approx(expected.logprob, abs=1e-12)
        count = configs[i].logprobs
        assert result.top_ids[i, :count].tolist() == [t for t, _ in expected.top]
        assert result.top_logprobs[i, :count].tolist() == pytest.approx([v for _, v in expected.top], abs=1e-12)


# ---- the CPU's nucleus search, and the decode graph's layout ------------------------------------


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])  # flat (the nucleus is most of the row) to peaked
def test_the_nucleus_floor_is_the_full_sorts_answer(scale):
    weights = torch.exp(torch.randn(5, 5000, generator=torch.Generator().manual_seed(2)) * scale)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.99, 1.0 - 1e-6])
    floor = nucleus_floor(weights, top_p)
    ranked = weights.sort(dim=-1, descending=True).values
    total = weights.sum(dim=-1, keepdim=True)
    kept = ((ranked.cumsum(dim=-1) - ranked) < top_p[:, None] * total).sum(dim=-1, keepdim=True)
    assert torch.equal(floor, ranked.gather(1, kept - 1))
    # after a top-k (here: 30 non-zero weights, then 6 more tied with the 30th), its largest suffice
    weights = weights.sort(dim=-1, descending=True).values.flip(-1)  # any order: here the largest last
    weights[:, :-30] = 0.0
    weights[:, -36:-30] = weights[:, -30:-29]  # six more tied with the smallest kept
    full = nucleus_floor(weights, top_p)
    assert torch.equal(nucleus_floor(weights, top_p, candidates=32), full)
    assert torch.equal(nucleus_floor(weights, top_p, candidates=64), full)


def test_a_decode_graphs_layout_gives_the_eager_answer():
    vocab, size = 300, 8
    generator = torch.Generator().manual_seed(9)
    configs = [SamplingConfig(temperature=1.0, top_p=0.8, seed=1, logprobs=2), SamplingConfig(),
               SamplingConfig(temperature=0.6, top_k=30, seed=2, presence_penalty=0.5),
               SamplingConfig(temperature=1.3, min_p=0.1, top_p=0.7, seed=3)]
    requests = [request_at([1, 2], config, generated=[4, 4]) for config in configs]
    flat = torch.randn(size, vocab, generator=generator) * 3  # the graph's rows: 4 requests, a draft row, padding
    rows = [0, 1, 3, 6]  # where each request's sampling row sits among them
    columns = sampling_columns(requests, vocab)
    eager_tokens, eager = device_pick(flat[rows], columns, torch.from_numpy, None)

    laid = columns.at_rows(rows, size)
    plan = laid.plan.bucketed(vocab, size)
    assert laid.plan._replace(top_p_rows=7).bucketed(vocab, size).top_p_rows == size  # never past the graph's rows
    floats, longs, top_p_rows = sampling_inputs_of(laid, plan)
    assert len(top_p_rows) == plan.top_p_rows == 2
    processed = flat.clone()
    process_logits(processed, laid, torch.from_numpy)
    graph = sample_rows(flat, device_columns(torch.from_numpy(floats), torch.from_numpy(longs),
                                             torch.from_numpy(top_p_rows), torch.float32), plan, processed=processed)
    assert graph.tokens[rows].tolist() == eager_tokens.tolist()
    assert graph.tokens[[2, 4, 5, 7]].tolist() == flat[[2, 4, 5, 7]].argmax(dim=-1).tolist()  # greedy elsewhere
    assert torch.equal(graph.logprob[rows], eager.logprob)
    assert torch.equal(graph.top_ids[rows, :2], eager.top_ids[:, :2])


def test_rows_without_anything_special_need_no_pass_and_extreme_settings_stay_finite():
    assert sampling_columns([request_at([1], SamplingConfig()), request_at([1], SamplingConfig(top_k=1))], 64) is None
    vocab = 128
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 30 + 1e4
    logits[2] = float("nan")  # a broken row draws an id inside the vocabulary (its request fails on the host)
    configs = [SamplingConfig(temperature=1e-5, top_p=0.5), SamplingConfig(temperature=1e6, min_p=1.0),
               SamplingConfig(temperature=1.0)]
    columns = sampling_columns([request_at([1], config) for config in configs], vocab)
    tokens, _ = device_pick(logits, columns, torch.from_numpy, None)
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[1]) == int(logits[1].argmax())
    assert 0 <= int(tokens[2]) < vocab


def test_the_columns_hold_what_each_row_asks_for():
    config = SamplingConfig(temperature=0.5, top_k=40, top_p=0.9, min_p=0.02, seed=2**64 - 1, logprobs=4)
    request = request_at([1, 2, 3], config, generated=[7, 8])
    columns = sampling_columns([request_at([1], SamplingConfig()), request], 100)
    assert columns.floats[:, 1].tolist() == [0.5, 0.9, 0.02] and columns.floats[:, 0].tolist() == [1.0, 1.0, 0.0]
    assert columns.longs[:, 1].tolist() == [0, 40, *row_keys(2**64 - 1, 2), 4]
    assert columns.longs[:, 0].tolist() == [1, 0, 0, 0, -1]
    assert columns.top_p_rows.tolist() == [1]
    assert columns.plan == PassPlan(sample=True, greedy=True, top_k=40, top_p_rows=1, min_p=True, logprobs=4,
                                    processed=False, top_p_within_top_k=True, top_p_all=False)
    unseeded = request_at([1], SamplingConfig(temperature=1.0))  # seeded by its request id
    assert sampling_columns([unseeded], 100).longs[2:4, 0].tolist() == list(row_keys(unseeded.request_id, 0))


def test_a_rows_logprobs_are_the_same_bits_alone_and_in_a_batch():
    """On the CPU a reduction's order depends on the tensor's shape (a lone row is split across
    threads): each row's normaliser is taken alone, so a request reports the same numbers in any batch."""
    vocab = 49152
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(8)) * 3  # batched, these differ
    requests = [request_at([1, 2], SamplingConfig(logprobs=2)) for _ in range(16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, batch = device_pick(logits, sampling_columns(requests, vocab), torch.from_numpy, None)
        alone = [device_pick(logits[i : i + 1], sampling_columns(requests[i : i + 1], vocab), torch.from_numpy, None)[1]
                 for i in range(16)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch.logprob, torch.cat([a.logprob for a in alone]))
    assert torch.equal(batch.top_logprobs, torch.cat([a.top_logprobs for a in alone]))
