"""Which replica holds which KV blocks, rebuilt from the replicas' KV cache events, and how long a
prefix of a request's tokens each replica has cached.

A radix tree of full blocks, shared by every replica; a node is one block's content under its
parent, and lists the replicas that hold it::

    root ─┬─ k(A0) {r1, r2} ── k(A1) {r1, r2} ─┬─ k(A2) {r1}
          │                                     └─ k(B2) {r2} ── k(B3) {r2}
          └─ k(C0) {r2}

* Keys: a node is keyed by :func:`block_key` of its tokens (``prefix_tree.content_hashes``, the
  engine's own per-block hash of the tokens, computed here from the ids) *under its parent*: the
  path from the root is the prefix, so equal blocks at different places are different nodes. A
  request's tokens are keyed the same way (:func:`request_keys`) and walked down from the root.
* Identity: an event names a block by the engine's hash of it (``block_hash``, whatever its
  width or chaining); each replica's ``block_hash -> node`` map resolves a stored block's
  ``parent_hash`` and a removed block. The index never recomputes the engine's hash, so it holds
  whatever hash the engine emits (Dynamo's router reads events the same way).
* Match: for each replica, the number of leading blocks of the request that it holds
  consecutively from the root. A replica that lost a parent block (evicted) but still lists a
  child matches only up to the gap, as the engine's own lookup would.
* A 32-bit key collision between two sibling blocks merges them into one node: the router may
  then send a request to a replica that will not hit. It costs a routing choice, never a wrong
  answer (the engine verifies every hit against the tokens).

Events are upstream's dicts (``LLM.get_kv_cache_events``): ``{"event_id", "data": {"type": ...}}``
with ``stored`` (``parent_hash``, ``blocks``: ``block_hash``, ``tokens``), ``removed``
(``block_hashes``), ``created`` and ``all_cleared`` (the replica's pool is new or emptied: it
holds nothing) and ``updated`` (a block moved between tiers: still held, still reusable).
Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache.prefix_tree import content_hashes, pack_tokens

#: Event types that leave the replica's pool without any reusable block.
RESET_EVENTS = frozenset({"created", "all_cleared", "cleared"})


def block_key(token_ids: Sequence[int]) -> int:
    """The key of one full block of ``token_ids`` (``prefix_tree.content_hashes``)."""
    return content_hashes(pack_tokens(token_ids), 1, len(token_ids))[0]


def request_keys(token_ids: Sequence[int], tokens_per_block: int) -> list[int]:
    """The keys of the full blocks of a request's tokens, in order (a partial last block has none:
    only full blocks are stored, so only they can hit)."""
    num_blocks = len(token_ids) // tokens_per_block
    if num_blocks == 0:
        return []
    return content_hashes(pack_tokens(token_ids[: num_blocks * tokens_per_block]), num_blocks, tokens_per_block)


def event_token_ids(tokens: Sequence) -> list[int]:
    """A stored block's token ids from its ``tokens`` list: plain ints, or upstream's token dicts
    (``{"type": "unique_token", "token_id": ..., "token_extra_id": ...}``)."""
    return [token["token_id"] if isinstance(token, Mapping) else int(token) for token in tokens]


class EventError(ValueError):
    """An event the index cannot apply (malformed, or naming a block it never saw stored)."""


class _Node:
    __slots__ = ("key", "parent", "children", "holders")

    def __init__(self, key: int | None, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.holders: dict[str, int] = {}  # replica -> its blocks here (more than 1 only on a key collision)


@dataclass(slots=True)
class ApplyReport:
    """What one :meth:`PrefixIndex.apply` did, counted (for the registry's log and metrics)."""

    stored: int = 0
    removed: int = 0
    resets: int = 0
    orphans: int = 0  # stored blocks whose parent this replica never stored (or lost): kept under nothing
    unknown_removals: int = 0  # removals of blocks never seen stored (a reset since, or events lost)

    def __iadd__(self, other: ApplyReport) -> ApplyReport:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        return self


class PrefixIndex:
    """The blocks every replica holds; see the module docstring. Not thread-safe: one owner
    (the registry actor) applies events and answers matches."""

    def __init__(self) -> None:
        self._root = _Node(None, None)
        self._blocks: dict[str, dict[int, _Node]] = {}  # replica -> its block_hash -> node

    # ---- updates --------------------------------------------------------------------------
    def apply(self, replica: str, events: Iterable[Mapping]) -> ApplyReport:
        """Apply ``replica``'s events, in the order it emitted them. A malformed event raises
        :class:`EventError` naming it; those before it stay applied."""
        report = ApplyReport()
        blocks = self._blocks.setdefault(replica, {})
        for event in events:
            data = event.get("data") if isinstance(event, Mapping) else None
            kind = data.get("type") if isinstance(data, Mapping) else None
            try:
                if kind == "stored":
                    self._stored(replica, blocks, data, report)
                elif kind == "removed":
                    self._removed(replica, blocks, data["block_hashes"], report)
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

    def _stored(self, replica: str, blocks: dict[int, _Node], data: Mapping, report: ApplyReport) -> None:
        parent_hash = data.get("parent_hash")
        parent = self._root if parent_hash is None else blocks.get(parent_hash)
        if parent is None:  # its parent was never stored here, or was removed: unreachable from the root
            report.orphans += len(data["blocks"])
            return
        for block in data["blocks"]:
            key = block_key(event_token_ids(block["tokens"]))
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = _Node(key, parent)
            previous = blocks.get(block["block_hash"])
            if previous is not node:  # stored again without a removal in between: counted once
                if previous is not None:
                    self._release(previous, replica)
                node.holders[replica] = node.holders.get(replica, 0) + 1
                blocks[block["block_hash"]] = node
            report.stored += 1
            parent = node

    def _removed(self, replica: str, blocks: dict[int, _Node], hashes: Sequence[int], report: ApplyReport) -> None:
        for block_hash in hashes:
            node = blocks.pop(block_hash, None)
            if node is None:
                report.unknown_removals += 1
                continue
            self._release(node, replica)
            report.removed += 1

    def _drop(self, replica: str, blocks: dict[int, _Node]) -> None:
        for node in blocks.values():
            self._release(node, replica)
        blocks.clear()

    def _release(self, node: _Node, replica: str) -> None:
        """``replica`` no longer holds ``node``; nodes nobody holds and with no children go."""
        count = node.holders.get(replica, 0)
        if count > 1:
            node.holders[replica] = count - 1
            return
        node.holders.pop(replica, None)
        while node is not self._root and not node.holders and not node.children:
            parent = node.parent
            del parent.children[node.key]
            node = parent

    # ---- queries (change nothing) -----------------------------------------------------------
    def match(self, keys: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, int]:
        """For each replica (of ``replicas``, default every one known), how many of the leading
        blocks ``keys`` (:func:`request_keys`) it holds consecutively from the first."""
        wanted = set(self._blocks if replicas is None else replicas)
        matched = dict.fromkeys(wanted, 0)
        alive = set(wanted)
        node = self._root
        for depth, key in enumerate(keys, start=1):
            node = node.children.get(key)
            if node is None:
                break
            alive &= node.holders.keys()
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth
        return matched

    def num_blocks(self, replica: str) -> int:
        """Blocks ``replica`` holds, as its events said."""
        return len(self._blocks.get(replica, ()))

    @property
    def replicas(self) -> list[str]:
        return sorted(self._blocks)

    def check_integrity(self) -> None:
        """Every replica's blocks are nodes of the tree that list it, and every node in the tree is
        held by someone or leads to a node that is (no dead branches). AssertionError otherwise."""
        listed: dict[int, dict[str, int]] = {}
        for replica, blocks in self._blocks.items():
            for node in blocks.values():
                counts = listed.setdefault(id(node), {})
                counts[replica] = counts.get(replica, 0) + 1
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.holders or node.children, "a node nobody holds, with no children, stayed in the tree"
            assert node.holders == listed.get(id(node), {}), "a node's holders differ from the replicas' maps"
            assert node.parent.children.get(node.key) is node
            stack.extend(node.children.values())


def _short(event: object) -> str:
    text = repr(event)
    return text if len(text) <= 200 else text[:197] + "..."
