"""The two-stage scheduler, upstream's ``pyexecutor/scheduler`` package.

``CapacityScheduler`` decides who fits in KV memory; ``MicroBatchScheduler`` applies
``max_batch_size`` and the token budget and picks context chunks; ``SimpleScheduler`` runs one
then the other (``make_scheduler``). ``preemption`` chooses which running requests a waiting one
of higher priority may pause.
"""

from tensorrt_llm._torch.pyexecutor.scheduler.schedulers import (
    CapacityDecision,
    CapacityScheduler,
    MicroBatchScheduler,
    SimpleScheduler,
    make_scheduler,
)

__all__ = ["CapacityDecision", "CapacityScheduler", "MicroBatchScheduler", "SimpleScheduler", "make_scheduler"]
