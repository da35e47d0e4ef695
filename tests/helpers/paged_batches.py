"""Random mixed batches over a paged pool, and the error measure the attention tests compare with.

Used by the CUDA attention tests (``test_cuda``, ``test_fp8_cuda``), which hold their kernels to a
float64 reference on the CPU over the same blocks.
"""

from __future__ import annotations

import random

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in float64; fails on a NaN (a row the kernel never wrote)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "an output row was never written"
    return float((out - ref).norm() / ref.norm())


def random_paged_batch(rng: random.Random, num_blocks: int, tpb: int, max_ctx: int, *, sizes: tuple[int, int],
                       decode_share: float, shuffle: bool) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``randrange(*sizes)`` requests, each ``(cached, new)``: a decode (``decode_share`` of them), a
    fresh prefill or a chunk over a cached prefix, in the order drawn or ``shuffle``d; and their block
    tables, distinct blocks of ``num_blocks`` in random order, ``tpb`` tokens a block. The draws from
    ``rng`` depend only on the arguments: a seed gives the same batch on every machine."""
    requests = []
    for _ in range(rng.randrange(*sizes)):
        kind = rng.random()
        if kind < decode_share:
            requests.append((rng.randrange(0, max_ctx), 1))  # decode
        elif kind < 0.7:
            requests.append((0, rng.randrange(2, 300)))  # fresh prefill
        else:
            requests.append((rng.randrange(1, max_ctx), rng.randrange(2, 200)))  # chunk over a prefix
    if shuffle:
        rng.shuffle(requests)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // tpb))] for c, n in requests]
    return requests, tables
