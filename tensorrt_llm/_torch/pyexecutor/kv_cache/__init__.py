"""The paged KV cache's bookkeeping: the block pool and its prefix tree, the host tier, the
manager that answers questions about blocks and allocates them (``manager``), beam tables and the
storage that holds the tensors. Imports nothing from the budget, the scheduler or the engine."""
