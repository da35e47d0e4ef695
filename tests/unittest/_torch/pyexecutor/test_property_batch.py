"""Batch-level properties (DESIGN.md §3, invariants 1-3) over random KV states and batches.

Every example builds a KV state from a random history (prefix tree populated, blocks
cached, evicted, offloaded, held by running requests), an active set, and one batch —
made by the real scheduler of the policy under test, or picked directly with upstream's
charges fitting the budget — then runs ``prepare_resources`` and ``_prepare_tp_inputs``
(:func:`invariants.run_batch`) and checks it (:func:`invariants.check_batch`).

* ``recheck`` holds invariants 1-3 in every example, with chunked prefill on and off and
  block reuse off / on / on with partial reuse. The search is steered (``target``) towards
  states where upstream, on the same recipe, overshoots the most. ``claim`` (the later
  claim-then-charge policy) is held to the same.
* ``none``, ``trim`` and ``fit`` do not: for each, a search proves a counter-example
  exists and prints it shrunk, as a readable batch (run ``pytest -s`` to see them).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, find, given, note, settings, target
from hypothesis import strategies as st
from invariants import BatchOutcome, check_batch, check_budget_priority
from strategies import BatchRecipe, World, batch_recipes, describe, examples, kv_settings, run_recipe

from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost


REUSE_MODES = pytest.mark.parametrize(
    "reuse,partial", [(False, False), (True, False), (True, True)], ids=["no-reuse", "reuse", "partial-reuse"]
)
CHUNKING = pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])


# ---- recheck: invariants 1-3 always hold -------------------------------------------------


def check_safe_policy(recipe: BatchRecipe) -> None:
    world, outcome = run_recipe(recipe)
    note(describe(world, outcome))
    check_batch(outcome, world.kv, world.config.max_num_tokens, claims_safety=True)
    if recipe.picks is None:
        check_budget_priority(outcome)
    # Upstream on the same recipe: the search climbs towards where the fix matters most.
    _, upstream = run_recipe(recipe.with_policy("none"))
    target(float(upstream.overshoot_tokens), label="upstream overshoot on the same recipe (tokens)")
    if upstream.overshoot_tokens:
        event("upstream overshoots on this recipe")
    if any(c.reused_tokens < c.estimated_reusable_tokens for c in outcome.claims):
        event("estimated reuse did not materialise")
    for _, reason in outcome.scheduled.deferred_requests:
        event(f"{recipe.policy} deferred a request ({reason.value})")


@CHUNKING
@REUSE_MODES
@settings(max_examples=examples(1, 300))
@given(data=st.data())
def test_recheck_holds_invariants_1_to_3_on_scheduler_batches(chunked, reuse, partial, data):
    setting = kv_settings(chunked=chunked, reuse=reuse, partial=partial)
    check_safe_policy(data.draw(batch_recipes(policy="recheck", setting=setting), label="recipe"))


@CHUNKING
@REUSE_MODES
@settings(max_examples=examples(1, 300))
@given(data=st.data())
def test_recheck_holds_invariants_1_to_3_on_direct_batches(chunked, reuse, partial, data):
    setting = kv_settings(chunked=chunked, reuse=reuse, partial=partial)
    check_safe_policy(data.draw(batch_recipes(policy="recheck", setting=setting, direct=True), label="recipe"))


@settings(max_examples=examples(1, 300))
@given(recipe=batch_recipes(policy="claim", direct=None))
def test_claim_holds_invariants_1_to_3(recipe):
    """Claim-then-charge (pin every prefix, then charge exact costs) promises the same."""
    check_safe_policy(recipe)


@settings(max_examples=examples(1, 100))
@given(recipe=batch_recipes(policy=st.sampled_from(["none", "trim", "fit"]), direct=None))
def test_baselines_keep_the_cost_bound_and_the_pool_intact(recipe):
    """Invariant 2 is a property of forward_cost and allocation, whatever the policy; the pool never leaks."""
    world, outcome = run_recipe(recipe)
    note(describe(world, outcome))
    # trim defers after its blocks were claimed: deferral is not clean there (a defect of the proposal)
    check_batch(
        outcome, world.kv, world.config.max_num_tokens, claims_safety=False, check_deferrals=recipe.policy != "trim"
    )


# ---- none, trim, fit: a counter-example exists -------------------------------------------


def culprits(outcome: BatchOutcome) -> list[int]:
    """Requests that appended more positions than admission charged them."""
    return [rid for rid, now in outcome.built.items() if now.positions > outcome.charges.get(rid, 0)]


def reuse_shortfalls(world: World, outcome: BatchOutcome) -> dict[int, tuple[int, int]]:
    """First chunks whose estimated reuse did not materialise: id -> (estimated, reused)."""
    return {
        c.request_id: (c.estimated_reusable_tokens, c.reused_tokens)
        for c in outcome.claims
        if c.reused_tokens < c.estimated_reusable_tokens
    }


def speculative(outcome: BatchOutcome) -> bool:
    """Does the batch carry draft tokens or first-draft padding (their own undercount)?"""
    return any(r.py_draft_tokens or r.is_first_draft for r in outcome.scheduled.all_requests)


def find_overshoot(title: str, policy: str, condition, *, setting=None, max_examples=4000, **recipe_options):
    """Search for a batch under ``policy`` that overshoots and meets ``condition``; print it shrunk.

    The batch comes from the policy's own scheduler (the most faithful), over small recipes:
    generating and shrinking recipes, not running them, is what a search costs.
    """

    def overshoots(recipe: BatchRecipe) -> bool:
        world, outcome = run_recipe(recipe)
        target(float(outcome.overshoot_tokens), label="overshoot")
        lost = sum(est - reused for est, reused in reuse_shortfalls(world, outcome).values())
        target(float(lost), label="estimated reuse that did not materialise")
        return outcome.overshoot_tokens > 0 and condition(world, outcome)

    recipe = find(
        batch_recipes(policy=policy, setting=setting, **{"max_history": 4, "max_arrivals": 3, **recipe_options}),
        overshoots,
        settings=settings(max_examples=max_examples, deadline=None),
        random=random.Random(title),
        database_key=title.encode(),
    )
    world, outcome = run_recipe(recipe)  # deterministic: the same batch again
    print(f"\n===== counter-example: {title} =====\n{describe(world, outcome)}")
    assert outcome.overshoot_tokens > 0 and condition(world, outcome)
    return world, outcome


def test_none_overshoots():
    """Upstream before any fix: some batch overshoots (the shrunk, simplest one)."""
    find_overshoot("none, any mechanism", "none", lambda world, outcome: True)


def test_none_overshoots_through_a_whole_prompt_hit():
    """A block-aligned, fully cached prompt is charged 1 token; the claim stops at prompt_len - 1."""

    def whole_prompt_hit(world: World, outcome: BatchOutcome) -> bool:
        shortfalls = reuse_shortfalls(world, outcome)
        by_id = {r.request_id: r for r in outcome.scheduled.all_requests}
        return (
            not speculative(outcome)
            and set(culprits(outcome)) <= set(shortfalls)
            and any(est == by_id[rid].prompt_len for rid, (est, _) in shortfalls.items())
        )

    find_overshoot(
        "none, whole-prompt hit", "none", whole_prompt_hit, setting=kv_settings(reuse=True, partial=False)
    )


def test_none_overshoots_through_an_evicted_discount():
    """A request charged only its uncached tail loses its cached prefix to an earlier allocation."""

    def evicted_discount(world: World, outcome: BatchOutcome) -> bool:
        tpb = world.kv.tokens_per_block
        by_id = {r.request_id: r for r in outcome.scheduled.all_requests}
        shortfalls = reuse_shortfalls(world, outcome)
        claimable = {rid: (by_id[rid].prompt_len - 1) // tpb * tpb for rid in shortfalls}
        evicted = [rid for rid, (est, reused) in shortfalls.items() if reused < min(est, claimable[rid])]
        return not speculative(outcome) and bool(evicted) and set(culprits(outcome)) <= set(shortfalls)

    find_overshoot(
        "none, evicted discount", "none", evicted_discount, setting=kv_settings(chunked=True, reuse=True, host=False)
    )


@settings(max_examples=examples(1 / 2, 50))
@given(recipe=batch_recipes(policy="trim", direct=None))
def test_trim_overshoots_only_through_its_generation_undercount(recipe):
    """trim's prediction is exact for context chunks (taken after allocation) and plain generation;
    so where it overshoots, a beam-search or first-draft request is in the batch."""
    world, outcome = run_recipe(recipe)
    note(describe(world, outcome))
    if outcome.overshoot_tokens:
        event("trim overshoots")
        assert any(r.beam_width > 1 or r.is_first_draft for r in outcome.scheduled.generation_requests)


def test_trim_undercounts_beams_or_first_draft_requests():
    """trim predicts 1 + drafts per generation request: beams and first-draft padding slip past it,
    although the batch holds enough context positions to trim the overshoot away."""

    def undercount(world: World, outcome: BatchOutcome) -> bool:
        context = outcome.scheduled.context_requests
        generation = outcome.scheduled.generation_requests
        return (
            not any(r.py_draft_tokens for r in context)
            and sum(forward_cost(r) for r in context) >= outcome.overshoot_tokens
            and any(r.beam_width > 1 or r.is_first_draft for r in generation)
        )

    find_overshoot(
        "trim, beam / first-draft undercount",
        "trim",
        undercount,
        setting=kv_settings(chunked=True, host=False),
        max_history=3,
        max_arrivals=2,
    )


def test_fit_cannot_repair_a_generation_only_overshoot():
    """fit shrinks context chunks only; first-draft requests charged 1 token run 1 + max_draft_len."""

    def generation_only(world: World, outcome: BatchOutcome) -> bool:
        return not outcome.scheduled.context_requests

    find_overshoot(
        "fit, generation-only batch",
        "fit",
        generation_only,
        setting=kv_settings(reuse=False, host=False),
        history_kinds=("generate",),
        max_arrivals=0,
    )


def test_fit_cannot_repair_an_overshoot_without_chunked_prefill():
    """With chunked prefill off fit has nothing it may shrink; lost reuse overshoots."""

    def reuse_lost(world: World, outcome: BatchOutcome) -> bool:
        return not speculative(outcome) and set(culprits(outcome)) <= set(reuse_shortfalls(world, outcome))

    find_overshoot(
        "fit, chunked prefill off", "fit", reuse_lost, setting=kv_settings(chunked=False, reuse=True)
    )
