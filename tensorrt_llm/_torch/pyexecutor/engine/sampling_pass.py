"""The device sampling pass: every sampling row of a step, sampled in one batched pass on the
engine's device (the CPU's too), without a host sync, inside a decode CUDA graph when one runs.

One row's path, in vLLM's order (the float64 host sampler, ``sampling.sampler.TorchSampler``,
documents the same semantics and is the reference the tests hold this pass to)::

    raw logits (n, vocab), float32 (float64 for a float64 model)
      1. penalties: repetition (prompt and output ids), frequency and presence (output ids)   } process_logits:
      2. min_tokens: the end ids a row may not draw yet go to -inf                           } only rows that
      3. the grammar's bitmask: forbidden ids go to -inf                                     } have them
    greedy row: the argmax of that row (of the raw row when nothing above applies: bit for bit
                the engine's greedy pick)
    drawing row:
      4. temperature: s = (l - max l) / T           (the largest logit first: finite for any T)
      5. top-k: s < the k-th largest s -> -inf     (ties with it stay)
         w = exp(s)                                (the likeliest token has w = 1)
      6. min-p: w < min_p -> 0                     (w is the ratio to the likeliest token)
      7. top-p: the smallest prefix of w, sorted, whose mass reaches top_p of what is left
               (every token tied with its last one stays)
      8. draw: an exponential race over blocks of BLOCK ids (block b wins with probability
               mass_b / total), then over the ids of the winning block (id j with w_j / mass_b):
               argmax(mass / E) with E ~ Exp(1) from the counter-based noise keyed by
               (seed, output position, block or id) (``sampling_columns.row_keys``, :func:`mix32`)
    logprobs (rows that ask): the log-softmax of the raw row -- the chosen id's and the top ones

Two levels of race keep the noise to ``vocab / BLOCK + BLOCK`` hashes a row instead of one per id,
and the whole pass to a few passes over the logits: a plain drawing step reads them about five
times (convert, max, scale, exp, block sums). Everything is shaped by the step's
:class:`~.sampling_columns.PassPlan` only (no ``.item()``, no data-dependent shape on a device), so
a CUDA graph captures it, and a row's answer depends on its own logits and columns alone: the
same seed draws the same tokens whatever shares the batch.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from tensorrt_llm._torch.pyexecutor.engine.sampling_columns import MASK32, PassPlan, SamplingColumns, mix32

__all__ = ["BLOCK", "DeviceColumns", "PassResult", "device_columns", "process_logits", "sample_rows", "working_dtype"]

#: Ids per block of the first race (the vocabulary is padded with zero weights to a multiple).
BLOCK = 256
_TWO_TO_MINUS_32 = 2.0**-32
ToDevice = Callable[[np.ndarray], torch.Tensor]


class DeviceColumns(NamedTuple):
    """:class:`~.sampling_columns.SamplingColumns` on the device, one entry per row."""

    greedy: torch.Tensor  # (n,) bool
    temperature: torch.Tensor  # (n,) working dtype
    top_p: torch.Tensor  # (n,)
    min_p: torch.Tensor  # (n,)
    top_k: torch.Tensor  # (n,) int64, 0: off
    block_keys: torch.Tensor  # (n,) int64 in [0, 2**32)
    token_keys: torch.Tensor  # (n,) int64 in [0, 2**32)
    top_p_rows: torch.Tensor  # (P,) int64


class PassResult(NamedTuple):
    """Per row: the token, and (``logprobs`` >= 0 in the plan) its log-probability under the raw
    row's log-softmax with the ``top`` likeliest ids and theirs (every row computes them; the
    host keeps what each request asked for)."""

    tokens: torch.Tensor  # (n,) int64
    logprob: torch.Tensor | None = None  # (n,)
    top_ids: torch.Tensor | None = None  # (n, top)
    top_logprobs: torch.Tensor | None = None  # (n, top)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for a float64 model (whose greedy rows then stay exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def device_columns(floats: torch.Tensor, longs: torch.Tensor, top_p_rows: torch.Tensor, dtype: torch.dtype) -> DeviceColumns:
    """The columns from their device copies (``floats`` (3, n) float64, ``longs`` (5, n) int64, laid
    out as ``SamplingColumns``); views and a cast, so a graph may capture it over static buffers."""
    floats = floats.to(dtype)
    return DeviceColumns(longs[0] != 0, floats[0], floats[1], floats[2], longs[1], longs[2], longs[3], top_p_rows)


# ---- 1-3: what changes the logits ----------------------------------------------------------


def process_logits(logits: torch.Tensor, columns: SamplingColumns, to_device: ToDevice,
                   input_ids: torch.Tensor | None = None) -> None:
    """Apply penalties, ``min_tokens`` and grammar masks in place to ``logits`` ``(n, vocab)`` (the
    working dtype), on the rows ``columns`` names. ``input_ids``: the forward's flat input ids on
    the device, where a penalized row's in-flight token is read (``PenaltyColumns.in_flight``).
    Sync-free; its shapes follow the step's columns, so it runs eagerly (before a graph's pass)."""
    vocab = logits.shape[1]
    penalties = columns.penalties
    if penalties is not None:
        # Sparse: every (row, id) a penalty touches is gathered, changed and written back; the
        # arithmetic is the host reference's, element for element (logits_processors.apply_penalties),
        # and an id listed twice is written twice with the same value.
        rows = to_device(penalties.rows)  # (P,) logit rows
        values = to_device(penalties.values).to(logits.dtype)  # (3, P): repetition, frequency, presence
        index, ids = (to_device(a) for a in penalties.output)  # (row in P, id) per generated token
        flight, slots = penalties.in_flight
        if len(slots):  # the ids a forward in flight was still sampling, as this forward's inputs hold them
            index = torch.cat((index, to_device(flight)))
            ids = torch.cat((ids, input_ids.index_select(0, to_device(slots))))
        if (penalties.values[0] != 1.0).any():  # repetition: every id of the prompt or the output, once
            seen_index, seen_ids = (torch.cat((a, to_device(b))) for a, b in zip((index, ids), penalties.prompt))
            at = (rows.index_select(0, seen_index), seen_ids)
            seen = logits[at]
            repetition = values[0].index_select(0, seen_index)
            logits.index_put_(at, torch.where(seen > 0, seen / repetition, seen * repetition))
        if (penalties.values[1:] != 0.0).any():  # frequency and presence: every id of the output
            counts = logits.new_zeros((len(penalties.rows), vocab))  # (P, vocab), touched where the ids are
            counts.index_put_((index, ids), counts.new_ones(()), accumulate=True)
            count = counts[index, ids]
            at = (rows.index_select(0, index), ids)
            logits.index_put_(at, logits[at] - (count * values[1].index_select(0, index)
                                                 + (count > 0).to(count.dtype) * values[2].index_select(0, index)))
    if columns.forbidden is not None:
        rows, ids = columns.forbidden
        logits.index_put_((to_device(rows), to_device(ids)), logits.new_full((), float("-inf")))
    if columns.masks is not None:
        rows, words = columns.masks
        rows = to_device(rows)
        allowed = unpack_bitmask(to_device(words), vocab)  # (G, vocab) bool
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(G, W)`` int32 words -> ``(G, vocab)`` bool: bit ``i`` of word ``w`` allows id ``32 w + i``."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (G, W, 32): an arithmetic shift keeps bit 31 at & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


# ---- 4-8: the pass ---------------------------------------------------------------------------


def sample_rows(logits: torch.Tensor, columns: DeviceColumns, plan: PassPlan, *, processed: torch.Tensor | None = None,
                block: int = BLOCK) -> PassResult:
    """The token of every row of ``logits`` ``(n, vocab)`` (raw, any float dtype), and its
    log-probabilities when ``plan.logprobs >= 0``. ``processed``: the rows after
    :func:`process_logits` (the working dtype), when the plan says some row has processing."""
    vocab = logits.shape[1]
    dtype = working_dtype(logits.dtype)
    raw = logits.to(dtype)  # the same tensor when it is already in the working dtype
    rows = processed if processed is not None else raw
    tokens = rows.argmax(dim=-1) if plan.greedy else None  # (n,)
    if plan.sample:
        drawn = _draw(rows, columns, plan, block)
        tokens = drawn if tokens is None else torch.where(columns.greedy, tokens, drawn)
    if plan.logprobs < 0:
        return PassResult(tokens)
    normaliser = _log_normaliser(raw)  # (n, 1)
    logprob = raw.gather(1, tokens[:, None]).sub_(normaliser).squeeze(1)
    if plan.logprobs == 0:
        return PassResult(tokens, logprob)
    values, ids = raw.topk(min(plan.logprobs, vocab), dim=-1)  # (n, top), likeliest first
    return PassResult(tokens, logprob, ids, values.sub_(normaliser))


def _log_normaliser(raw: torch.Tensor) -> torch.Tensor:
    """``(n, 1)``: each row's logsumexp. On the CPU one row at a time: the order a CPU reduction
    sums in depends on the tensor's shape (a lone row is split across threads, several are not),
    so a request's log-probabilities would change in their last bits with its batch mates; a row
    alone is always the same shape. On a GPU (and in its graphs) the rows go together."""
    if raw.is_cuda or raw.shape[0] <= 1:
        return raw.logsumexp(dim=-1, keepdim=True)
    return torch.cat([raw[i : i + 1].logsumexp(dim=-1, keepdim=True) for i in range(raw.shape[0])])


def _draw(rows: torch.Tensor, columns: DeviceColumns, plan: PassPlan, block: int) -> torch.Tensor:
    """Steps 4-8 for every row (a greedy row's answer is discarded by the caller)."""
    n, vocab = rows.shape
    width = -(-vocab // block) * block
    weights = rows.new_empty((n, width))  # (n, width): the tail past vocab is zero weight
    scaled = weights[:, :vocab]
    torch.sub(rows, rows.amax(dim=-1, keepdim=True), out=scaled)
    scaled.div_(columns.temperature[:, None])
    kept = None
    if plan.top_k:
        kth = scaled.topk(plan.top_k, dim=-1).values  # (n, cap), largest first
        index = (columns.top_k.clamp(1, plan.top_k) - 1)[:, None]
        threshold = kth.gather(1, index).masked_fill_((columns.top_k == 0)[:, None], float("-inf"))
        kept = scaled >= threshold  # (n, vocab); ties with the k-th stay
    scaled.exp_()  # the weights: 1 for the likeliest id
    # Filters multiply by their mask: on the CPU that is several times cheaper than masked_fill.
    if kept is not None:
        scaled.mul_(kept)
    if width > vocab:
        weights[:, vocab:].zero_()
    if plan.min_p:
        scaled.mul_(scaled >= columns.min_p[:, None])
    if plan.top_p_rows:
        _top_p_(scaled, None if plan.top_p_all else columns.top_p_rows, columns.top_p,
                plan.top_k if plan.top_p_within_top_k else None)
    return race(weights.view(n, width // block, block), columns.block_keys, columns.token_keys).clamp_(max=vocab - 1)


def _top_p_(weights: torch.Tensor, rows: torch.Tensor | None, top_p: torch.Tensor, candidates: int | None) -> None:
    """Zero, on ``rows`` of ``weights`` ``(n, vocab)`` (None: every row), every weight below the
    nucleus: the smallest prefix of the sorted weights whose mass reaches ``top_p`` of the row's total."""
    if rows is None:
        weights.mul_(weights >= nucleus_floor(weights, top_p, candidates))
        return
    picked = weights.index_select(0, rows)  # (P, vocab)
    floor = nucleus_floor(picked, top_p.index_select(0, rows), candidates)
    weights.index_copy_(0, rows, picked.mul_(picked >= floor))


def nucleus_floor(weights: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
    """``(P, 1)``: per row, the smallest weight the top-p filter keeps. A sorted id is dropped
    when the mass before it reaches ``top_p`` of the total (so the likeliest always stays).

    ``candidates``: every row holds at most that many non-zero weights but for ties with its
    smallest one (a top-k ran before): its largest ``candidates`` are sorted, and the rest, if
    any, tie with the last of them, which the floor then keeps. Otherwise, on a GPU the whole row
    is sorted (a graph cannot branch on the data); on the CPU the
    largest 64 are tried first, then eight times as many, until every row's kept prefix lies
    inside them (a peaked distribution stops at once; a flat one ends at a full sort, numpy's:
    torch's CPU sort is several times slower). Both take the total as one sum of the row and the
    prefix masses as a cumulative sum of the same sorted values, so they decide alike."""
    total = weights.sum(dim=-1, keepdim=True)  # (P, 1)
    target = top_p[:, None] * total
    vocab = weights.shape[1]
    if candidates is not None and candidates < vocab:
        ranked = weights.topk(candidates, dim=-1).values
        mass = ranked.cumsum(dim=-1)  # (P, candidates)
    elif weights.is_cuda:
        ranked = weights.sort(dim=-1, descending=True).values
    else:
        count = 64
        while count < vocab:
            ranked = weights.topk(count, dim=-1).values
            mass = ranked.cumsum(dim=-1)  # (P, count)
            if bool((mass[:, -1:] >= target).all()):  # every row's nucleus is inside
                break
            count *= 8
        else:
            ranked = torch.from_numpy(np.ascontiguousarray(np.sort(weights.numpy(), axis=-1)[:, ::-1]))
    if ranked.shape[1] == vocab:
        mass = ranked.cumsum(dim=-1)  # (P, vocab)
    kept = ((mass - ranked) < target).sum(dim=-1, keepdim=True)  # >= 1
    return ranked.gather(1, kept - 1)


def race(weights: torch.Tensor, block_keys: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """``(n,)`` ids drawn from ``weights`` ``(n, blocks, block)`` (non-negative, not normalised):
    a block by the exponential race over the block masses, then an id of that block by the race
    over its weights. Id ``b * block + j`` wins with probability ``w / total``."""
    n, num_blocks, block = weights.shape
    mass = weights.sum(dim=-1)  # (n, blocks)
    index = torch.arange(num_blocks, device=weights.device)
    chosen = (mass.double() / exponentials(block_keys, index)).argmax(dim=-1)  # (n,)
    inner = weights.gather(1, chosen.view(n, 1, 1).expand(n, 1, block)).view(n, block)
    ids = (chosen * block)[:, None] + torch.arange(block, device=weights.device)  # (n, block)
    return ids.gather(1, (inner.double() / exponentials(token_keys, ids)).argmax(dim=-1, keepdim=True)).squeeze(1)


def exponentials(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``(n, m)`` float64 Exp(1) draws, one per (row key, index): ``-log(1 - v)`` of the uniform
    ``v = (mix32(key ^ index) + 1/2) / 2**32`` (fine where it matters: near 0, the winners)."""
    hashed = mix32((keys[:, None] ^ index) & MASK32)  # (n, m) int64 in [0, 2**32)
    uniform = hashed.double().add_(0.5).mul_(_TWO_TO_MINUS_32)
    return torch.log1p(uniform.neg_()).neg_()
