"""KV cache events: what the block pool's reuse index did, as values, in order, in a bounded buffer.

A router that sends each request to the worker holding its longest cached prefix (NVIDIA
Dynamo's KV router, llm-d's KV-cache-aware scheduler) keeps an index of every worker's
reusable blocks, fed by these events. The pool emits one where it decides::

    commit of computed blocks     ─► BlocksStored   (a chain of new tree nodes under one parent)
    a node leaves the tree        ─► BlocksRemoved  (eviction without a host tier, the host tier
                                                     full, a subtree dropped with its root)
    a node changes tier           ─► BlockMoved     (offload GPU ─► host; onboard, or a fresh
                                                     copy merged into it, host ─► GPU)
    reset_prefix_cache            ─► AllBlocksCleared
    the buffer is made            ─► PoolCreated    (event 0: the blocks of each tier)

Replaying them in order into an empty index gives exactly the pool's reusable set, each
block in the tier it lives in (``tests/.../kv_cache/test_kv_cache_events.py`` holds the pool
to that). Only full blocks of computed tokens are ever in the tree, so only those are stored.

**The block hash.** The prefix tree keys a node by :func:`~.prefix_tree.content_hashes`: 32
bits of one block's tokens, not chained, verified against the tokens on every hit. A router
cannot verify, and it takes a hash as the node's identity (Dynamo's router finds a removed
block, or a stored block's parent, by it alone), so two blocks with the same tokens under
different prefixes must not share one. Events therefore carry a wider identity hash derived
from the chain, computed only when events are on (:func:`chain_hash`)::

    block_hash(first block)  = H(0, tokens[0:B])
    block_hash(block i)      = H(block_hash(block i-1), tokens[i*B:(i+1)*B])
    H(parent, tokens)        = int.from_bytes(blake2b(parent.to_bytes(8, "little")
                                   + tokens as little-endian uint32, digest_size=8).digest(), "little")

It is stable across processes and restarts (no salt, no process state), and a router computes
it from a prompt's tokens alone (:func:`block_hashes`). At 64 bits, a collision among a million
blocks in a cluster has a probability of about 3e-8. Dynamo's router recomputes its own
content hash from each stored event's ``token_ids`` and uses ours as node identity only, which
is what this hash is for. The tree keeps its own 32-bit keys.

**The buffer.** :class:`KVCacheEventBuffer` is bounded: when nobody reads, the oldest events
are dropped and counted, and the executor loop never waits (a lock held for one append). A
reader that sees a gap in ``event_id`` knows it lost events. With ``event_buffer_max_size=0``
there is no buffer and the pool emits nothing: one ``is None`` test at each emission site.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
from array import array
from collections import deque
from typing import Iterable, NamedTuple, Sequence

__all__ = [
    "AllBlocksCleared", "BlockMoved", "BlocksRemoved", "BlocksStored", "CacheLevel", "KVCacheEvent",
    "KVCacheEventBuffer", "KVEventCounts", "KVEventRecord", "PoolCreated", "ROOT_HASH", "StoredBlock",
    "block_hashes", "chain_hash", "token_ids",
]

#: The chain hash's parent for a prompt's first block (events say ``parent_hash: None`` there).
ROOT_HASH = 0
_TOKEN_BYTES = 4  # the tree packs token ids as native unsigned 32-bit ints
_LITTLE_ENDIAN = array("I", [1]).tobytes()[0] == 1
_blake2b = hashlib.blake2b
_now = time.time
_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__: one call less per event


class CacheLevel(enum.IntEnum):
    """Where a block lives: upstream's ``cache_level`` numbers, vLLM's ``medium`` names."""

    GPU = 0  # the pool's primary slots (device memory; the CPU engine's tensors on the CPU)
    HOST = 1  # the host (offload) tier, ``kv_cache_config.host_cache_size``

    @property
    def medium(self) -> str:
        """vLLM's name for the tier (``BlockStored.medium``)."""
        return "GPU" if self is CacheLevel.GPU else "CPU"


class StoredBlock(NamedTuple):
    """One full block: its identity hash and its tokens, packed as the tree packs them."""

    block_hash: int
    tokens: bytes  # native unsigned 32-bit ids (``token_ids`` unpacks them)


class PoolCreated(NamedTuple):
    """The pool exists (event 0): its blocks per tier, GPU first (upstream's ``created``)."""

    num_blocks_per_cache_level: tuple[int, int]


class BlocksStored(NamedTuple):
    """A chain of blocks joined the reuse index under ``parent_hash`` (None: under the root),
    each under the one before it, all in ``level``."""

    parent_hash: int | None
    blocks: tuple[StoredBlock, ...]
    block_size: int
    level: CacheLevel = CacheLevel.GPU


class BlocksRemoved(NamedTuple):
    """Blocks left the reuse index (descendants before their ancestors), all from ``level``."""

    block_hashes: tuple[int, ...]
    level: CacheLevel


