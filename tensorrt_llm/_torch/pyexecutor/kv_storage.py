"""Real K/V tensors in a paged layout, with a host tier for offloading.

Per layer, K and V are each one pool tensor ``(num_blocks, tokens_per_block, num_kv_heads, head_dim)``;
a block id indexes dim 0 of every layer's pools. The host tier has the same layout with
``num_host_blocks`` rows on the CPU.
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
    ) -> None:
        self.k_cache = [torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_host = [torch.zeros((num_host_blocks, *block_shape), dtype=dtype) for _ in range(num_layers)]
        self.v_host = [torch.zeros((num_host_blocks, *block_shape), dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
        tokens_per_block, num_kv_heads, head_dim = block_shape
        return 2 * num_layers * tokens_per_block * num_kv_heads * head_dim * dtype.itemsize

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None:
        for pool in (*self.k_cache, *self.v_cache):
            pool[dst_block_id].copy_(pool[src_block_id])

    def offload(self, block_id: int, host_id: int) -> None:
        for host, pool in zip((*self.k_host, *self.v_host), (*self.k_cache, *self.v_cache)):
            host[host_id].copy_(pool[block_id])

    def onboard(self, host_id: int, block_id: int) -> None:
        for host, pool in zip((*self.k_host, *self.v_host), (*self.k_cache, *self.v_cache)):
            pool[block_id].copy_(host[host_id])
