"""Hypothesis strategies for the property tests: random KV states, active sets and batches.

A strategy draws a *recipe*: frozen plain data (sizes, switches, prompts, a history of
requests run before the batch, the batch's picks). :func:`realize` builds the world a
recipe describes (config, KV manager, engine, scheduler, requests) and :func:`run_recipe`
runs its one batch through :func:`invariants.run_batch`. Realizing is deterministic, so
a shrunk recipe rebuilds the very batch that failed, and recipes print compactly.

Prompts are built from a few fixed "documents" so that they share prefixes of any
overlap, aligned or not: ``doc1[:13]+tail4[:3]`` is the first 13 tokens of document 1
followed by 3 tokens of tail 4. Equal (doc, prefix, tail seed, tail length) is an
identical repeat; a prompt with no document prefix and a long tail is unrelated to
everything else (it evicts).

History steps (run one request at a time, outside any token budget, through the real
KV manager) populate the prefix tree and hold blocks:

=========  ================================================================================
finish     run the whole prompt and a few generation steps, free: its blocks stay cached
           (and age in LRU; later allocations evict or offload them)
context    run some non-last chunks; the request stays active mid-prompt (a non-first chunk)
generate   run the prompt (and a few steps); the request stays active in generation,
           possibly with beams, draft tokens, or about to run its first-draft step
=========  ================================================================================
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from tests.helpers.factories import (
    is_servable,
    make_config,
    make_kv_cache_manager,
    make_request,
    make_request_limits,
    make_resource_manager,
    make_scheduler,
    make_sim_engine,
    make_torch_engine,
    run_alone,
)
from hypothesis import settings
from hypothesis import strategies as st
from tests.helpers.invariants import BatchOutcome, format_batch, run_batch

from tensorrt_llm._torch.pyexecutor.config import CapacitySchedulerPolicy, ContextChunkingPolicy, ExecutorConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import ModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler
from tensorrt_llm._torch.pyexecutor.budget.policies import reuse_discounted_charge

POLICIES = ("none", "trim", "fit", "recheck", "claim")
SAFE_POLICIES = ("recheck", "claim")  # the ones that claim no overshoot
NUM_DOCUMENTS = 2
TAIL_SEEDS = 6


def examples(fraction: float, floor: int) -> int:
    """A share of the active profile's ``max_examples``, never below ``floor``."""
    return max(floor, int(settings().max_examples * fraction))


def document_token(doc: int, i: int) -> int:
    """Token ``i`` of document ``doc``: documents differ from each other at every position."""
    return 200 + (doc * 7919 + i * 104729 + (i * i) % 13) % 700


def tail_token(seed: int, i: int) -> int:
    """Tail tokens live in [1, 98), apart from document tokens; one seed's tails are prefixes of each other."""
    return 1 + (seed * 31 + i * 17) % 97


# ---- recipes ---------------------------------------------------------------------------


class _ReadableRepr:
    """Hypothesis prints dataclasses field by field; these read better as their short repr."""

    __slots__ = ()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


@dataclass(frozen=True, slots=True)
class Prompt(_ReadableRepr):
    doc: int  # -1: no document prefix
    prefix: int  # tokens taken from the document
    seed: int
    tail: int  # tokens of tail ``seed``

    @property
    def length(self) -> int:
        return self.prefix + self.tail

    def tokens(self) -> list[int]:
        head = [document_token(self.doc, i) for i in range(self.prefix)] if self.doc >= 0 else []
        return head + [tail_token(self.seed, i) for i in range(self.tail)]

    def __repr__(self) -> str:
        head = f"doc{self.doc}[:{self.prefix}]" if self.doc >= 0 and self.prefix else ""
        tail = f"tail{self.seed}[:{self.tail}]" if self.tail else ""
        return "+".join(p for p in (head, tail) if p) or "<empty>"


