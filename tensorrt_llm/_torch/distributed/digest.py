"""The decision digest: one iteration's scheduling decisions as integer records and a 64-bit hash.

Two record lists per iteration, each a list of integer tuples in batch order:

* :func:`decision_records`, after allocation and before the forward: every scheduled
  context chunk (window, reuse, block table), every generation request (length, beams,
  drafts, block table), every deferral (and why), every pause, and the pool's counters;
* :func:`outcome_records`, after sampling and the KV update: every batch request's state,
  length and newest token, and the pool's counters again (commits and frees happened).

Ranks that agree on both lists, every iteration, started from the same state and took the
same decisions: scheduled the same requests with the same chunks, deferred the same ones,
claimed and allocated the same blocks, sampled the same tokens. Comparing one 64-bit
:func:`digest` per list costs one small all-gather; only on a mismatch are the records
themselves exchanged, and :func:`first_difference` names the first request that differs.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Sequence

from tensorrt_llm._torch.pyexecutor.llm_request import DeferReason

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache.manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.resource_manager import PreparedBatch
    from tensorrt_llm._torch.pyexecutor.scheduled_requests import ScheduledRequests

Record = tuple  # integers, and one tuple of integers (a block table) at the end of some

POOL_ID = -1  # the request-id slot of a pool record


class RecordKind(enum.IntEnum):
    CONTEXT = 1  # (kind, id, prompt_len, chunk start, chunk size, reused, block_table)
    GENERATION = 2  # (kind, id, num_tokens, newest_token, beam_width, num_drafts, first_draft, block_table)
    DEFERRED = 3  # (kind, id, reason: 1 budget, 2 capacity)
    PAUSED = 4  # (kind, id)
    POOL = 5  # (kind, POOL_ID, free, cached, host_cached, evictions)
    OUTCOME = 6  # (kind, id, state, num_tokens, newest_token)


_REASONS = {DeferReason.BUDGET: 1, DeferReason.CAPACITY: 2}


def _pool_record(kv: "KVCacheManager") -> Record:
    pool = kv.pool
    return (RecordKind.POOL, POOL_ID, pool.num_free, pool.num_cached, pool.num_host_cached, pool.num_evictions)


def decision_records(prepared: "PreparedBatch", kv: "KVCacheManager") -> list[Record]:
    """What this iteration decided, once every block is in place (before the forward)."""
    records: list[Record] = []
    scheduled = prepared.scheduled
    for chunk in scheduled.context_chunks:
        r = chunk.request
        records.append((RecordKind.CONTEXT, r.request_id, r.prompt_len, chunk.start, chunk.size, chunk.reused,
                        tuple(kv.block_table(r))))
    for r in scheduled.generation_requests:
        records.append((RecordKind.GENERATION, r.request_id, len(r.tokens), r.tokens[-1], r.beam_width,
                        r.num_draft_tokens, int(r.is_first_draft), tuple(kv.block_table(r))))
    for deferral in prepared.deferred:
        records.append((RecordKind.DEFERRED, deferral.request.request_id, _REASONS[deferral.reason]))
    for r in scheduled.paused_requests:
        records.append((RecordKind.PAUSED, r.request_id))
    records.append(_pool_record(kv))
    return records


def outcome_records(scheduled: "ScheduledRequests", kv: "KVCacheManager") -> list[Record]:
    """What the forward and the sampler produced for the batch, and the pool after the KV update."""
    records: list[Record] = [
        (RecordKind.OUTCOME, r.request_id, r.state.value, len(r.tokens), r.tokens[-1])
        for r in scheduled.all_requests
    ]
    records.append(_pool_record(kv))
    return records


def digest(records: Sequence[Record]) -> int:
    """A 64-bit hash of the records, equal on every rank for equal records.

    Python's ``hash`` of a tuple of integers (and of tuples of them) is not salted:
    ``PYTHONHASHSEED`` salts only str and bytes, which records never hold, and every rank
    runs the same interpreter. (The multi-rank tests run each rank with its own seed.) It
    is computed in C: a batch of 64 requests holding 130 blocks each hashes in about 3 us
    per request, most of it copying the block tables.
    """
    return hash(tuple(records))


def describe(record: Record | None) -> str:
    """A record in words, for the divergence error."""
    if record is None:
        return "nothing"
    kind, rid, *rest = record
    if kind == RecordKind.CONTEXT:
        prompt_len, position, chunk, prepopulated, table = rest
        return (f"context chunk [{position}, {position + chunk}) of a {prompt_len}-token prompt"
                f" (reused {prepopulated}), blocks {list(table)}")
    if kind == RecordKind.GENERATION:
        num_tokens, newest, beams, drafts, first_draft, table = rest
        return (f"generation step at length {num_tokens} from token {newest} (beams {beams}, drafts {drafts},"
                f" first draft {bool(first_draft)}), blocks {list(table)}")
    if kind == RecordKind.DEFERRED:
        return f"deferred ({'budget' if rest[0] == 1 else 'capacity'})"
    if kind == RecordKind.PAUSED:
        return "paused"
    if kind == RecordKind.POOL:
        free, cached, host, evictions = rest
        return f"KV pool free {free}, cached {cached}, host-cached {host}, evictions {evictions}"
    if kind == RecordKind.OUTCOME:
        state, num_tokens, newest = rest
        return f"state {state}, length {num_tokens}, newest token {newest}"
    return repr(record)


def first_difference(records_by_rank: Sequence[Sequence[Record]]) -> tuple[int | None, str]:
    """The first request whose records differ between ranks, and what each rank has for it.

    Scans in batch order; the first position where any rank differs from rank 0 names the
    request there (rank 0's, or the first other rank's if rank 0 has its pool record there). Each rank's own record
    for that request id is then shown, so a reordered batch reads as such. Returns
    ``(None, detail)`` when only the pool counters differ.
    """
    reference = records_by_rank[0]
    length = max(len(records) for records in records_by_rank)
    for i in range(length):
        at_i = [records[i] if i < len(records) else None for records in records_by_rank]
        if all(record == at_i[0] for record in at_i):
            continue
        # prefer a record that names a request (a rank may have its pool record where another
        # has one more request)
        named = next((r for r in at_i if r is not None and r[1] != POOL_ID), None)
        request_id = None if named is None else named[1]
        if request_id is None:
            parts = [f"rank {rank}: {describe(record)}" for rank, record in enumerate(at_i)]
            return None, f"batch position {i}: " + "; ".join(parts)
        parts = []
        for rank, records in enumerate(records_by_rank):
            own = next((record for record in records if record[1] == request_id), None)
            where = "" if own is None else f" (position {records.index(own)})"
            parts.append(f"rank {rank}: {describe(own)}{where}")
        return request_id, "; ".join(parts)
    return None, f"records equal, digests differ (rank 0 has {len(reference)} records)"
