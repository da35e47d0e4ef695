"""The ZMQ publisher: vLLM's wire format, sequence numbers, replay, and its switches.

Whether a router someone else wrote understands the wire is ``serve/test_dynamo_kv_indexer.py``
(Dynamo's indexer); here the bytes are read back with plain msgpack (no struct of ours), so the
layout itself is held to: multipart ``[topic, 8-byte big-endian seq, payload]``, the payload an
array ``[ts, [events...], data_parallel_rank]``, each event a tagged array.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tensorrt_llm._torch.pyexecutor.errors import KVCacheEventsDisabled
from tensorrt_llm._torch.pyexecutor.kv_cache import events as ev
from tensorrt_llm._torch.pyexecutor.kv_cache.events import KVEventRecord, block_hashes
from tensorrt_llm.commands import serve
from tensorrt_llm.llmapi import LLM, KVEventsConfig, SamplingParams
from tensorrt_llm.llmapi.kv_event_publisher import END_SEQ, batches, wire_events
from tensorrt_llm.serve.llm_options import LlmOptionsError, load_llm_options

TPB = 4


def packed(tokens: list[int]) -> bytes:
    from array import array

    return array("I", tokens).tobytes()


def test_a_move_is_removed_on_one_medium_then_stored_on_the_other():
    block = ev.StoredBlock(block_hashes([1, 2, 3, 4, 5, 6, 7, 8], TPB)[1], packed([5, 6, 7, 8]))
    parent = block_hashes([1, 2, 3, 4], TPB)[0]
    move = ev.BlockMoved(block, parent, TPB, ev.CacheLevel.GPU, ev.CacheLevel.HOST)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(wire_events(move)))
    assert raw == [["BlockRemoved", [block.block_hash], "GPU"],
                   ["BlockStored", [block.block_hash], parent, [5, 6, 7, 8], TPB, None, "CPU"]]
    assert wire_events(ev.PoolCreated((8, 2))) == []
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire_events(ev.AllBlocksCleared((1, 2))))) == [["AllBlocksCleared"]]


def test_each_attention_dp_rank_gets_its_own_batch_with_its_rank():
    stored = ev.BlocksStored(None, (ev.StoredBlock(7, packed([1, 2, 3, 4])),), TPB)
    records = [KVEventRecord(0, ev.PoolCreated((8, 0)), 1.0, 0), KVEventRecord(1, stored, 2.0, 0),
               KVEventRecord(1, stored, 3.0, 1), KVEventRecord(2, stored, 4.0, 1), KVEventRecord(3, stored, 5.0, None)]
    raw = [msgspec.msgpack.decode(msgspec.msgpack.encode(b)) for b in batches(records)]
    assert [(b[0], len(b[1]), b[2]) for b in raw] == [(2.0, 1, 0), (3.0, 2, 1), (5.0, 1, 0)]


@pytest.fixture(scope="module")
def publishing(one_torch_thread):
    llm = LLM("tiny-random", max_seq_len=64, max_num_tokens=64,
              kv_cache_config={"tokens_per_block": TPB, "num_blocks": 32},
              kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                                "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@worker7"})
    yield llm
    llm.shutdown()


def test_batches_arrive_numbered_in_vllms_layout_and_replay_from_any_number(publishing):
    """Two requests' stores arrive in order, in one batch or two (the publisher sends what it
    drained together: how the events split into batches is timing, not contract), numbered one
    after another; a replay from the first number sends every batch again, then the end mark."""
    llm = publishing
    publisher = llm.kv_event_publisher
    context = zmq.Context.instance()
    first, second = list(range(1, 10)), list(range(1, 9)) + [50, 51, 52, 53, 54]
    hashes, shared = block_hashes(first, TPB), block_hashes(second, TPB)
    expected = [["BlockStored", hashes, None, first[:8], TPB, None, "GPU"],
                ["BlockStored", [shared[2]], shared[1], second[8:12], TPB, None, "GPU"]]
    with context.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@worker7")
        sub.connect(publisher.endpoint)
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        llm.generate(first, SamplingParams(max_tokens=1))
        llm.generate(second, SamplingParams(max_tokens=1))
        messages, events = [], []
        while len(events) < len(expected) and sub.poll(5000):
            messages.append(sub.recv_multipart())
            events += msgspec.msgpack.decode(messages[-1][2])[1]
    assert events == expected
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in messages]
    assert all(topic == b"kv@worker7" and len(seq) == 8 for topic, seq, _ in messages)
    assert seqs == list(range(seqs[0], seqs[0] + len(messages)))
    ts, _, rank = msgspec.msgpack.decode(messages[0][2])
    assert isinstance(ts, float) and rank == 0

    with context.socket(zmq.DEALER) as replay:  # a subscriber that missed everything asks again
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", messages[0][1]])
        answers = []
        while replay.poll(5000):
            answers.append(replay.recv_multipart())
            if answers[-1][1] == END_SEQ:
                break
    assert [(a[1], a[2]) for a in answers] == [(seq, payload) for _, seq, payload in messages] + [(END_SEQ, b"")]


def test_the_publisher_is_the_events_only_reader(publishing):
    with pytest.raises(KVCacheEventsDisabled, match="ZMQ publisher"):
        publishing.get_kv_cache_events(0)
    assert publishing.config.kv_cache_config.event_buffer_max_size == KVEventsConfig().max_queue_size


def test_an_address_in_use_fails_the_llm_by_name(publishing, one_torch_thread):
    taken = publishing.kv_event_publisher.endpoint
    with pytest.raises(ValueError, match="kv_events_config: cannot publish on"):
        LLM("tiny-random", max_seq_len=32, kv_cache_config={"tokens_per_block": TPB, "num_blocks": 8},
            kv_events_config={"enable_kv_cache_events": True, "endpoint": taken.replace("127.0.0.1", "*")})


def test_the_switches_come_from_flags_and_yaml_and_an_unknown_key_is_refused_by_name(tmp_path):
    parser = serve.build_parser()
    args = parser.parse_args(["tiny-random", "--kv_events_config.enable_kv_cache_events",
                              "--kv_events_config.endpoint", "tcp://*:6100", "--kv_cache_config.event_buffer_max_size", "64"])
    kwargs = serve.llm_kwargs(args)
    assert kwargs["kv_events_config"] == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6100")
    assert kwargs["kv_events_config"].publisher == "zmq" and kwargs["kv_cache_config"].event_buffer_max_size == 64
    options = tmp_path / "options.yaml"
    options.write_text("kv_events_config:\n  enable_kv_cache_events: true\n  publisher: zmq\n"
                       "  endpoint: tcp://*:6101\n  replay_endpoint: tcp://*:6102\n  topic: kv\n")
    loaded = load_llm_options(options)["kv_events_config"]
    assert (loaded.endpoint, loaded.replay_endpoint, loaded.topic) == ("tcp://*:6101", "tcp://*:6102", "kv")
    options.write_text("kv_events_config:\n  enable_kv_cache_events: true\n  endpiont: tcp://*:6101\n")
    with pytest.raises(LlmOptionsError, match="unknown key 'kv_events_config.endpiont'"):
        load_llm_options(options)
    with pytest.raises(ValueError, match="kv_events_config.publisher must be one of 'null', 'zmq'"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="nats")
    with pytest.raises(ValueError, match="unknown key 'kv_events_config.bogus'"):
        LLM("tiny-random", kv_events_config={"bogus": 1})