@dataclass(frozen=True, slots=True)
class RequestSpec(_ReadableRepr):
    prompt: Prompt
    beam_width: int = 1
    drafts: int = 0  # draft tokens it carries (generation steps and its last context chunk)
    first_draft: int = 0  # max_draft_len of a speculative request; its first generation step is padded
    max_new_tokens: int = 4
    deferred_before: bool = False  # arrives owing a budget deferral (recheck only)

    def build(self, request_id: int) -> LlmRequest:
        request = make_request(
            self.prompt.tokens(),
            request_id=request_id,
            max_new_tokens=self.max_new_tokens,
            beam_width=self.beam_width,
            max_draft_len=max(self.first_draft, self.drafts),
            is_first_draft=self.first_draft > 0,
        )
        request.py_draft_tokens = [tail_token(request_id, 50 + i) for i in range(self.drafts)]
        return request

    def __repr__(self) -> str:
        extra = "".join(
            (
                f" beam={self.beam_width}" if self.beam_width > 1 else "",
                f" drafts={self.drafts}" if self.drafts else "",
                f" first_draft={self.first_draft}" if self.first_draft else "",
                " deferred_before" if self.deferred_before else "",
            )
        )
        return f"Req({self.prompt!r} max_new={self.max_new_tokens}{extra})"


@dataclass(frozen=True, slots=True)
class HistoryStep(_ReadableRepr):
    kind: str  # "finish" | "context" | "generate"
    request: RequestSpec
    amount: int  # finish/generate: generation steps run; context: chunk units computed

    def __repr__(self) -> str:
        return f"{self.kind}({self.request!r}, {self.amount})"


@dataclass(frozen=True, slots=True)
class Setting(_ReadableRepr):
    tokens_per_block: int
    num_blocks: int
    host_blocks: int
    enable_block_reuse: bool
    enable_partial_reuse: bool
    enable_chunked_prefill: bool
    max_num_tokens: int
    max_batch_size: int
    capacity_policy: CapacitySchedulerPolicy
    chunking_policy: ContextChunkingPolicy

    def config(self, policy: str) -> ExecutorConfig:
        return make_config(
            max_num_tokens=self.max_num_tokens,
            max_batch_size=self.max_batch_size,
            enable_chunked_prefill=self.enable_chunked_prefill,
            tokens_per_block=self.tokens_per_block,
            num_blocks=self.num_blocks,
            host_blocks=self.host_blocks,
            enable_block_reuse=self.enable_block_reuse,
            enable_partial_reuse=self.enable_partial_reuse,
            token_budget_policy=policy,
            capacity_scheduler_policy=self.capacity_policy,
            context_chunking_policy=self.chunking_policy,
        )

    def __repr__(self) -> str:
        reuse = "off" if not self.enable_block_reuse else ("partial" if self.enable_partial_reuse else "on")
        return (
            f"Setting(tpb={self.tokens_per_block} blocks={self.num_blocks} host={self.host_blocks} reuse={reuse}"
            f" chunked={'on' if self.enable_chunked_prefill else 'off'} max_num_tokens={self.max_num_tokens}"
            f" max_batch={self.max_batch_size} {self.capacity_policy.value} {self.chunking_policy.value})"
        )


@dataclass(frozen=True, slots=True)
class BatchRecipe(_ReadableRepr):
    setting: Setting
    policy: str
    history: tuple[HistoryStep, ...]
    arrivals: tuple[RequestSpec, ...]
    order: tuple[int, ...] = ()  # sort keys of the active list (arrival order where equal)
    picks: tuple[tuple[int, int], ...] | None = None  # direct batch: (candidate, chunk units); None: scheduler

    def with_policy(self, policy: str) -> "BatchRecipe":
        return dataclasses.replace(self, policy=policy)

    def __repr__(self) -> str:
        lines = [f"BatchRecipe(policy={self.policy}, {self.setting!r}"]
        lines += [f"  history {i}: {step!r}" for i, step in enumerate(self.history)]
        lines += [f"  arrival {i}: {spec!r}" for i, spec in enumerate(self.arrivals)]
        if any(self.order):
            lines.append(f"  order keys {self.order}")
        lines.append(f"  batch: {'scheduler' if self.picks is None else f'direct picks {self.picks}'})")
        return "\n".join(lines)


