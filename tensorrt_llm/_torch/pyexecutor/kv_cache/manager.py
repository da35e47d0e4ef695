"""``KVCacheManager``: per-request block tables over a :class:`BlockPool`, with prefix reuse.

The KV manager answers questions about memory and allocates; it knows nothing of token
budgets. It has a few verbs, in vLLM's shape, and queries that change nothing::

    match(request) ─► PrefixMatch             what a waiting prompt matches now (nothing claimed)
    allocate(chunk, claim) ─► Allocation | None   one request's blocks, all or nothing
    commit(scheduled)                         after a forward: computed full blocks join the tree
    free(request)                             every block back, leaves first
    available_blocks                          what an allocation could obtain now

* ``allocate(chunk, claim)``: a first chunk walks the prefix tree, claims what matches (at
  most ``prompt_len - 1`` tokens: the last prompt token is always computed, to get logits),
  copies a partly matching block (partial reuse), onboards host blocks, and allocates fresh
  blocks for the whole prompt; its chunk window moves onto the reused prefix. A later chunk,
  or a generation request's next step, grows its sequence. All or nothing: None when the
  blocks cannot be had, and then nothing stays claimed. ``prepare_resources(scheduled)``,
  upstream's name (DESIGN.md §4), allocates a batch this way, one request after another in
  batch order, and returns a :class:`KVAllocation`: the batch as allocated, the deferred
  requests and what each first chunk claimed.
* ``commit(scheduled)``: after a forward, full blocks that now hold computed KV are committed
  to the prefix tree, so later requests can reuse them.
* ``free(request)``: blocks go back, leaves first, so that LRU eviction takes the deepest
  blocks of a prefix before its root.

``ResourceManager`` calls the last two from upstream's ``update_resources`` and
``free_resources``. ``claim_prefix`` / ``release_claim`` pin a first chunk's matched prefix
ahead of its allocation (claim-then-charge); the claim is a value the caller hands back to
``allocate``. The capacity scheduler's block counts are queries too: ``blocks_needed`` (a
waiting request), ``blocks_reserved_to_completion`` and ``step_needs`` (started ones).

``match(request)`` answers, before anything is claimed, what a waiting request's prompt
matches now, as a :class:`PrefixMatch` value: upstream's pre-allocation estimate (full prompt
blocks that exactly match cached blocks, either tier, with no ``prompt_len - 1`` limit and no
regard for what allocation may evict first: the gap between it and the claim is the bug),
and the blocks a claim would share with started requests. Each request's last walk is kept
in the :class:`PrefixIndex`, an exact memo, so the next match resumes it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tensorrt_llm._torch.pyexecutor.kv_cache.beam_tables import BeamTables
from tensorrt_llm._torch.pyexecutor.kv_cache.block_pool import TOKEN_BYTES, BlockPool, BlockTokens, KVBlock
from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm._torch.pyexecutor.forward_cost import forward_cost
from tensorrt_llm._torch.pyexecutor.llm_request import (
    IN_FLIGHT_TOKEN_ID,
    TOKEN_TYPECODE,
    LlmRequest,
    LlmRequestState,
    num_in_flight_tokens,
)
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk, ScheduledRequests

if TYPE_CHECKING:  # the tensors: only engines that run a model read them (the KV manager imports no torch)
    from tensorrt_llm._torch.pyexecutor.kv_cache.storage import KVCacheStorage

logger = logging.getLogger(__name__)

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_ID_LIMIT = 1 << 32  # token ids key the tree as unsigned 32-bit ints
_FOLD = np.uint32(16)  # content_hashes folds a hash's high half into its low one


def pack_tokens(tokens: array | Sequence[int]) -> np.ndarray:
    """``tokens`` as the prefix tree keys them: native unsigned 32-bit ids (``.tobytes()`` of a
    block's slice is its :data:`~block_pool.BlockTokens`).

    Takes a packed token array (``LlmRequest.tokens`` or a slice of it: viewed, one numpy
    conversion) or a sequence of ints; raises ValueError unless every id is an int in [0, 2**32).
    """
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:  # every prompt: one reduction checks it
        ids = np.frombuffer(tokens, dtype=np.int64)
        if ids.size and ids.view(np.uint64).max() >= _ID_LIMIT:  # a negative id, seen unsigned, is above 2**63
            raise ValueError(f"token ids must be ints in [0, 2**32) to key the prefix tree, got {tokens!r:.80}")
        return ids.astype(np.uint32)
    ids = np.asarray(tokens) if len(tokens) else np.empty(0, dtype=np.int64)
    if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= _ID_LIMIT)):
        raise ValueError(f"token ids must be ints in [0, 2**32) to key the prefix tree, got {tokens!r:.80}")
    return ids.astype(np.uint32)


@functools.lru_cache(maxsize=8)
def _hash_weights(tokens_per_block: int) -> np.ndarray:
    """One fixed odd 32-bit weight per position in a block (the same in every process)."""
    rng = np.random.default_rng(0x6B765F68617368)
    return rng.integers(0, 1 << 31, size=tokens_per_block, dtype=np.uint32) * np.uint32(2) + np.uint32(1)


def content_hashes(packed: np.ndarray, num_blocks: int, tokens_per_block: int) -> list[int]:
    """The default block hash of the first ``num_blocks`` blocks of ``packed`` (:func:`pack_tokens`), all at once.

    A multilinear hash, ``sum(w[i] * token[i]) mod 2**32`` with its high half folded into the
    low one (dicts index by the low bits): one numpy pass over the whole prompt, with no
    temporary, instead of a Python call per block; and the same in every process (Python's
    ``hash`` of bytes is salted per process; tensor-parallel ranks must take identical
    decisions). A collision costs a comparison only: every hit is verified against the tokens.
    """
    ids = packed[: num_blocks * tokens_per_block]
    h = ids.reshape(num_blocks, tokens_per_block) @ _hash_weights(tokens_per_block)  # uint32, wraps
    h ^= h >> _FOLD
    return h.tolist()


def _unreferenced(block: KVBlock) -> bool:
    return block.ref_count == 0


@dataclass(slots=True)
class _Sequence:
    """The blocks one request holds. ``blocks[:num_committed]`` are tree nodes."""

    blocks: list[KVBlock]
    num_committed: int
    num_computed: int  # tokens whose KV is written
    beam_blocks: list[KVBlock] = field(default_factory=list)  # private tails of beams 1..W-1
    stamp: int = 0  # allocation order
    reserve: int = 0  # blocks it holds at completion (draft slots as at allocation)
    plain: bool = False  # one beam and no draft slots: a generation step needs len(tokens) positions
    capacity: int = 0  # positions ``blocks`` hold (len(blocks) * tokens_per_block)
    # block_id of each of ``blocks``, kept in step with it: a held block never changes slot,
    # so the table only changes where ``blocks`` does (append, commit to a canonical block).
    table: list[int] = field(init=False)
    # Beam search, from the first generation step: every beam's table. ``blocks`` is then beam
    # 0's and ``beam_blocks`` the other beams' blocks that are not in it (each held once).
    beams: BeamTables | None = None

    def __post_init__(self) -> None:
        self.table = [block.block_id for block in self.blocks]

    @property
    def num_held(self) -> int:
        return len(self.blocks) + len(self.beam_blocks)


# The values below are NamedTuples rather than frozen dataclasses: one is made per request
# and iteration (a match per waiting request, an allocation per first chunk), and a frozen
# dataclass's __init__ sets each field through object.__setattr__, about five times the cost.


class PrefixMatch(NamedTuple):
    """What a waiting request's prompt matches in the prefix tree at one moment (nothing claimed).

    ``reusable_tokens``: upstream's admission estimate, full prompt blocks that match cached
    blocks in either tier. ``shared_blocks``: of the blocks a claim could take (at most
    ``prompt_len - 1`` tokens), those started requests hold, which need no pool slot.
    """

    reusable_tokens: int = 0
    shared_blocks: int = 0


NO_MATCH = PrefixMatch()


class PrefixIndex:
    """Each waiting request's last walk of the prefix tree, resumed by its next one.

    Exact, not a guess: a block leaves the tree only with its whole subtree, so the blocks of an
    old chain that were dropped since are a suffix of it (found by bisection); what was
    committed since is found by walking on from the last surviving block. A dropped block's
    object is reused (``BlockPool``): it is out of the tree, or back in it with a ``serial``
    above the pool's serial when the chain was last brought up to date, which tells it apart.
    :meth:`chain` therefore returns ``pool.match(keys)`` as of now, at the cost of what changed.
    An entry lives from a request's first match until it is allocated or freed (:meth:`forget`).
    """

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        # request id -> [prompt_len, chain, keys, the pool's serial when the chain was last brought up to date]
        self._entries: dict[int, list] = {}

    def chain(self, request_id: int, prompt_len: int, keys: list[tuple[int, BlockTokens]]) -> list[KVBlock]:
        """The matched full blocks of a prompt of ``prompt_len`` tokens whose block keys are ``keys``
        (the index's own list: read it, slice it, never change it)."""
        pool = self._pool
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != prompt_len:
            chain = pool.match(keys)
            self._entries[request_id] = [prompt_len, chain, keys, pool.serial]
            return chain
        _, chain, keys, seen = entry  # the chain is updated in place
        if chain and (chain[-1].tokens is None or chain[-1].serial > seen):  # its end left the tree

            def dropped(block: KVBlock) -> bool:  # since ``seen``: out of the tree, or back in it as another block
                return block.tokens is None or block.serial > seen

            del chain[bisect.bisect_left(chain, True, key=dropped) :]
        if len(chain) < len(keys) and (not chain or chain[-1].children):  # else nothing can extend it
            chain += pool.match(keys, chain[-1] if chain else None, start=len(chain))
        entry[3] = pool.serial
        return chain

    def forget(self, request_id: int) -> None:
        self._entries.pop(request_id, None)


@dataclass(slots=True)
class PrefixClaim:
    """A first chunk's pinned reusable prefix, between the claim and the allocation."""

    request_id: int
    chain: list[KVBlock] = field(default_factory=list)  # matched full blocks, either tier
    partial: KVBlock | None = None  # primary block to copy a partial match from
    partial_len: int = 0
    reused: int = 0  # tokens the claim reuses: full blocks, then the partial match

    @property
    def pinned(self) -> list[KVBlock]:
        return self.chain + ([self.partial] if self.partial is not None else [])


class ClaimRecord(NamedTuple):
    """What allocation found for a first chunk: the estimate it was admitted with and the claim.
    ``prompt_len``: the prompt looked up, as it was at allocation (a restart makes it longer)."""

    request: LlmRequest
    estimated_reusable_tokens: int
    reused_tokens: int
    prompt_len: int
    onboarded_tokens: int = 0  # of the reused tokens, those whose blocks came back from the host tier

    @property
    def request_id(self) -> int:
        return self.request.request_id


class Allocation(NamedTuple):
    """What :meth:`KVCacheManager.allocate` got for one request. ``chunk``: a context chunk as
    allocated (a first chunk moved onto the prefix it reused, ``chunk.reused`` tokens), None for
    a generation step; ``first``: the chunk started the sequence (it claimed its prefix)."""

    chunk: ContextChunk | None = None
    first: bool = False
    onboarded: int = 0  # a first chunk's claimed blocks that were onboarded from the host tier


_STEP = Allocation()  # a generation step's: nothing to tell but that it got its blocks


class StepNeed(NamedTuple):
    """A started request's next forward, for the capacity scheduler: the blocks it still needs
    and the blocks it holds (what pausing it gives back)."""

    request: LlmRequest
    blocks: int
    held: int


class KVAllocation(NamedTuple):
    """What ``prepare_resources`` did: the batch as allocated (first chunks' windows moved
    onto their reused prefixes), the requests whose blocks could not be had (untouched),
    and, per first chunk allocated, its reuse estimate and claim."""

    scheduled: ScheduledRequests
    deferred: list[LlmRequest]
    claims: list[ClaimRecord]


class KVCacheManager:
    """Block tables, prefix reuse and the host tier; optionally backed by real K/V tensors.

    ``storage`` is None in bookkeeping-only mode (simulation): every decision is the same,
    only no tensor moves. ``block_hash`` keys the prefix tree: a function of a block's packed
    tokens (:data:`~block_pool.BlockTokens`), for tests that force collisions. The default
    (``None``) is :func:`content_hashes`, computed for a whole prompt at once and the same in
    every process, which tensor-parallel ranks rely on to take identical decisions (Python's
    ``hash`` of bytes is salted per process: do not pass it where ranks must agree).
    """

    def __init__(
        self,
        config: KvCacheConfig,
        *,
        num_blocks: int,
        num_host_blocks: int = 0,
        storage: KVCacheStorage | None = None,
        block_hash: Callable[[BlockTokens], int] | None = None,
    ) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.enable_block_reuse = config.enable_block_reuse
        self.enable_partial_reuse = config.enable_block_reuse and config.enable_partial_reuse
        self.storage = storage
        self.pool = BlockPool(num_blocks, num_host_blocks, storage=storage)
        self.block_hash = block_hash
        self._sequences: dict[int, _Sequence] = {}
        # request id -> the positions a generation step may reach with the blocks it holds: a
        # plain sequence's capacity, -1 for the others (their every step allocates). Kept beside
        # the sequences so that prepare_resources finds the few steps that need a block with
        # one lookup per request (checked by check_integrity).
        self._step_room: dict[int, int] = {}
        # request id -> (prompt_len, its full prompt blocks' keys, the whole prompt packed)
        self._keys: dict[int, tuple[int, list[tuple[int, BlockTokens]], bytes]] = {}
        self.prefix_index = PrefixIndex(self.pool)  # waiting requests' last walks (match, claim)
        self._stamps = itertools.count()
        self._claims: dict[int, PrefixClaim] = {}  # outstanding claims (pinned, not yet allocated)
        self._reserved = 0  # sum over sequences of the blocks they still need to completion
        if config.offload_ahead_blocks >= num_blocks:
            raise ValueError(f"KvCacheConfig.offload_ahead_blocks={config.offload_ahead_blocks} must be below the"
                             f" pool's {num_blocks} blocks")
        if config.offload_ahead_blocks and not num_host_blocks:
            raise ValueError(f"KvCacheConfig.offload_ahead_blocks={config.offload_ahead_blocks} needs a host tier of at"
                             f" least one block; host_cache_size={config.host_cache_size} bytes holds none")

    # ---- queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation could obtain now: free ones and cached ones it may evict."""
        return self.pool.available

    def is_allocated(self, request: LlmRequest) -> bool:
        return request.request_id in self._sequences

    def split_allocated(self, requests: Sequence[LlmRequest]) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """``requests`` that hold blocks and those that do not, each in the given order."""
        sequences = self._sequences
        allocated = [r for r in requests if r.request_id in sequences]
        if len(allocated) == len(requests):
            return allocated, []
        return allocated, [r for r in requests if r.request_id not in sequences]

    def _reuses(self, request: LlmRequest) -> bool:
        """Whether ``request`` may claim cached blocks: not one that asks for its prompt's
        log-probabilities, whose every prompt position must be computed to have logits."""
        return self.enable_block_reuse and request.sampling_config.prompt_logprobs is None

    def reuse_can_shift(self, request: LlmRequest) -> bool:
        """True while allocation may still move this request's chunk window (unclaimed first chunk, reuse on)."""
        rid = request.request_id
        return self._reuses(request) and rid not in self._sequences and rid not in self._claims

    def num_held_blocks(self, request: LlmRequest) -> int:
        seq = self._sequences.get(request.request_id)
        return 0 if seq is None else seq.num_held

    def block_table(self, request: LlmRequest) -> list[int]:
        return list(self._sequences[request.request_id].table)

    def beam_block_tables(self, request: LlmRequest) -> list[list[int]]:
        """One block table per beam of a beam-search request in generation (beam 0's is
        :meth:`block_table`); before its first generation step, and for one beam, ``[block_table]``."""
        seq = self._sequences[request.request_id]
        if seq.beams is None:
            return [list(seq.table)]
        return [seq.beams.table_ids(beam) for beam in range(seq.beams.beam_width)]

    def fork_beams(self, request: LlmRequest, parents: Sequence[int]) -> None:
        """After a beam-search step: new beam ``j`` continues old beam ``parents[j]``
        (``BeamStep.parents``). The blocks only dropped beams held go back to the pool; they
        were never committed to the prefix tree, so no cached block holds a dropped beam's tokens.
        Nothing to do before the request's beam tables exist (its first step forks from the prompt)."""
        seq = self._sequences.get(request.request_id)
        if seq is None or seq.beams is None:
            return
        before = max(0, seq.reserve - seq.num_held)
        dropped = seq.beams.fork(parents)
        if not dropped:
            return
        self._sync_beams(seq)
        self.pool.release(dropped)
        self._reserved += max(0, seq.reserve - seq.num_held) - before

    def releasable_blocks(self, request: LlmRequest) -> int:
        """Blocks that freeing ``request`` now would make available: those it holds alone
        (a block another sequence or a claim also holds stays held)."""
        seq = self._sequences.get(request.request_id)
        if seq is None:
            return 0
        return sum(block.ref_count == 1 for block in (*seq.blocks, *seq.beam_blocks))

    def blocks_needed(self, request: LlmRequest, match: PrefixMatch = NO_MATCH, *, to_completion: bool = True) -> int:
        """Blocks a request that holds none needs: for its whole sequence to completion (draft
        slots and beams included), or for its prompt only; less the blocks ``match`` says it
        would share with started requests (those need no pool slot)."""
        length = self._max_sequence_len(request) if to_completion else request.prompt_len
        return max(0, self._blocks_for_tokens(request, length) - match.shared_blocks)

    @property
    def reserved_blocks(self) -> int:
        """The blocks every request that holds blocks still needs to completion, summed (O(1))."""
        return self._reserved

    def blocks_reserved_to_completion(self, started: Sequence[LlmRequest]) -> int:
        """The blocks requests that hold blocks still need to completion, summed; O(1) when
        ``started`` is every such request (kept as a running total)."""
        if len(started) == len(self._sequences):  # distinct allocated requests: all of them
            return self._reserved
        sequences = self._sequences
        return sum(max(0, seq.reserve - seq.num_held) for seq in (sequences[r.request_id] for r in started))

    def step_needs(self, started: Sequence[LlmRequest]) -> list[StepNeed]:
        """Each request that holds blocks, in the order they started (MAX_UTILIZATION pauses the
        latest): the blocks its next forward still needs (a later chunk: its whole remaining
        prompt, the most a chunk can be) and the blocks it holds."""
        sequences = self._sequences
        needs = []
        for request in sorted(started, key=lambda r: sequences[r.request_id].stamp):
            seq = sequences[request.request_id]
            if request.state is _CONTEXT_INIT:
                needed_len = request.prompt_len + request.num_draft_tokens
            else:
                needed_len = self._generation_len(request)
            blocks = max(0, self._blocks_for_tokens(request, needed_len) - seq.num_held)
            needs.append(StepNeed(request, blocks, seq.num_held))
        return needs

    def _blocks_for_tokens(self, request: LlmRequest, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` positions holds, beams included."""
        blocks = _ceil_div(num_tokens, self.tokens_per_block)
        if request.beam_width > 1:  # beams share full prompt blocks and own everything after
            blocks += (request.beam_width - 1) * max(0, blocks - request.prompt_len // self.tokens_per_block)
        return blocks

    @staticmethod
    def _max_sequence_len(request: LlmRequest) -> int:
        """Positions a request may hold before it finishes, draft slots included."""
        return request.max_total_len + max(request.max_draft_len, request.num_draft_tokens)

    def match(self, request: LlmRequest) -> PrefixMatch:
        """What ``request``'s prompt matches now (:class:`PrefixMatch`); no match once it holds blocks.
        Nothing is claimed: the capacity scheduler asks it for every waiting request it admits."""
        if (not self.enable_block_reuse or request.sampling_config.prompt_logprobs is not None  # _reuses, inlined
                or request.request_id in self._sequences):
            self.prefix_index.forget(request.request_id)
            return NO_MATCH
        chain = self.prefix_index.chain(request.request_id, request.prompt_len, self._prompt_keys(request))
        # A claim matches at most prompt_len - 1 tokens; match() of a prefix of the keys is
        # the same prefix of the chain. Whoever holds a block holds its ancestors, so the
        # held blocks of a chain are a prefix of it: found by bisection.
        claimable = min(len(chain), (request.prompt_len - 1) // self.tokens_per_block)
        if not claimable or chain[0].ref_count == 0:
            shared = 0
        elif chain[claimable - 1].ref_count:  # the usual hit: a started request holds the whole prefix
            shared = claimable
        else:
            shared = bisect.bisect_left(chain, True, 1, claimable - 1, key=_unreferenced)
        return PrefixMatch(len(chain) * self.tokens_per_block, shared)

    # ---- verbs ----------------------------------------------------------------------
    def allocate(self, work: ContextChunk | LlmRequest, claim: PrefixClaim | None = None) -> Allocation | None:
        """Blocks for one request's next forward, all or nothing; None when they cannot be had
        (what it held is unchanged, and nothing stays claimed for it).

        ``work`` is a context chunk, or a generation request (its next step, drafts included).
        A first chunk claims its reusable prefix, or takes ``claim`` (pinned by
        :meth:`claim_prefix`; the chunk must already start at it, and the claim is consumed
        either way), onboards it and allocates the rest of the prompt; the :class:`Allocation`
        carries the chunk moved onto the reused prefix. A later chunk grows to its end.
        """
        if not isinstance(work, ContextChunk):
            seq = self._sequences[work.request_id]
            if work.beam_width > 1:  # every beam writes its next position in a block of its own
                return _STEP if self._grow_beams(work, seq) else None
            # A request the drafter withdrew (Drafter.withdraw) is plain from now on: its steps
            # take the fast path of prepare_resources again.
            if not seq.plain and not work.max_draft_len:
                seq.plain = True
                self._step_room[work.request_id] = seq.capacity
            return _STEP if self._grow(work, seq, self._generation_len(work)) else None
        seq = self._sequences.get(work.request.request_id)
        if seq is None:
            allocated = self._allocate_first_chunk(work, claim)
            return Allocation(allocated[0], first=True, onboarded=allocated[1]) if allocated is not None else None
        return Allocation(work) if self._grow(work.request, seq, work.start + work.cost()) else None

    def prepare_resources(
        self, scheduled: ScheduledRequests, claims: Mapping[int, PrefixClaim] | None = None
    ) -> KVAllocation:
        """Allocate the batch, one request after another in batch order (:meth:`allocate` each).

        ``claims`` are prefixes already pinned by :meth:`claim_prefix`, by request id; such
        a first chunk's window must already start at its claim. Every claim handed in is
        consumed: allocated, or released with its request deferred.
        """
        claims = claims or {}
        sequences = self._sequences
        chunks: list[ContextChunk] = []
        deferred: list[LlmRequest] = []
        records: list[ClaimRecord] = []
        for chunk in scheduled.context_chunks:
            request = chunk.request
            allocation = self.allocate(chunk, claims.get(request.request_id))
            if allocation is None:
                logger.debug("request %d deferred: KV blocks unavailable", request.request_id)
                deferred.append(request)
                continue
            chunks.append(allocation.chunk)
            if allocation.first:
                estimate = scheduled.estimated_reusable.get(request.request_id, 0)
                records.append(ClaimRecord(request, estimate, allocation.chunk.reused, request.prompt_len,
                                           allocation.onboarded * self.tokens_per_block))
        generation = scheduled.generation_requests
        # Most steps need no block: a plain sequence whose blocks already cover its next
        # position. Only the others allocate, in batch order.
        room = self._step_room
        growing = [r for r in generation if len(r.tokens) > room[r.request_id] or r.py_draft_tokens]
        if growing:
            short = set()
            for request in growing:
                if self.allocate(request) is None:
                    logger.debug("request %d deferred: KV blocks unavailable", request.request_id)
                    deferred.append(request)
                    short.add(request.request_id)
            if short:
                generation = [r for r in generation if r.request_id not in short]
        return KVAllocation(scheduled.with_batch(chunks, list(generation)), deferred, records)

    def commit(self, scheduled: ScheduledRequests) -> None:
        """Record the KV the forward computed and commit newly full blocks to the prefix tree.

        A generation step fills a block once every ``tokens_per_block`` steps, so a few of a
        batch's sequences fill one in each forward: their blocks are keyed together (one packing
        and hashing pass for all of them) and committed in batch order, as one at a time would."""
        sequences, reuse, tpb = self._sequences, self.enable_block_reuse, self.tokens_per_block
        error = LlmRequestState.ERROR
        for chunk in scheduled.context_chunks:
            seq = sequences.get(chunk.request.request_id)
            if seq is None or chunk.request.state is error:
                continue  # a request that finished in this forward computed its KV: record it
            seq.num_computed = chunk.end
            if reuse:
                self._commit_full_blocks([(chunk.request, seq)])
        filled: list[tuple[LlmRequest, _Sequence]] = []
        for request in scheduled.generation_requests:
            seq = sequences.get(request.request_id)
            if seq is None or request.state is error:
                continue
            # the newest sampled token has no KV yet; neither has a token still in flight
            # (overlap). The common case, nothing in flight, is told by the last token alone:
            # no call per request per iteration.
            tokens = request.tokens
            computed = len(tokens) - 1
            if tokens[-1] == IN_FLIGHT_TOKEN_ID:
                computed -= num_in_flight_tokens(tokens)
            seq.num_computed = computed
            if reuse and computed // tpb > seq.num_committed:  # a block filled up
                filled.append((request, seq))
            if not seq.plain and request.beam_width == 1 and seq.capacity >= len(tokens) + tpb:
                if filled:  # the pool sees every commit and trim in batch order
                    self._commit_full_blocks(filled)
                    filled = []
                self._trim(seq, len(tokens))  # blocks that held only rejected drafts
        if filled:
            self._commit_full_blocks(filled)

    def free(self, request: LlmRequest, *, store_for_reuse: bool = True) -> None:
        """Release every block ``request`` holds; computed full blocks stay cached for reuse."""
        claim = self._claims.get(request.request_id)
        if claim is not None:
            self.release_claim(claim)
        seq = self._sequences.pop(request.request_id, None)
        if seq is not None and store_for_reuse and self.enable_block_reuse:
            self._commit_full_blocks([(request, seq)])
        self._keys.pop(request.request_id, None)
        self.prefix_index.forget(request.request_id)
        if seq is None:
            return
        del self._step_room[request.request_id]
        self._reserved -= max(0, seq.reserve - seq.num_held)
        self.pool.release(seq.beam_blocks)
        self.pool.release(seq.blocks)  # leaves first: they become the oldest in LRU

    def offload_ahead(self) -> int:
        """Keep ``KvCacheConfig.offload_ahead_blocks`` primary blocks free: move least recently used
        cached blocks to the host tier and start their copies now; returns how many moved (0: the
        reserve is off, already free, or nothing cached is left).

        The executor calls it after each launch. An allocation that finds free slots moves
        nothing, so the tier's device-to-host copies then run beside the forward just launched
        rather than right before the forward whose allocation would have evicted them (on CUDA
        that forward waits, on the device, for every copy issued before it). Only unreferenced
        blocks move, never one that a forward in flight or a claim holds; they stay in the
        prefix tree, matchable from the host."""
        reserve = self.config.offload_ahead_blocks
        if not reserve or self.pool.num_free >= reserve:
            return 0
        moved = self.pool.offload_until(reserve)
        if moved and self.storage is not None:
            self.storage.flush()
        return moved

    def check_integrity(self) -> None:
        """The leak oracle: free + cached + held partition the pool; no request holds a foreign block."""
        held = [b for seq in self._sequences.values() for b in (*seq.blocks, *seq.beam_blocks)]
        held += [b for claim in self._claims.values() for b in claim.pinned]
        self.pool.check_integrity(held)
        for request_id, seq in self._sequences.items():
            assert seq.table == [b.block_id for b in seq.blocks], f"request {request_id}: stale block table"
            assert seq.capacity == len(seq.blocks) * self.tokens_per_block, f"request {request_id}: stale capacity"
            assert self._step_room[request_id] == (seq.capacity if seq.plain else -1), f"request {request_id}: stale room"
            if seq.beams is not None:
                seq.beams.check()
                distinct = seq.beams.distinct()
                assert {id(b) for b in distinct} == {id(b) for b in (*seq.blocks, *seq.beam_blocks)} and len(
                    distinct) == seq.num_held, f"request {request_id}: beam tables out of step with its blocks"
        reserved = sum(max(0, seq.reserve - seq.num_held) for seq in self._sequences.values())
        assert self._reserved == reserved, f"reserved-blocks total {self._reserved} != {reserved}"
        assert self._step_room.keys() == self._sequences.keys(), "a step room without its sequence, or the reverse"

    # ---- allocation -----------------------------------------------------------------
    @staticmethod
    def _generation_len(request: LlmRequest) -> int:
        """Positions the sequence must hold for a generation request's next forward."""
        if request.beam_width > 1:  # each beam writes one position
            return len(request.tokens)
        return len(request.tokens) - 1 + forward_cost(request)  # the last token plus any drafts

    def _trim(self, seq: _Sequence, length: int) -> None:
        """Roll back draft slots: release the blocks past the first ``length`` positions.

        After a forward that verified drafts, the sequence's KV is valid up to ``num_computed``
        (its accepted tokens); the positions of rejected drafts hold KV that no later forward
        reads (it is written over when the sequence gets there). Blocks that hold nothing but
        such positions go back to the pool now. They were never committed: only full blocks of
        computed positions are, so no prefix-tree block ever holds a rejected token.
        """
        keep = _ceil_div(length, self.tokens_per_block)
        before = max(0, seq.reserve - seq.num_held)
        rejected = seq.blocks[keep:]
        del seq.blocks[keep:]
        del seq.table[keep:]
        seq.capacity = keep * self.tokens_per_block  # not plain (draft slots): its step room stays -1
        self.pool.release(rejected)
        self._reserved += max(0, seq.reserve - seq.num_held) - before

    def _grow_beams(self, request: LlmRequest, seq: _Sequence) -> bool:
        """A beam-search generation step: every beam writes the position of its newest token, in
        a block of its own (see ``beam_tables``). The first step starts the beams on the prompt's
        blocks; the blocks set aside for the prompt's last partial block at allocation
        (``_blocks_for_tokens`` counts one per extra beam) become the beams' copies of it. All or
        nothing: False, changing nothing, when the blocks cannot be had."""
        tpb = self.tokens_per_block
        position = len(request.tokens) - 1
        beams = seq.beams if seq.beams is not None else BeamTables(seq.blocks, request.beam_width)
        spare = seq.beam_blocks if seq.beams is None else []
        needed = beams.blocks_to_write(position, tpb)
        missing = max(0, needed - len(spare))
        if missing > self.pool.available:
            return False
        before = max(0, seq.reserve - seq.num_held)
        fresh = spare[:needed] + self.pool.allocate_many(missing)
        unused = spare[needed:]
        for source, copy in beams.make_writable(position, tpb, fresh):
            self.pool.copy(source, copy)
        seq.beams = beams
        self._sync_beams(seq)
        self.pool.release(unused)
        self._reserved += max(0, seq.reserve - seq.num_held) - before
        return True

    def _sync_beams(self, seq: _Sequence) -> None:
        """``blocks`` / ``table`` / ``capacity`` are beam 0's; ``beam_blocks`` the rest, each once."""
        beams = seq.beams
        seq.blocks = list(beams.tables[0])
        seq.table = [block.block_id for block in seq.blocks]
        seq.capacity = len(seq.blocks) * self.tokens_per_block
        own = {id(block) for block in seq.blocks}
        seq.beam_blocks = [block for block in beams.distinct() if id(block) not in own]

    def _grow(self, request: LlmRequest, seq: _Sequence, needed_len: int) -> bool:
        """Blocks for ``needed_len`` positions, all or nothing (False, changing nothing, when they
        cannot be had). Every generation step that fills a block comes here: plain arithmetic,
        no calls but the pool's."""
        tpb, blocks = self.tokens_per_block, seq.blocks
        shared = -(-needed_len // tpb) - len(blocks)
        if request.beam_width == 1:  # one table (_blocks_for_tokens is the shared blocks)
            beam = 0
        else:
            beam = self._blocks_for_tokens(request, needed_len) - _ceil_div(needed_len, tpb) - len(seq.beam_blocks)
        if shared <= 0 and beam <= 0:
            return True
        pool = self.pool
        if (shared if shared > 0 else 0) + (beam if beam > 0 else 0) > pool.available:
            return False
        before = seq.reserve - len(blocks) - len(seq.beam_blocks)  # blocks still to reserve, before and after
        if shared > 0:
            fresh = pool.allocate_many(shared)
            blocks += fresh
            seq.table += [block.block_id for block in fresh]
            seq.capacity = len(blocks) * tpb
            if seq.plain:
                self._step_room[request.request_id] = seq.capacity
        if beam > 0:
            seq.beam_blocks += pool.allocate_many(beam)
        after = seq.reserve - len(blocks) - len(seq.beam_blocks)
        self._reserved += (after if after > 0 else 0) - (before if before > 0 else 0)
        return True

    # ---- prefix claims ---------------------------------------------------------------
    def claim_prefix(self, request: LlmRequest) -> PrefixClaim:
        """Pin the reusable prefix of an unallocated first chunk.

        The claim walks the prefix tree for at most ``prompt_len - 1`` tokens (the last
        prompt token is always computed, for its logits), pins the matched blocks so no
        allocation can evict them, and with partial reuse pins the primary block that
        shares the longest prefix with the next block. The chunk's window, once moved onto
        ``claim.reused`` (:meth:`ContextChunk.after_reuse`), has an exact forward cost.
        :meth:`prepare_resources` consumes the claim; :meth:`release_claim` undoes it.
        """
        rid = request.request_id
        assert rid not in self._sequences, f"{request!r} is already allocated"
        existing = self._claims.get(rid)
        if existing is not None:
            return existing
        tpb = self.tokens_per_block
        claim_limit = request.prompt_len - 1
        claim = PrefixClaim(rid)
        if self._reuses(request):
            # the admission walk's match, resumed (a prefix of the keys matches a prefix of the chain)
            keys = self._prompt_keys(request)
            claim.chain = self.prefix_index.chain(rid, request.prompt_len, keys)[: claim_limit // tpb]
            if self.enable_partial_reuse and request.beam_width == 1:
                start = len(claim.chain) * tpb
                want = self._keys[rid][2][start * TOKEN_BYTES : min(start + tpb, claim_limit) * TOKEN_BYTES]
                if want:
                    parent = claim.chain[-1] if claim.chain else None
                    claim.partial, claim.partial_len = self.pool.match_partial(parent, want)
        self.pool.incref_all(claim.pinned)  # pinned: no allocation can evict them now
        claim.reused = len(claim.chain) * tpb + claim.partial_len
        self._claims[rid] = claim
        return claim

    def release_claim(self, claim: PrefixClaim) -> None:
        """Unpin a claim: the pool is left exactly as before it."""
        if self._claims.pop(claim.request_id, None) is None:
            return
        # Leaves first, as free does: a root released after its leaves stays
        # younger in LRU, so one eviction cannot drop the whole cached prefix.
        for block in reversed(claim.pinned):
            self.pool.decref(block)

    def _allocate_first_chunk(self, chunk: ContextChunk, claim: PrefixClaim | None) -> tuple[ContextChunk, int] | None:
        """Claim the reusable prefix (unless claimed), onboard it, allocate the rest of the prompt.

        Returns the chunk moved onto the reused prefix and how many claimed blocks were onboarded,
        or None (nothing claimed) when the blocks cannot be had.
        """
        request = chunk.request
        if claim is None:
            claim = self.claim_prefix(request)
            chunk = chunk.after_reuse(claim.reused, self.tokens_per_block)
        elif chunk.reused != claim.reused:
            raise ValueError(f"{chunk!r} does not start at its claim of {claim.reused} tokens")
        chain, tpb = claim.chain, self.tokens_per_block
        needed_len = max(request.prompt_len, chunk.start + chunk.cost())
        total = self._blocks_for_tokens(request, needed_len)
        on_host = [block for block in chain if block.block_id is None]  # pinned: they stay there until onboarded
        to_onboard = len(on_host)
        # A partial-match source pinned by this claim alone goes back to the cache once it is
        # copied into the first fresh block, so the rest of the allocation may take its slot.
        recycled = int(claim.partial is not None and claim.partial.ref_count == 1)
        needed = total - len(chain) + to_onboard
        if needed > self.pool.available + recycled or to_onboard + recycled > self.pool.available:
            self.release_claim(claim)
            return None
        del self._claims[request.request_id]
        for block in on_host:
            self.pool.onboard(block)
        shared_total = _ceil_div(needed_len, tpb)
        blocks = chain + ([self.pool.allocate()] if shared_total > len(chain) else [])
        if claim.partial is not None:
            self.pool.copy(claim.partial, blocks[len(chain)])
            self.pool.decref(claim.partial)
        blocks += self.pool.allocate_many(shared_total - len(blocks))
        beam_blocks = self.pool.allocate_many(total - shared_total)
        seq = _Sequence(
            blocks=blocks,
            num_committed=len(chain),
            num_computed=claim.reused,
            beam_blocks=beam_blocks,
            stamp=next(self._stamps),
            reserve=self._blocks_for_tokens(request, self._max_sequence_len(request)),
            plain=request.beam_width == 1 and request.max_draft_len == 0,
            capacity=len(blocks) * tpb,
        )
        self._sequences[request.request_id] = seq
        self._step_room[request.request_id] = seq.capacity if seq.plain else -1
        self._reserved += max(0, seq.reserve - seq.num_held)
        return chunk, to_onboard

    def _commit_full_blocks(self, sequences: list[tuple[LlmRequest, _Sequence]]) -> None:
        """Commit each sequence's computed full blocks that are not in the tree yet, in order.

        Prompt blocks reuse the keys the admission walk computed; blocks of generated tokens are
        keyed here, every sequence's at once."""
        tpb = self.tokens_per_block
        spans: list[tuple[_Sequence, list[tuple[int, BlockTokens]], int, int] | None] = []
        generated = array(TOKEN_TYPECODE)  # every sequence's generated tokens to key, one after another
        for request, seq in sequences:
            limit = seq.num_computed if request.beam_width == 1 else min(seq.num_computed, request.prompt_len)
            full = min(limit // tpb, len(seq.blocks))
            if full <= seq.num_committed:
                continue
            keys = self._prompt_keys(request)
            begin = max(seq.num_committed, len(keys))  # its first block of generated tokens
            if full > begin:
                generated += request.tokens[begin * tpb : full * tpb]
            spans.append((seq, keys, begin, full))
        generated_keys = self._block_keys(pack_tokens(generated), len(generated) // tpb) if generated else []
        offset = 0
        for seq, keys, begin, full in spans:
            blocks, committed = seq.blocks, seq.num_committed
            if committed < len(keys):
                self.pool.commit_chain(blocks, committed, keys[committed:full])
            if full > begin:
                self.pool.commit_chain(blocks, begin, generated_keys[offset : offset + full - begin])
                offset += full - begin
            table = seq.table
            for i in range(committed, full):
                table[i] = blocks[i].block_id
            seq.num_committed = full

    def _prompt_keys(self, request: LlmRequest) -> list[tuple[int, BlockTokens]]:
        """(hash, tokens) of each full prompt block, cached per request while the prompt is
        unchanged, beside the whole prompt packed (a claim's partial block is a slice of it)."""
        cached = self._keys.get(request.request_id)
        if cached is not None and cached[0] == request.prompt_len:
            return cached[1]
        prompt_len, tokens = request.prompt_len, request.tokens
        packed = pack_tokens(tokens if len(tokens) == prompt_len else tokens[:prompt_len])
        buffer = packed.tobytes()
        keys = self._block_keys(packed, prompt_len // self.tokens_per_block, buffer)
        self._keys[request.request_id] = (prompt_len, keys, buffer)
        return keys

    def _block_keys(self, packed: np.ndarray, num_blocks: int, buffer: bytes | None = None) -> list[tuple[int, BlockTokens]]:
        """(hash, tokens) of the first ``num_blocks`` full blocks of ``packed`` (``buffer``: its bytes, if at hand)."""
        width = self.tokens_per_block * TOKEN_BYTES
        if buffer is None:
            buffer = packed.tobytes()
        if self.block_hash is None:
            hashes = content_hashes(packed, num_blocks, self.tokens_per_block) if num_blocks else []
            return [(h, buffer[i : i + width]) for h, i in zip(hashes, range(0, num_blocks * width, width))]
        blocks = [buffer[i : i + width] for i in range(0, num_blocks * width, width)]
        return list(zip(map(self.block_hash, blocks), blocks))
