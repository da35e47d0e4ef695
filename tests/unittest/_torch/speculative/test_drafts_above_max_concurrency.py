"""Speculation above ``max_concurrency`` costs exactly what plain decoding costs, under overlap.

A burst of requests far above ``max_concurrency`` (the H100's default workload: 64 at once, limit
16) ran drafts at 0.71x plain decoding with the overlap scheduler on. Counted on the CPU with
overlap forced on (``benchmarks.model.speculative_counts``), two things differed from plain
decoding while the executor held more requests than the limit:

* the drafter counted only *generation* requests against the limit, so the first requests of the
  burst to finish their prompts drafted (first-draft steps of ``1 + max_draft_len`` positions,
  then engine draft slots) while the rest were still in theirs;
* every step of a speculative request allocated through ``KVCacheManager.allocate`` (its sequence
  was not "plain"), where a plain step takes the batch's one-lookup fast path.

Here a workload above the limit for its whole life (its requests' lengths are chosen so that
they all finish in the same iteration: no tail below the limit, where drafts are welcome) must
run the same iterations, the same batches, the same forwards replayable as decode graphs, the
same KV step allocations, with overlap kept on every iteration, as without speculation.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.model.speculative_counts import compare, count_rounds
from tests.helpers.speculative_burst import (BUDGET, MAX_CONCURRENCY, MAX_TOKENS, NUM_REQUESTS, PROMPTS, SPEC, burst_model,
                                             lengths_ending_together)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return burst_model()


def _lengths_ending_together(model) -> list[int]:
    (plain,) = count_rounds(model, PROMPTS, None, max_num_tokens=BUDGET, max_tokens=MAX_TOKENS, rounds=1)
    return lengths_ending_together(plain["first_token_steps"])


def test_a_burst_above_max_concurrency_runs_as_plain_decoding(model):
    lengths = _lengths_ending_together(model)
    common = dict(max_num_tokens=BUDGET, max_tokens=lengths, rounds=2)  # round 2: prompts from the prefix cache
    speculative, plain = count_rounds(model, PROMPTS, SPEC, **common), count_rounds(model, PROMPTS, None, **common)
    for index, (report, spec_round, plain_round) in enumerate(zip(compare(speculative, plain), speculative, plain)):
        counts = report["counts"]
        assert report["outputs_equal"]
        # the workload is the one the fix is about: generation requests at or below the limit while
        # the executor held more (the old rule drafted there)
        assert any(0 < generating <= MAX_CONCURRENCY for _, generating, _ in plain_round["batches"][:4]), plain_round
        assert report["differing_batches"] == [], (index, report["differing_batches"])
        for key in ("iterations", "forwards", "graph_forwards", "graph_rows", "forward_tokens", "kv_step_allocations",
                    "budget_deferrals", "capacity_deferrals"):
            assert counts[key][0] == counts[key][1], (index, key, counts[key])
        assert counts["overlap_broken"] == (0, 0)
        assert counts["drafting_forwards"][0] == counts["draft_tokens"][0] == 0
        assert counts["kv_step_allocations"][1] < counts["forwards"][1], "plain steps allocate once a block"
        # (a speculative request still reserves its draft slots to completion: more blocks held back
        # for started requests, which only a pool too small for the burst would feel)


def test_below_max_concurrency_the_same_requests_draft(model):
    """The counts above are not blind: with the limit above the burst, the same workload drafts."""
    lengths = _lengths_ending_together(model)
    spec = dataclasses.replace(SPEC, max_concurrency=NUM_REQUESTS)
    (drafted,) = count_rounds(model, PROMPTS, spec, max_num_tokens=BUDGET, max_tokens=lengths, rounds=1)
    (plain,) = count_rounds(model, PROMPTS, None, max_num_tokens=BUDGET, max_tokens=lengths, rounds=1)
    assert drafted["outputs"] == plain["outputs"]
    assert drafted["drafting_forwards"] > 0 and drafted["draft_tokens"] > 0
    assert drafted["overlap_broken"] == 0