def to_source(value) -> str:
    """``value`` (a recipe, or anything in one) as the Python expression that rebuilds it:
    a counter-example a search found can be pinned as a literal."""
    if dataclasses.is_dataclass(value):
        args = ", ".join(
            f"{f.name}={to_source(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default
        )
        return f"{type(value).__name__}({args})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, tuple):
        return "(" + "".join(f"{to_source(v)}, " for v in value) + ")"
    return repr(value)


# ---- realizing a recipe ----------------------------------------------------------------


@dataclass
class World:
    recipe: BatchRecipe
    config: ExecutorConfig
    kv: KVCacheManager
    resources: ResourceManager
    engine: ModelEngine
    scheduler: SimpleScheduler
    active: list[LlmRequest]
    log: list[str] = field(default_factory=list)  # what setting up skipped, and why
    active_before: str = ""  # the active set as the batch found it


def realize(recipe: BatchRecipe, engine: str = "sim") -> World:
    """Build the KV state and active set a recipe describes (deterministic).

    ``engine``: "sim", the simulated engine over a bookkeeping KV manager; "torch", the CPU torch
    engine running :func:`factories.cost_model` over real K/V tensors (the same pool, host tier
    included). The history is bookkeeping either way (its KV content is zeros): what is checked
    is what ``_prepare_tp_inputs`` builds and the engine then runs."""
    config = recipe.setting.config(recipe.policy)
    if engine == "torch":
        kv, engine = make_torch_engine(config)
    else:
        kv = make_kv_cache_manager(config)
        engine = make_sim_engine(config, kv)
    limits = make_request_limits(config, kv, engine)
    sampler = SyntheticSampler(engine.vocab_size)
    unit = config.chunk_unit_size
    world = World(recipe, config, kv, make_resource_manager(config, kv), engine, make_scheduler(config, kv), [])
    ids = iter(range(1_000))
    running: list[LlmRequest] = []
    for step in recipe.history:
        request = step.request.build(next(ids))
        if not is_servable(request, limits, kv):
            world.log.append(f"{step!r}: not servable, skipped")
            continue
        if not _run_history_step(kv, request, step, sampler, unit, config.enable_chunked_prefill):
            world.log.append(f"{step!r}: ran out of blocks, dropped")
            kv.free(request)
            continue
        if step.kind == "finish":
            kv.free(request)
        else:
            running.append(request)
    arrivals = []
    for spec in recipe.arrivals:
        request = spec.build(next(ids))
        if not is_servable(request, limits, kv):
            world.log.append(f"{spec!r}: not servable, skipped")
            continue
        if spec.deferred_before and recipe.policy in SAFE_POLICIES:
            request.record_budget_deferral()  # as the executor records a deferral
        arrivals.append(request)
    active = running + arrivals
    keys = list(recipe.order) + [0] * len(active)
    world.active = [r for _, _, r in sorted((keys[i], i, r) for i, r in enumerate(active))]
    world.active_before = repr(world.active)
    return world


def _run_history_step(kv, request, step, sampler, unit: int, chunked: bool) -> bool:
    """Run one history step; False if its blocks ran out (the caller frees what it holds)."""
    if step.kind == "context" and chunked:  # (without chunked prefill there are no non-first chunks)
        # whole-unit non-last chunks; a reuse shift may still turn one into the last chunk
        for _ in range(max(1, step.amount)):
            if not request.is_context_init_state or request.context_remaining_length <= unit:
                break
            if not run_alone(kv, request, sampler, chunk=unit):
                return False
        return kv.is_allocated(request)
    if not run_alone(kv, request, sampler):  # the whole prompt
        return False
    steps = 0 if step.request.first_draft and step.kind == "generate" else step.amount
    for _ in range(min(steps, request.max_new_tokens - request.num_generated_tokens - 1)):
        if not run_alone(kv, request, sampler):
            return False
    return True


