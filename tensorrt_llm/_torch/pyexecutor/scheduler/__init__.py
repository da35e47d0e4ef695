"""The two-stage scheduler, upstream's ``pyexecutor/scheduler`` package.

``capacity``: ``CapacityScheduler`` decides who fits in KV memory (a ``CapacityDecision``).
``micro_batch``: ``MicroBatchScheduler`` applies ``max_batch_size`` and the token budget and
picks context chunks. ``simple``: ``SimpleScheduler`` runs one then the other
(``make_scheduler``). ``preemption``: which running requests a waiting one of higher priority
may pause.
"""

from tensorrt_llm._torch.pyexecutor.scheduler.capacity import CapacityDecision, CapacityScheduler
from tensorrt_llm._torch.pyexecutor.scheduler.micro_batch import MicroBatchScheduler
from tensorrt_llm._torch.pyexecutor.scheduler.simple import SimpleScheduler, make_scheduler

__all__ = ["CapacityDecision", "CapacityScheduler", "MicroBatchScheduler", "SimpleScheduler", "make_scheduler"]
