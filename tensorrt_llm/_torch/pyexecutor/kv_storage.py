"""Real K/V tensors in a paged layout, on the model's device, with a host tier for offloading.

Per layer, K and V are each one pool ``(num_blocks, tokens_per_block, num_kv_heads, head_dim)``;
a block id indexes dim 0 of every layer's pools. All pools are views of ONE tensor::

    pools: (2, num_layers, num_blocks + num_scratch_blocks, tokens_per_block, num_kv_heads, head_dim)
            K/V

so that moving a block (copy, offload, onboard) is one copy across every layer instead of one per
layer and pool. The host tier holds each block in one piece::

    host: (num_host_blocks, 2, num_layers, tokens_per_block, num_kv_heads, head_dim)

on the CPU, pinned when the pools are on CUDA: there an offload or onboard is one asynchronous
DMA ordered on the device's stream with the forwards around it, and the host never waits for it
(the host never reads the tier itself; a later onboard from the same host block is ordered after
the offload into it).

Scratch blocks follow the ``num_blocks`` blocks the KV manager hands out: never allocated to a
request, they absorb the writes of the padding rows of a CUDA-graph batch.
"""

from __future__ import annotations

import torch


class KVCacheStorage:
    """Tensor storage behind a :class:`BlockPool` (which decides what moves where)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        num_host_blocks: int,
        block_shape: tuple[int, int, int],  # (tokens_per_block, num_kv_heads, head_dim)
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_scratch_blocks: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.num_scratch_blocks = num_scratch_blocks
        rows = num_blocks + num_scratch_blocks
        self.pools = torch.zeros((2, num_layers, rows, *block_shape), dtype=dtype, device=self.device)
        pin = self.device.type == "cuda" and num_host_blocks > 0
        self.host = torch.zeros((num_host_blocks, 2, num_layers, *block_shape), dtype=dtype, pin_memory=pin)
        self._async = pin
        self.k_cache = list(self.pools[0])  # (rows, tokens_per_block, num_kv_heads, head_dim) per layer
        self.v_cache = list(self.pools[1])
        self.k_host = list(self.host[:, 0].transpose(0, 1))  # (num_host_blocks, tokens_per_block, ...) per layer
        self.v_host = list(self.host[:, 1].transpose(0, 1))

    @property
    def scratch_block_ids(self) -> range:
        """Block ids no request ever holds (see the module docstring)."""
        return range(self.num_blocks, self.num_blocks + self.num_scratch_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, block_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
        tokens_per_block, num_kv_heads, head_dim = block_shape
        return 2 * num_layers * tokens_per_block * num_kv_heads * head_dim * dtype.itemsize

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None:
        self.pools[:, :, dst_block_id].copy_(self.pools[:, :, src_block_id])

    def offload(self, block_id: int, host_id: int) -> None:
        self.host[host_id].copy_(self.pools[:, :, block_id], non_blocking=self._async)

    def onboard(self, host_id: int, block_id: int) -> None:
        self.pools[:, :, block_id].copy_(self.host[host_id], non_blocking=self._async)
