"""The paged KV cache's bookkeeping, one idea per module, lowest first:

    block            KVBlock: one block's slots, reference count and tree links
    lru              LRU deques with lazy removal (both tiers)
    prefix_tree      block keys, lookup, the commit of computed chains
    host_tier        the host slots and their LRU order
    block_pool       BlockPool: primary slots, references, eviction (owns the tree and the host tier)
    values           what the manager hands out (PrefixMatch, PrefixClaim, Allocation, KVAllocation, ...)
    beam_tables      one block table per beam, copy on write
    sequence_blocks  each started request's blocks, grown step by step
    prefix_reuse     match, claim, take and commit: reuse of computed prefixes
    manager          KVCacheManager: the verbs, composing the three above
    storage, copy_batch   the tensors (torch), for engines that run a model

Imports nothing from the budget, the scheduler, the engine, the sampler or the executor."""
