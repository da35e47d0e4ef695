"""``BeamTables``: one block table per beam of a request in generation, blocks shared copy-on-write.

A beam-search request computes its prompt once, as one sequence; its first generation step
starts ``W`` beams on the prompt's blocks. From then on each beam has its own table, and a
block is shared by every beam whose history it holds::

    prompt 10 tokens, tokens_per_block 4, 3 beams, after a few steps:

    beam 0   [P0][P1][A ][C ]      P0 P1: full prompt blocks, shared by all (in the prefix tree)
    beam 1   [P0][P1][A ][D ]      A: the prompt's last block with the first generated tokens of
    beam 2   [P0][P1][B ][E ]         beams 0 and 1 (their common parent), B: beam 2's copy of it
                                   C D E: each beam's own newest block

Two rules keep every beam's KV its own:

* *copy on write*: before a forward writes a beam's next position, the block holding it must be
  that beam's alone; a block other beams also hold is copied into a fresh block first (the
  last beam still holding it keeps it). Full blocks are never written again, so only the block
  of the newest position is ever copied;
* *fork*: after a step, new beam ``j`` continues old beam ``parents[j]``: its table becomes a
  copy of the parent's. Blocks no new beam holds (those of dropped beams) are returned to the
  caller to release.

Reference counts: the request holds ONE pool reference per distinct block, however many of its
beams hold it; this class counts the beams per block. The KV manager therefore sees a beam
request as a set of distinct blocks (``distinct()``), and its own accounting (held, reserved,
freed) is unchanged. Blocks of generated tokens are never committed to the prefix tree (the KV
manager commits a beam request's prompt blocks only), so no cached block ever holds a dropped
beam's tokens. Nothing here touches the pool: the KV manager allocates, copies and releases.
"""

from __future__ import annotations

from typing import Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache.block import KVBlock


class BeamTables:
    """The block tables of a request's ``beam_width`` beams."""

    __slots__ = ("tables", "_holders")

    def __init__(self, blocks: Sequence[KVBlock], beam_width: int) -> None:
        """Every beam starts on ``blocks`` (the prompt's table)."""
        self.tables: list[list[KVBlock]] = [list(blocks) for _ in range(beam_width)]
        self._holders: dict[int, int] = {id(block): beam_width for block in blocks}  # id(block) -> beams holding it

    @property
    def beam_width(self) -> int:
        return len(self.tables)

    def table_ids(self, beam: int) -> list[int]:
        return [block.block_id for block in self.tables[beam]]

    def distinct(self) -> list[KVBlock]:
        """Every block some beam holds, once: beam 0's table, then the others' blocks not in it, in order."""
        seen: set[int] = set()
        blocks: list[KVBlock] = []
        for table in self.tables:
            for block in table:
                if id(block) not in seen:
                    seen.add(id(block))
                    blocks.append(block)
        return blocks

    def blocks_to_write(self, position: int, tokens_per_block: int) -> int:
        """Fresh blocks the next forward needs so that every beam may write ``position``: one per
        beam without a block there, and one per extra beam sharing the block there."""
        index = position // tokens_per_block
        needed = 0
        seen: set[int] = set()
        for table in self.tables:
            if index >= len(table):
                needed += 1
            elif id(table[index]) not in seen:
                seen.add(id(table[index]))
                needed += self._holders[id(table[index])] - 1
        return needed

    def make_writable(
        self, position: int, tokens_per_block: int, fresh: list[KVBlock]
    ) -> list[tuple[KVBlock, KVBlock]]:
        """Give every beam its own block at ``position``, taking ``fresh`` blocks (exactly
        :meth:`blocks_to_write` of them, each referenced once by the caller). Returns the
        ``(source, copy)`` pairs whose content the caller must copy before the forward."""
        index = position // tokens_per_block
        fresh = list(fresh)
        copies: list[tuple[KVBlock, KVBlock]] = []
        for table in self.tables:
            if index >= len(table):
                block = fresh.pop()
                table.append(block)
                self._holders[id(block)] = 1
                continue
            shared = table[index]
            if self._holders[id(shared)] == 1:
                continue  # its own already (the last of its sharers keeps it)
            block = fresh.pop()
            table[index] = block
            self._holders[id(shared)] -= 1
            self._holders[id(block)] = 1
            copies.append((shared, block))
        assert not fresh, f"{len(fresh)} fresh blocks left over: blocks_to_write disagrees"
        return copies

    def fork(self, parents: Sequence[int]) -> list[KVBlock]:
        """New beam ``j`` continues old beam ``parents[j]``. Returns the blocks no beam holds now
        (a dropped beam's), for the caller to release; the tables of the others are untouched."""
        if len(parents) != len(self.tables) or not all(0 <= p < len(self.tables) for p in parents):
            raise ValueError(f"parents {list(parents)} do not index {len(self.tables)} beams")
        if list(parents) == list(range(len(self.tables))):
            return []  # every beam continues itself
        before = self.distinct()
        self.tables = [list(self.tables[p]) for p in parents]
        holders: dict[int, int] = {}
        for table in self.tables:
            for block in table:
                holders[id(block)] = holders.get(id(block), 0) + 1
        self._holders = holders
        return [block for block in before if id(block) not in holders]

    def check(self) -> None:
        """Every table is as long as every other, and the beam counts match the tables (a test hook)."""
        lengths = {len(table) for table in self.tables}
        assert len(lengths) == 1, f"beam tables of different lengths {sorted(lengths)}"
        holders: dict[int, int] = {}
        for table in self.tables:
            for block in table:
                holders[id(block)] = holders.get(id(block), 0) + 1
        assert holders == self._holders, "beam counts out of step with the tables"
