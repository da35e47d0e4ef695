"""The paged KV cache's bookkeeping, one idea per module, lowest first:

    events           KV cache events (stored, removed, moved, cleared), their hash and bounded buffer
    block            KVBlock: one block's slots, reference count and tree links
    lru              LRU deques with lazy removal (both tiers)
    prefix_tree      block keys, lookup, the commit of computed chains
    host_tier        the host slots and their LRU order
    values           what the KV cache hands out (PrefixMatch, PrefixClaim, Allocation, KvCacheStats, ...)
    block_pool       BlockPool: primary slots, references, eviction (owns the tree and the host tier)
    beam_tables      one block table per beam, copy on write
    sequence_blocks  each started request's blocks, grown step by step
    prefix_reuse     match, claim, take and commit: reuse of computed prefixes
    copy_batch       host-tier copies gathered into batches
    storage          the tensors (torch), for engines that run a model; the manager names its type only
    manager          KVCacheManager: the verbs, composing prefix_reuse, sequence_blocks and block_pool

Each imports only those above it, and none imports the budget, the scheduler, the engine,
the sampler, the executor or the iteration (kv_cache/test_kv_cache_layering.py)."""
