"""Hand-made traces shared by the single-rank and the multi-rank replay tests.

Each is built so that one DESIGN.md §1 mechanism fires at a known iteration; the numbers in
the docstrings are the executor's arithmetic.
"""

from __future__ import annotations

from benchmarks.replay import ReplaySettings
from benchmarks.replay.traces import SyntheticRequest, Trace, segment_key

VOCAB = 32000


def request(index: int, arrival_s: float, output_len: int, *segments: tuple[str, int]) -> SyntheticRequest:
    """A request whose prompt is the named segments in order (equal names, equal tokens)."""
    keyed = tuple((segment_key(0x7E57, sum(map(ord, name)) * 1000 + len(name)), length) for name, length in segments)
    return SyntheticRequest(index, arrival_s, sum(n for _, n in segments), output_len, keyed, VOCAB)


def evicted_discount_trace() -> Trace:
    """A follow-up counted as reusing its cached prefix, evicted by the first chunk before it.

    tokens_per_block=4, 20 device blocks, no host tier, max_num_tokens=48. ``history`` (32
    tokens, 8 blocks) is cached first, then ``junk`` (10 blocks, newer in LRU), leaving 2
    free blocks. At t=1 ``fresh`` (40 tokens) and ``followup`` (history + 2 tokens) arrive
    together: the follow-up is estimated to reuse 32 tokens and charged 2; ``fresh``
    allocates 10 blocks first and evicts the 8 oldest cached ones, all of ``history``;
    the follow-up then runs 34 positions: 40 + 34 = 74 > 48.
    """
    return Trace("evicted-discount", "scenario", (
        request(0, 0.0, 2, ("history", 32)),
        request(1, 0.1, 2, ("junk", 40)),
        request(2, 1.0, 2, ("fresh", 40)),
        request(3, 1.0, 2, ("history", 32), ("question", 2)),
        request(4, 2.0, 3, ("late", 20)),
        request(5, 2.5, 3, ("history", 32), ("other question", 5)),
    ))


EVICTED_SETTINGS = ReplaySettings.from_options(
    max_num_tokens=48, kv_cache_config={"tokens_per_block": 4, "num_blocks": 20}, host_cache_blocks=0, max_batch_size=8,
)
