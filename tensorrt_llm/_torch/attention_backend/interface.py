"""What a flat forward over several requests looks like to attention: :class:`AttentionMetadata`.

Upstream keeps its ``AttentionMetadata`` here too (``attention_backend/interface.py``). The
backends themselves work from a plan built from the same three lists (``backend.plan_builder``);
this value is the checked form that ``LlamaForCausalLM.forward`` and the tests build by hand.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

__all__ = ["AttentionMetadata"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat forward over several requests.

    Requests appear in the flat token order. For request r:
      num_new_tokens[r]  tokens of this forward belong to r (contiguous in the flat input),
      num_cached_tokens[r] tokens of r already have K/V in the paged cache (the first new
                         token's position),
      block_tables[r]    block ids (ints) covering positions [0, num_cached_tokens[r] +
                         num_new_tokens[r]) of r, in order: position p of r lives in block
                         block_tables[r][p // tokens_per_block] at offset p % tokens_per_block.

    A block table may be longer than needed (blocks allocated ahead); the extra blocks are
    neither read nor written. Blocks may be shared between requests (reused prefixes), but
    the slots written by one forward must be distinct -- that is checked in the forward.
    """

    num_new_tokens: list[int]
    num_cached_tokens: list[int]
    block_tables: list[list[int]]
    tokens_per_block: int

    def __post_init__(self) -> None:
        if not _is_int(self.tokens_per_block) or self.tokens_per_block <= 0:
            raise ValueError(
                f"AttentionMetadata.tokens_per_block must be a positive int, "
                f"got {self.tokens_per_block!r}"
            )
        n = len(self.num_new_tokens)
        if len(self.num_cached_tokens) != n or len(self.block_tables) != n:
            raise ValueError(
                "AttentionMetadata.num_new_tokens, num_cached_tokens and block_tables must have "
                f"one entry per request, got lengths {n}, {len(self.num_cached_tokens)}, "
                f"{len(self.block_tables)}"
            )
        for r in range(n):
            new, cached = self.num_new_tokens[r], self.num_cached_tokens[r]
            if not _is_int(new) or new < 0:
                raise ValueError(
                    f"AttentionMetadata.num_new_tokens[{r}] must be an int >= 0, got {new!r}"
                )
            if not _is_int(cached) or cached < 0:
                raise ValueError(
                    f"AttentionMetadata.num_cached_tokens[{r}] must be an int >= 0, got {cached!r}"
                )
            needed = self.num_blocks_needed(r)
            table = self.block_tables[r]
            if len(table) < needed:
                raise ValueError(
                    f"AttentionMetadata.block_tables[{r}] has {len(table)} blocks, but "
                    f"{cached} cached + {new} new tokens need {needed} blocks of "
                    f"{self.tokens_per_block} tokens"
                )
            used = table[:needed]
            for block in used:
                index = _as_index(block)
                if index is None or index < 0:
                    raise ValueError(
                        f"AttentionMetadata.block_tables[{r}] holds {block!r}, "
                        "block ids must be ints >= 0"
                    )
            if len(set(used)) != len(used):
                raise ValueError(
                    f"AttentionMetadata.block_tables[{r}] uses a block twice: {list(used)}"
                )

    @property
    def num_requests(self) -> int:
        return len(self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        """Total new tokens of this forward: the length of the flat input."""
        return sum(self.num_new_tokens)

    def context_len(self, r: int) -> int:
        """Positions of request r that have K/V after this forward: cached + new."""
        return self.num_cached_tokens[r] + self.num_new_tokens[r]

    def num_blocks_needed(self, r: int) -> int:
        return -(-self.context_len(r) // self.tokens_per_block)


def _as_index(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