def schedule(world: World) -> ScheduledRequests:
    """The batch: from the real scheduler, or built directly from the recipe's picks."""
    if world.recipe.picks is None:
        scheduled = world.scheduler.schedule_request(world.active)
        for request in scheduled.paused_requests:  # as PyExecutor._schedule
            world.kv.free(request)
            request.pause()
        return scheduled
    return _direct_batch(world)


def _direct_batch(world: World) -> ScheduledRequests:
    """Requests and chunk sizes as picked, admitted while upstream's (reuse-discounted) charges fit."""
    config, kv = world.config, world.kv
    unit, budget = config.chunk_unit_size, config.max_num_tokens
    chunks: list[ContextChunk] = []
    generation = []
    charges: dict[int, int] = {}
    estimates: dict[int, int] = {}
    seen: set[int] = set()
    for index, units in world.recipe.picks or ():
        if not world.active or len(chunks) + len(generation) >= config.max_batch_size:
            break
        request = world.active[index % len(world.active)]
        if request.request_id in seen:
            continue
        seen.add(request.request_id)
        if request.is_context_init_state:
            remaining = request.context_remaining_length
            size = min(units * unit, remaining) if config.enable_chunked_prefill else remaining
            reusable = 0 if kv.is_allocated(request) else kv.match(request).reusable_tokens
            charge = reuse_discounted_charge(size, remaining, reusable)
            if charge > budget:
                continue
            chunks.append(ContextChunk.of(request, size))
            if not kv.is_allocated(request):
                estimates[request.request_id] = reusable
        else:
            charge = request.beam_width + request.num_draft_tokens
            if charge > budget:
                continue
            generation.append(request)
        budget -= charge
        charges[request.request_id] = charge
    return ScheduledRequests(
        context_chunks=chunks, generation_requests=generation, charges=charges, estimated_reusable=estimates
    )


def run_recipe(recipe: BatchRecipe, engine: str = "sim") -> tuple[World, BatchOutcome]:
    """Realize, schedule and run the batch once; with ``engine="torch"`` the engine runs its forward."""
    world = realize(recipe, engine)
    outcome = run_batch(schedule(world), world.resources, world.engine, forward=engine == "torch")
    return world, outcome


def describe(world: World, outcome: BatchOutcome) -> str:
    """A counter-example as a person reads it: the recipe, what setting up did, the batch."""
    parts = [repr(world.recipe)]
    if world.log:
        parts.append("set-up notes: " + "; ".join(world.log))
    parts.append(f"active set before the batch: {world.active_before}")
    parts.append(format_batch(outcome))
    return "\n".join(parts)


# ---- strategies ------------------------------------------------------------------------
# Draws are kept few and plain (integers, booleans): generation, not running a batch, is
# what an example costs, and plain integers shrink to readable recipes.

_TOKENS_PER_BLOCK = st.one_of(st.integers(1, 8), st.sampled_from([16, 32, 64]))
_POLICIES_BY_CAPACITY = st.sampled_from(CapacitySchedulerPolicy)
_CHUNKING_POLICIES = st.sampled_from(ContextChunkingPolicy)


@st.composite
def kv_settings(
    draw,
    *,
    chunked: bool | None = None,
    reuse: bool | None = None,
    partial: bool | None = None,
    host: bool | None = None,
    max_blocks: int = 48,
) -> Setting:
    """Pool down to a few blocks, host tier on or off, budgets down to a handful of tokens."""
    tpb = draw(_TOKENS_PER_BLOCK)
    chunked = draw(st.booleans()) if chunked is None else chunked
    reuse = draw(st.integers(0, 3)) > 0 if reuse is None else reuse  # mostly on: that is where the bug lives
    partial = reuse and (draw(st.booleans()) if partial is None else partial)
    host = draw(st.booleans()) if host is None else host
    if chunked:  # ExecutorConfig: max_num_tokens >= chunk_unit_size (= tokens_per_block)
        max_num_tokens = draw(st.integers(tpb, 8 * tpb))
    else:
        max_num_tokens = draw(st.integers(1, 10 * tpb))
    return Setting(
        tokens_per_block=tpb,
        num_blocks=draw(st.integers(2, max_blocks)),
        host_blocks=draw(st.integers(1, 12)) if host else 0,
        enable_block_reuse=reuse,
        enable_partial_reuse=partial,
        enable_chunked_prefill=chunked,
        max_num_tokens=max_num_tokens,
        max_batch_size=draw(st.integers(1, 16)),
        capacity_policy=draw(_POLICIES_BY_CAPACITY),
        chunking_policy=draw(_CHUNKING_POLICIES),
    )


