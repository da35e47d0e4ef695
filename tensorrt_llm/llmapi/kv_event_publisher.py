"""KV cache events on a ZMQ socket in vLLM's wire format, for the routers that read vLLM's.

What goes on the wire (vLLM's ``vllm/distributed/kv_events.py`` layout; msgspec structs
encoded as msgpack arrays, ``array_like``, the event's class name first as its tag)::

    multipart message   [topic, sequence number (8 bytes, big-endian), payload]
    payload             KVEventBatch  [ts, [event, ...], data_parallel_rank]
    events              ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
                        ["BlockRemoved", block_hashes, medium]
                        ["AllBlocksCleared"]

``medium`` is ``"GPU"`` or ``"CPU"`` (the host tier). vLLM has no event for a move between
tiers: a move is a ``BlockRemoved`` on the medium the block leaves, then a ``BlockStored`` of
the same block (same hash, parent, tokens) on the one it joins. ``data_parallel_rank`` is 0
for one pool (vLLM's publisher always sets it; ``None``, the struct's default, is never sent),
the rank under attention DP. ``lora_id`` is always nil. The block hashes are the chained
identity hashes of ``kv_cache/events.py``; a consumer such as Dynamo's router recomputes its
own content hash from ``token_ids``.

Replay: a subscriber that saw a gap in the sequence numbers sends ``[b"", start (8 bytes,
big-endian)]`` from a DEALER socket (vLLM's example subscriber: ``start`` from a REQ socket,
which adds the empty frame) to ``replay_endpoint``; the ROUTER answers one message
``[b"", seq, payload]`` per kept batch from ``start`` on, then ``[b"", -1 (8 bytes,
big-endian, signed), b""]``.

:class:`ZmqEventPublisher` runs on a thread of its own, fed by the pool's bounded buffer
(``ExecutorClient.get_kv_cache_events``): the executor loop never waits on a socket, and when
the publisher falls behind, the buffer drops the oldest events and counts them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

import msgspec
import zmq

from tensorrt_llm._torch.pyexecutor.kv_cache import events as kv_events
from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVEventRecord, token_ids
from tensorrt_llm.llmapi.llm_args import KVEventsConfig

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch", "ZmqEventPublisher", "wire_events"]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event on the wire: an array whose first element is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_events(event: kv_events.KVCacheEvent) -> list[KVCacheEvent]:
    """What one pool event is on vLLM's wire (none for ``PoolCreated``, two for a move)."""
    if isinstance(event, kv_events.BlocksStored):
        tokens = [t for block in event.blocks for t in token_ids(block.tokens)]
        return [BlockStored([b.block_hash for b in event.blocks], event.parent_hash, tokens, event.block_size, None,
                            event.level.medium)]
    if isinstance(event, kv_events.BlocksRemoved):
        return [BlockRemoved(list(event.block_hashes), event.level.medium)]
    if isinstance(event, kv_events.BlockMoved):
        block = event.block
        return [BlockRemoved([block.block_hash], event.source.medium),
                BlockStored([block.block_hash], event.parent_hash, token_ids(block.tokens), event.block_size, None,
                            event.destination.medium)]
    if isinstance(event, kv_events.AllBlocksCleared):
        return [AllBlocksCleared()]
    if isinstance(event, kv_events.PoolCreated):
        return []
    raise TypeError(f"not a KV cache event: {event!r}")


def batches(records: Iterable[KVEventRecord]) -> list[KVEventBatch]:
    """The records as batches, one per run of records of the same rank (None: rank 0), each
    stamped with its first record's time; records with nothing to send make no batch."""
    out: list[KVEventBatch] = []
    rank = None
    for record in records:
        wire = wire_events(record.event)
        if not wire:
            continue
        record_rank = record.rank or 0
        if not out or record_rank != rank:
            out.append(KVEventBatch(record.timestamp, [], record_rank))
            rank = record_rank
        out[-1].events.extend(wire)
    return out


def _binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard, or a local transport, is bound; others are connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes what ``source(timeout)`` returns (the executor's ``get_kv_cache_events``) on
    ``config.endpoint``, from a thread of its own; serves replays on ``config.replay_endpoint``.

    The sockets are set up here, so that an address in use fails the caller (``zmq.ZMQError``);
    from then on only the thread touches them. :meth:`shutdown` publishes what is left and closes.
    """

    POLL_S = 0.05  # how long the thread waits for events before it looks at replay requests again

    def __init__(self, source: Callable[[float], list[KVEventRecord]], config: KVEventsConfig) -> None:
        self.config = config
        self._source = source
        self._context = zmq.Context.instance()
        self._topic = config.topic.encode()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self.published = 0  # batches sent
        self._pub = self._context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close()
            raise
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ZmqEventPublisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s%s", config.endpoint,
                    f" (replay on {config.replay_endpoint})" if config.replay_endpoint else "")

    @property
    def endpoint(self) -> str:
        """The PUB socket's address as bound (a ``tcp://...:*`` port resolved) or as given."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.config.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Publish what the source still holds, stop the thread, close the sockets."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the KV event publisher did not stop within %.1f s", timeout_s)
            return
        self._close()

    def _close(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    # ---- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            try:
                self._serve_replays()
                self._publish(self._source(0.0 if stopping else self.POLL_S))
            except Exception:  # a bad batch or a socket error: say so, keep publishing
                logger.exception("KV event publisher: a batch was not sent")
                time.sleep(self.POLL_S)
            if stopping:
                return

    def _publish(self, records: list[KVEventRecord]) -> None:
        for batch in batches(records):
            payload = self._encoder.encode(batch)
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._kept.append((seq, payload))
            self.published += 1

    def _serve_replays(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV event replay: a malformed request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._kept):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", END_SEQ, b""))
