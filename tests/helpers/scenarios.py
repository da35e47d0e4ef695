"""Hypothesis strategies for multi-rank scenarios, and pinned scenarios that force the hard cases.

Tight budgets (a few blocks per forward) force chunking and budget deferrals; small pools
force capacity deferrals, evictions and (with a host tier) offloads; prompts share
prefixes of two documents at any length, aligned to blocks or not, so block reuse and
partial reuse happen; requests arrive in bursts over the first iterations and a few are
cancelled in flight.
"""

from __future__ import annotations

import dataclasses

from tests.helpers.factories import make_config
from hypothesis import strategies as st
from tests.helpers.rank_jobs import Arrival, Scenario

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy, ContextChunkingPolicy

POLICIES = ("none", "trim", "fit", "recheck", "claim")
TINY64 = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")  # 4 heads, 2 KV heads, vocab 512


def document_token(doc: int, i: int) -> int:
    """Token ``i`` of document ``doc`` (in [200, 500): inside the tiny model's vocabulary)."""
    return 200 + (doc * 7919 + i * 104729 + (i * i) % 13) % 300


def tail_token(seed: int, i: int) -> int:
    return 1 + (seed * 31 + i * 17) % 97


def prompt(doc: int, prefix: int, seed: int, tail: int) -> tuple[int, ...]:
    return tuple(document_token(doc, i) for i in range(prefix)) + tuple(tail_token(seed, i) for i in range(tail))


@st.composite
def scenarios(draw, *, model=TINY64, max_requests: int = 6, policies=POLICIES, max_arrival: int = 6):
    tpb = draw(st.sampled_from((4, 8)))
    chunked = draw(st.sampled_from((True, True, True, False)))
    config = make_config(
        max_num_tokens=draw(st.integers(3, 8)) * tpb,
        max_batch_size=draw(st.integers(2, 8)),
        max_seq_len=128,
        enable_chunked_prefill=chunked,
        tokens_per_block=tpb,
        num_blocks=draw(st.integers(96, 240)) // tpb,
        enable_partial_reuse=draw(st.booleans()),
        token_budget_policy=draw(st.sampled_from(policies)),
        capacity_scheduler_policy=draw(st.sampled_from(CapacitySchedulerPolicy)),
        context_chunking_policy=draw(st.sampled_from(ContextChunkingPolicy)),
    )
    arrivals = []
    for i in range(draw(st.integers(1, max_requests))):
        prefix = draw(st.integers(0, 56))
        tokens = prompt(draw(st.integers(0, 1)), prefix, draw(st.integers(0, 3)), draw(st.integers(0 if prefix else 1, 20)))
        at = draw(st.integers(0, max_arrival))
        cancel = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(at, at + 8)))
        arrivals.append(Arrival(at, 1000 + i, tokens, draw(st.integers(1, 5)), cancel))
    return Scenario(config, tuple(arrivals), model, host_blocks=draw(st.sampled_from((0, 0, 6))))


def forced_scenario(policy: str, *, model=TINY64, host_blocks: int = 0, num_blocks: int = 40) -> Scenario:
    """The hard cases on purpose, under a 16-token budget of 4-token blocks.

    Four identical 16-token prompts arrive together while their prompt is fully cached (a
    whole-prompt hit): upstream's estimate calls each one 16 reusable tokens and charges 1,
    but a claim stops at 15, so without partial reuse each recomputes a whole block and the
    batch overshoots under ``none``; ``recheck`` defers what its full cost cannot fit and
    ``claim`` what its exact cost cannot. A 40-token prompt runs in chunks beside them, and
    two later prompts share a prefix with each other (tests assert all of this happened).
    """
    config = make_config(
        max_num_tokens=16, tokens_per_block=4, num_blocks=num_blocks, max_seq_len=128, token_budget_policy=policy,
        enable_partial_reuse=False,
    )
    cached = prompt(0, 16, 0, 0)
    arrivals = (
        Arrival(0, 100, cached, 8),
        Arrival(1, 101, prompt(1, 0, 3, 40), 3),
        *(Arrival(2, 102 + i, cached, 4) for i in range(4)),
        Arrival(3, 106, prompt(0, 14, 2, 5), 3),
        Arrival(4, 107, prompt(1, 30, 0, 0), 2),
        Arrival(4, 108, prompt(1, 30, 1, 3), 2),
    )
    return Scenario(config, arrivals, model, host_blocks)