def _tokens(draw, tpb: int, max_blocks: int) -> int:
    """A token count of up to ``max_blocks`` blocks, block-aligned about half the time."""
    return draw(st.integers(0, max_blocks)) * tpb + max(0, draw(st.integers(1 - tpb, tpb - 1)))


def draw_prompt(draw, setting: Setting, earlier: list[Prompt]) -> Prompt:
    """A prefix of a document plus a tail; an unrelated prompt; or a repeat / extension of an earlier one.

    Lengths stay within what the pool can hold, so most requests are servable.
    """
    tpb = setting.tokens_per_block
    max_blocks = max(1, min(8, setting.num_blocks - 2))
    kind = draw(st.integers(0, 5))
    if earlier and kind <= 2:
        base = earlier[draw(st.integers(0, len(earlier) - 1))]
        if kind < 2:
            return base  # identical repeat
        return dataclasses.replace(base, tail=base.tail + draw(st.integers(1, 2 * tpb)))  # grows past it
    if kind == 3:  # unrelated to everything; when long, its allocation evicts
        return Prompt(-1, 0, draw(st.integers(0, TAIL_SEEDS - 1)), max(1, _tokens(draw, tpb, max_blocks)))
    prompt = Prompt(
        doc=draw(st.integers(0, NUM_DOCUMENTS - 1)),
        prefix=_tokens(draw, tpb, max_blocks),
        seed=draw(st.integers(0, TAIL_SEEDS - 1)),
        tail=max(0, draw(st.integers(-2 * tpb, 2 * tpb))),
    )
    return prompt if prompt.length else dataclasses.replace(prompt, tail=1)


def draw_request(draw, setting: Setting, earlier: list[Prompt], *, max_new_tokens: int = 1) -> RequestSpec:
    """Beam widths 1-4; draft tokens 1-4; first-draft requests (max_draft_len 1-4); plain half the time."""
    prompt = draw_prompt(draw, setting, earlier)
    earlier.append(prompt)
    kind = draw(st.integers(0, 14))  # 0-4 plain, 5-7 beams 2-4, 8-11 drafts 1-4, 12-14 first-draft 1-3
    return RequestSpec(
        prompt,
        beam_width=kind - 3 if 5 <= kind <= 7 else 1,
        drafts=kind - 7 if 8 <= kind <= 11 else 0,
        first_draft=kind - 11 if kind >= 12 else 0,
        max_new_tokens=max_new_tokens + draw(st.integers(0, 4)),
    )


def _blocks_left_by(history: list[HistoryStep], tpb: int) -> int:
    """Distinct prompt blocks the history leaves in the tree, plus one growth block per running request."""
    blocks: set[tuple[int, ...]] = set()
    for step in history:
        tokens = step.request.prompt.tokens()
        blocks.update(tuple(tokens[:end]) for end in range(tpb, len(tokens) + 1, tpb))
    return len(blocks) + sum(step.kind != "finish" for step in history)


@st.composite
def request_specs(draw, setting: Setting, earlier: tuple[Prompt, ...] = ()) -> RequestSpec:
    return draw_request(draw, setting, list(earlier))