class BlockMoved(NamedTuple):
    """A block changed tier and stays reusable: upstream's ``updated`` (its ``cache_level``);
    vLLM's wire has no such event and says ``BlockRemoved`` on ``source`` then ``BlockStored``
    on ``destination`` (with the parent and tokens carried here)."""

    block: StoredBlock
    parent_hash: int | None
    block_size: int
    source: CacheLevel
    destination: CacheLevel


class AllBlocksCleared(NamedTuple):
    """Every block left the reuse index (``reset_prefix_cache``): vLLM's ``AllBlocksCleared``.
    Upstream has no such event: its form is a ``removed`` of ``block_hashes``, every block
    the index held, descendants first."""

    block_hashes: tuple[int, ...] = ()


KVCacheEvent = PoolCreated | BlocksStored | BlocksRemoved | BlockMoved | AllBlocksCleared


class KVEventRecord(NamedTuple):
    """An event as a reader gets it: its number in the emitting pool's order, the event, when
    it was emitted (``time.time()``), and the attention-DP rank whose pool emitted it (None:
    one pool, or tensor parallelism, where rank 0's pool speaks for every rank)."""

    event_id: int
    event: KVCacheEvent
    timestamp: float
    rank: int | None = None


class KVEventCounts(NamedTuple):
    """Running totals of a buffer: events emitted into it, and those dropped unread."""

    emitted: int = 0
    dropped: int = 0

    def __add__(self, other: "KVEventCounts") -> "KVEventCounts":
        return KVEventCounts(self.emitted + other.emitted, self.dropped + other.dropped)


# ---- the identity hash ------------------------------------------------------------------
def chain_hash(parent_hash: int, tokens: bytes) -> int:
    """The identity hash of a block of packed ``tokens`` (native uint32) under ``parent_hash``
    (:data:`ROOT_HASH` for a first block); see the module docstring."""
    if not _LITTLE_ENDIAN:  # the hash is defined over little-endian ids, whatever the host
        swapped = array("I", tokens)
        swapped.byteswap()
        tokens = swapped.tobytes()
    return int.from_bytes(_blake2b(parent_hash.to_bytes(8, "little") + tokens, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[int]:
    """The identity hashes of the full blocks of a token sequence, as a router computes them
    from a prompt: what stored events carry for those blocks, once computed."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = chain_hash(parent, array("I", token_ids[start : start + tokens_per_block]).tobytes())
        hashes.append(parent)
    return hashes


def token_ids(tokens: bytes) -> list[int]:
    """A block's packed tokens as a list of ints."""
    return memoryview(tokens).cast("I").tolist()


# ---- the buffer -------------------------------------------------------------------------
class KVCacheEventBuffer:
    """A bounded, thread-safe queue of events: one writer (the pool, on the executor thread),
    one reader (``LLM.get_kv_cache_events`` or the ZMQ publisher).

    :meth:`emit` numbers an event and appends it, dropping (and counting) the oldest when
    ``max_size`` events are waiting; it never waits. :meth:`take` returns what is waiting,
    waiting up to ``timeout`` seconds for the first event. :meth:`forward` appends records
    numbered elsewhere (a rank process's, relayed), keeping their numbers.
    """

    def __init__(self, max_size: int, *, rank: int | None = None) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"a KV cache event buffer holds at least 1 event, got max_size={max_size!r}")
        self.max_size = max_size
        self.rank = rank
        self._events: deque[KVEventRecord] = deque()
        # A plain lock for the writer (one C-level acquire per event); the condition over it is
        # notified only while a reader waits on it (a Python-level notify costs microseconds).
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waiting = 0
        self._next_id = 0
        self._emitted = 0
        self._dropped = 0

    def emit(self, event: KVCacheEvent) -> None:
        """Append ``event`` with the next number (executor thread)."""
        with self._lock:
            events = self._events
            if len(events) >= self.max_size:
                events.popleft()
                self._dropped += 1
            events.append(_tuple_new(KVEventRecord, (self._next_id, event, _now(), self.rank)))  # KVEventRecord(...)
            self._next_id += 1
            self._emitted += 1
            if self._waiting:
                self._ready.notify()

    def forward(self, records: Iterable[KVEventRecord]) -> None:
        """Append records another buffer numbered (a rank's, relayed), as they are."""
        with self._lock:
            events = self._events
            for record in records:
                if len(events) >= self.max_size:
                    events.popleft()
                    self._dropped += 1
                events.append(record)
                self._emitted += 1
            if self._waiting:
                self._ready.notify()

    def take(self, timeout: float | None = 0.0, max_events: int | None = None) -> list[KVEventRecord]:
        """The events waiting (at most ``max_events``), oldest first; with none waiting, wait up
        to ``timeout`` seconds for one (None: as long as it takes; 0: not at all)."""
        with self._lock:
            events = self._events
            if not events and timeout != 0:
                self._waiting += 1
                try:
                    self._ready.wait_for(lambda: bool(self._events), timeout)
                finally:
                    self._waiting -= 1
            count = len(events) if max_events is None else min(max_events, len(events))
            return [events.popleft() for _ in range(count)]

    def counts(self) -> KVEventCounts:
        with self._lock:
            return KVEventCounts(self._emitted, self._dropped)

    def __len__(self) -> int:
        return len(self._events)
