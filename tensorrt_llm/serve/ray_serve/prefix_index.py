"""Which replica holds which KV blocks, rebuilt from the replicas' KV cache events, and how long a
prefix of a request's tokens each replica has cached.

Keys are the events' own block hashes: the 64-bit chained identity hash of
``kv_cache/events.py`` (``H(parent hash, block tokens)``), which a router computes from a
request's token ids alone (:func:`request_keys` is ``events.block_hashes``). A chained hash names
a block *and its whole prefix*, so the index is a flat map, and a request's match on a replica
is its leading run of block hashes that the replica holds::

    request blocks     h0     h1     h2     h3
    replica r1         yes    yes    no     yes   -> 2 (h3 without h2 cannot be reused)
    replica r2         yes    no     -      -     -> 1

The engine's own lookup stops at the first block it lacks in the same way, so the match is the
prefix the replica would reuse (full blocks only; partial reuse of a last block is not
counted). A collision of two 64-bit hashes among a million blocks has a probability of about
3e-8; it would cost one routing choice, never a wrong answer (the engine verifies every hit
against the tokens).

Events are upstream's dicts (``LLM.get_kv_cache_events``): ``{"event_id", "data": {"type": ...}}``
with ``stored`` (``blocks``: ``block_hash``, ...), ``removed`` (``block_hashes``; a reset of the
prefix cache comes out as one removal of every block), ``created`` (a new pool: the replica
holds nothing) and ``updated`` (a block moved between tiers: still held, still reusable). Nothing
here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache.events import block_hashes

#: Event types after which the replica's pool holds no reusable block.
RESET_EVENTS = frozenset({"created"})


def request_keys(token_ids: Sequence[int], tokens_per_block: int) -> list[int]:
    """The block hashes of a request's full blocks, as the replica's stored events will carry them
    once computed (a partial last block has none: only full blocks are stored)."""
    return block_hashes(token_ids, tokens_per_block)


class EventError(ValueError):
    """An event the index cannot apply (malformed)."""


@dataclass(slots=True)
class ApplyReport:
    """What one :meth:`PrefixIndex.apply` did, counted (for the registry's log)."""

    stored: int = 0
    removed: int = 0
    resets: int = 0
    unknown_removals: int = 0  # removals of blocks never seen stored (events lost, or the index is new)


class PrefixIndex:
    """The blocks every replica holds; see the module docstring. Not thread-safe: one owner (the
    registry actor) applies events and answers matches."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> replicas that hold it
        self._blocks: dict[str, set[int]] = {}  # replica -> the block hashes it holds

    # ---- updates --------------------------------------------------------------------------
    def apply(self, replica: str, events: Iterable[Mapping]) -> ApplyReport:
        """Apply ``replica``'s events, in the order it emitted them. A malformed event raises
        :class:`EventError` naming it; those before it stay applied."""
        report = ApplyReport()
        blocks = self._blocks.setdefault(replica, set())
        for event in events:
            data = event.get("data") if isinstance(event, Mapping) else None
            kind = data.get("type") if isinstance(data, Mapping) else None
            try:
                if kind == "stored":
                    for block in data["blocks"]:
                        self._hold(replica, blocks, int(block["block_hash"]))
                        report.stored += 1
                elif kind == "removed":
                    for block_hash in data["block_hashes"]:
                        if self._release(replica, blocks, int(block_hash)):
                            report.removed += 1
                        else:
                            report.unknown_removals += 1
                elif kind in RESET_EVENTS:
                    self._drop(replica, blocks)
                    report.resets += 1
                elif kind != "updated":  # a tier move: the block is still held and reusable
                    raise EventError(f"unknown event type {kind!r}")
            except (KeyError, TypeError, ValueError) as error:
                raise EventError(f"replica {replica}: cannot apply event {_short(event)}: {error}") from None
        return report

    def forget(self, replica: str) -> None:
        """``replica`` is gone (or resynchronises): none of its blocks is held any more."""
        blocks = self._blocks.pop(replica, None)
        if blocks is not None:
            self._drop(replica, blocks)

    def _hold(self, replica: str, blocks: set[int], block_hash: int) -> None:
        blocks.add(block_hash)
        self._holders.setdefault(block_hash, set()).add(replica)

    def _release(self, replica: str, blocks: set[int], block_hash: int) -> bool:
        if block_hash not in blocks:
            return False
        blocks.discard(block_hash)
        holders = self._holders[block_hash]
        holders.discard(replica)
        if not holders:
            del self._holders[block_hash]
        return True

    def _drop(self, replica: str, blocks: set[int]) -> None:
        for block_hash in list(blocks):
            self._release(replica, blocks, block_hash)

    # ---- queries (change nothing) -----------------------------------------------------------
    def match(self, keys: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, int]:
        """For each replica (of ``replicas``, default every one known), how many of the leading
        blocks ``keys`` (:func:`request_keys`) it holds, consecutively from the first."""
        wanted = set(self._blocks if replicas is None else replicas)
        matched = dict.fromkeys(wanted, 0)
        alive = wanted
        for depth, key in enumerate(keys, start=1):
            alive = alive & self._holders.get(key, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth
        return matched

    def held(self, replica: str) -> frozenset[int]:
        """The block hashes ``replica`` holds, as its events said."""
        return frozenset(self._blocks.get(replica, ()))

    def num_blocks(self, replica: str) -> int:
        """Blocks ``replica`` holds, as its events said."""
        return len(self._blocks.get(replica, ()))

    @property
    def replicas(self) -> list[str]:
        return sorted(self._blocks)

    def check_integrity(self) -> None:
        """The two maps say the same thing (AssertionError otherwise)."""
        pairs = {(h, r) for r, hashes in self._blocks.items() for h in hashes}
        assert pairs == {(h, r) for h, holders in self._holders.items() for r in holders}, "the maps disagree"
        assert all(self._holders.values()), "a block nobody holds stayed in the index"


def _short(event: object) -> str:
    text = repr(event)
    return text if len(text) <= 200 else text[:197] + "..."