def draw_eviction_shape(draw, setting: Setting) -> tuple[list[HistoryStep], list[RequestSpec]]:
    """Reuse that vanishes through eviction: a cold cached prefix, newer cached filler, then a
    batch whose unrelated first chunks come before the request counting on that prefix.

    The unrelated prompts are short enough to be admitted whole (as long prompts are at a
    production ``max_num_tokens``), so the budget has room left for the discounted reuser.
    """
    tpb = setting.tokens_per_block
    cold = Prompt(draw(st.integers(0, NUM_DOCUMENTS - 1)), _tokens(draw, tpb, 5) + tpb, 0, 0)
    history = [HistoryStep("finish", RequestSpec(cold, max_new_tokens=1), 0)]
    for seed in range(draw(st.integers(1, 3))):  # newer in LRU than the cold prefix
        filler = Prompt(-1, 0, seed, max(1, _tokens(draw, tpb, 4)))
        history.append(HistoryStep("finish", RequestSpec(filler, max_new_tokens=1), 0))
    arrivals = []
    for seed in range(3, 3 + draw(st.integers(1, 2))):
        unrelated = Prompt(-1, 0, seed, draw(st.integers(1, max(1, setting.max_num_tokens - 1))))
        arrivals.append(RequestSpec(unrelated, max_new_tokens=1 + draw(st.integers(0, 3))))
    reuser = dataclasses.replace(cold, seed=draw(st.integers(0, TAIL_SEEDS - 1)), tail=draw(st.integers(0, 2 * tpb)))
    arrivals.append(RequestSpec(reuser, max_new_tokens=1 + draw(st.integers(0, 3))))
    if draw(st.booleans()):
        arrivals.append(draw_request(draw, setting, [cold]))
    return history, arrivals


@st.composite
def batch_recipes(
    draw,
    *,
    policy: str | st.SearchStrategy[str] = "recheck",
    direct: bool | None = False,
    setting: st.SearchStrategy[Setting] | None = None,
    max_history: int = 6,
    max_arrivals: int = 5,
    history_kinds: tuple[str, ...] = ("finish", "finish", "context", "generate"),
) -> BatchRecipe:
    """A KV state built by a random history, an active set, and one batch.

    ``direct``: False, the real scheduler of ``policy`` builds the batch from the active set
    (its own reuse-discounted admission); True, the batch is picked directly, admitted
    while upstream's charges fit the budget; None, either.
    """
    policy = policy if isinstance(policy, str) else draw(policy)
    setting_ = draw(setting if setting is not None else kv_settings())
    earlier: list[Prompt] = []
    history: list[HistoryStep] = []
    arrivals: list[RequestSpec] = []
    evicting = "finish" in history_kinds and max_arrivals > 0 and draw(st.integers(0, 2)) == 0
    if evicting:
        history, arrivals = draw_eviction_shape(draw, setting_)
    else:
        for _ in range(draw(st.integers(0, max_history))):
            kind = history_kinds[draw(st.integers(0, len(history_kinds) - 1))]
            amount = draw(st.integers(0, 3))
            # a request that must still be running when the batch comes has tokens left to generate
            spec = draw_request(draw, setting_, earlier, max_new_tokens=1 if kind == "finish" else amount + 2)
            history.append(HistoryStep(kind, spec, amount))
    if evicting or draw(st.booleans()):
        # eviction pressure: a pool about as large as what the history leaves cached or
        # holds, so the batch's allocations evict (or offload) cached prefixes
        pool = _blocks_left_by(history, setting_.tokens_per_block) + draw(st.integers(-2, 4))
        setting_ = dataclasses.replace(setting_, num_blocks=max(2, pool))
    running = any(step.kind != "finish" for step in history)
    for _ in range(draw(st.integers(0 if arrivals or running or not max_arrivals else 1, max_arrivals))):
        arrivals.append(draw_request(draw, setting_, earlier))
    if policy in SAFE_POLICIES:  # some arrive owing a budget deferral
        arrivals = [dataclasses.replace(a, deferred_before=draw(st.integers(0, 4)) == 0) for a in arrivals]
    n = len(history) + len(arrivals)
    order = tuple(draw(st.integers(0, 2)) for _ in range(n)) if draw(st.booleans()) else ()
    picks = None
    if direct or (direct is None and draw(st.booleans())):
        picks = tuple((draw(st.integers(0, n)), draw(st.integers(1, 8))) for _ in range(draw(st.integers(1, n + 2))))
    return BatchRecipe(setting_, policy, tuple(history), tuple(arrivals), order, picks)
