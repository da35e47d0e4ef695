"""Tensor collectives the sharded model calls inside its forward: sum and gather over the TP group.

They live beside the layers that call them (``linear``), below ``distributed/``: the
executor's rank machinery sets the group up, the model only uses it, so nothing here
imports upward. The group is the default process group (``world_size == tp_size``, see :class:`Mapping`),
set up by :class:`~tensorrt_llm._torch.distributed.communicator.Communicator`. Every rank
must call these in the same order with the same shapes; the executor guarantees that by
running the same batch on every rank (checked by the decision digest when enabled).

Both results are bitwise identical on every rank: gloo's ring all-reduce reduces each
chunk once and then copies it around the ring, and a gather only concatenates. So the
ranks' residual streams, logits and sampled tokens agree exactly, not just closely.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    dist.all_reduce(x)
    return x


def allgather(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate along the last dim each rank's ``x`` (rank r holds ``sizes[r]`` columns).

    Ranks may hold different widths (a vocabulary that does not divide evenly): each pads to
    the widest, and the padding is dropped after the gather.
    """
    width = max(sizes)
    local = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(local) for _ in sizes]
    dist.all_gather(parts, local.contiguous())
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)
