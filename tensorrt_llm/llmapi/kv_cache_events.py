"""KV cache events as upstream TensorRT-LLM's ``LLM.get_kv_cache_events`` returns them: dicts.

One dict per event, in the pool's order (``kv_cache/events.py`` says what each event means)::

    {"event_id": 7, "window_size": 4096, "data": {"type": "stored", "parent_hash": 1234 | None,
        "blocks": [{"type": "stored_block", "block_hash": 5678, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": 11, "token_extra_id": 0}, ...],
                    "mm_keys": []}, ...]}}
    {"event_id": 8, ..., "data": {"type": "removed", "block_hashes": [5678, ...]}}
    {"event_id": 9, ..., "data": {"type": "updated", "block_hash": 5678,
        "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1}, "priority": None}}
    {"event_id": 0, ..., "data": {"type": "created", "num_blocks_per_cache_level": [GPU, host]}}

``cache_level`` is 0 for the GPU (primary) tier and 1 for the host tier. A move between tiers
is an ``updated`` event, as upstream's. Upstream has no event for a reset: the reset's
``AllBlocksCleared`` comes out as one ``removed`` of every block the index held. Under
attention DP each dict also carries ``attention_dp_rank``. ``priority`` is upstream's default
retention priority (this pool has no priorities). The hashes are the chained identity hashes
of ``kv_cache/events.py`` (``block_hashes(token_ids, tokens_per_block)`` computes them).
"""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.kv_cache.events import (
    AllBlocksCleared,
    BlockMoved,
    BlocksRemoved,
    BlocksStored,
    KVEventRecord,
    PoolCreated,
    token_ids,
)

__all__ = ["DEFAULT_RETENTION_PRIORITY", "event_dict"]

#: Upstream's default block retention priority (``KvCacheRetentionConfig``), which every block has here.
DEFAULT_RETENTION_PRIORITY = 35


def event_dict(record: KVEventRecord, *, window_size: int) -> dict:
    """Upstream's dict of one event; ``window_size``: the attention window (the executor's
    ``max_seq_len``: full attention)."""
    event = record.event
    if isinstance(event, BlocksStored):
        level = int(event.level)
        data = {"type": "stored", "parent_hash": event.parent_hash, "blocks": [
            {"type": "stored_block", "block_hash": block.block_hash,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in token_ids(block.tokens)],
             "cache_level": level, "priority": DEFAULT_RETENTION_PRIORITY, "mm_keys": []}
            for block in event.blocks]}
    elif isinstance(event, BlocksRemoved):
        data = {"type": "removed", "block_hashes": list(event.block_hashes)}
    elif isinstance(event, BlockMoved):
        data = {"type": "updated", "block_hash": event.block.block_hash,
                "cache_level": {"type": "event_diff", "new_value": int(event.destination),
                                "old_value": int(event.source)},
                "priority": None}
    elif isinstance(event, AllBlocksCleared):
        data = {"type": "removed", "block_hashes": list(event.block_hashes)}
    elif isinstance(event, PoolCreated):
        data = {"type": "created", "num_blocks_per_cache_level": list(event.num_blocks_per_cache_level)}
    else:
        raise TypeError(f"not a KV cache event: {event!r}")
    out = {"event_id": record.event_id, "data": data, "window_size": window_size}
    if record.rank is not None:
        out["attention_dp_rank"] = record.rank
    return out
