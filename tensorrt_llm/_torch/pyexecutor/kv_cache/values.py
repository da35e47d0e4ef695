"""The values the KV cache hands out: what a prompt matches, what a claim pinned, what an
allocation got, what a started request needs next, what a pool holds.

Each is made by one module and read by others; none is written after it is made, except the
claim, which the manager consumes. The per-request ones are NamedTuples rather than frozen
dataclasses: one is made per request and iteration (a match per waiting request, an
allocation per first chunk), and a frozen dataclass's ``__init__`` sets each field through
``object.__setattr__``, about five times the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests


class PrefixMatch(NamedTuple):
    """What a waiting request's prompt matches in the prefix tree at one moment (nothing claimed).

    ``reusable_tokens``: upstream's admission estimate, full prompt blocks that match cached
    blocks in either tier. ``shared_blocks``: of the blocks a claim could take (at most
    ``prompt_len - 1`` tokens), those started requests hold, which need no pool slot.
    """

    reusable_tokens: int = 0
    shared_blocks: int = 0


NO_MATCH = PrefixMatch()


@dataclass(slots=True)
class PrefixClaim:
    """A first chunk's pinned reusable prefix, between the claim and the allocation.

    The claim holds one reference on each of :attr:`pinned` until the allocation takes them
    over (``KVCacheManager.allocate``) or :meth:`~.prefix_reuse.PrefixReuse.release` gives them back.
    """

    request_id: int
    chain: list[KVBlock] = field(default_factory=list)  # matched full blocks, either tier
    partial: KVBlock | None = None  # primary block to copy a partial match from
    partial_len: int = 0
    reused: int = 0  # tokens the claim reuses: full blocks, then the partial match

    @property
    def pinned(self) -> list[KVBlock]:
        return self.chain + ([self.partial] if self.partial is not None else [])


class ClaimRecord(NamedTuple):
    """What allocation found for a first chunk: the estimate it was admitted with and the claim.
    ``prompt_len``: the prompt looked up, as it was at allocation (a restart makes it longer)."""

    request: LlmRequest
    estimated_reusable_tokens: int
    reused_tokens: int
    prompt_len: int
    onboarded_tokens: int = 0  # of the reused tokens, those whose blocks came back from the host tier

    @property
    def request_id(self) -> int:
        return self.request.request_id


class Allocation(NamedTuple):
    """What ``KVCacheManager.allocate`` got for one request. ``chunk``: a context chunk as
    allocated (a first chunk moved onto the prefix it reused, ``chunk.reused`` tokens), None for
    a generation step; ``first``: the chunk started the sequence (it claimed its prefix)."""

    chunk: ContextChunk | None = None
    first: bool = False
    onboarded: int = 0  # a first chunk's claimed blocks that were onboarded from the host tier


STEP = Allocation()  # a generation step's: nothing to tell but that it got its blocks


class StepNeed(NamedTuple):
    """A started request's next forward, for the capacity scheduler: the blocks it still needs
    and the blocks it holds (what pausing it gives back)."""

    request: LlmRequest
    blocks: int
    held: int


class KVAllocation(NamedTuple):
    """What ``prepare_resources`` did: the batch as allocated (first chunks' windows moved
    onto their reused prefixes), the requests whose blocks could not be had (untouched),
    and, per first chunk allocated, its reuse estimate and claim."""

    scheduled: ScheduledRequests
    deferred: list[LlmRequest]
    claims: list[ClaimRecord]


@dataclass(frozen=True, slots=True)
class KvCacheStats:
    """A pool as counted at one moment: ``num_free + num_cached + num_held == num_blocks``.

    ``num_cached`` blocks hold reusable KV that nothing references (evictable); ``num_held``
    blocks are referenced by requests or pinned by claims. ``num_offloads`` and
    ``num_onboards`` count host-tier moves since the pool was made.
    """

    num_blocks: int
    num_free: int
    num_cached: int
    num_offloads: int = 0
    num_onboards: int = 0

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def usage(self) -> float:
        """Share of the pool that requests reference (0..1)."""
        return self.num_held / self.num_blocks if self.num_blocks else 0.0

    def __add__(self, other: KvCacheStats) -> KvCacheStats:
        """Two pools counted as one (the ranks of attention DP)."""
        return KvCacheStats(
            self.num_blocks + other.num_blocks, self.num_free + other.num_free, self.num_cached + other.num_cached,
            self.num_offloads + other.num_offloads, self.num_onboards + other.num_onboards,
        )
