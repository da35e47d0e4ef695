"""A router someone else wrote reads our KV cache events: NVIDIA Dynamo's standalone KV indexer.

``ai-dynamo-runtime`` (Dynamo's Rust router core with its Python entry points; no etcd or NATS
in this mode) is installed from the package registry into its own virtual environment, kept
under ``.venv/`` and reused, never a dependency of the project; the test is skipped, saying
why, when the registry cannot be reached. ``python -m dynamo.indexer`` subscribes to the ZMQ
publisher of a real ``LLM`` (tiny-random, blocks of 4 tokens) as worker 7 and answers HTTP
``/query`` with each worker's overlap for a prompt; it recomputes every block's content hash
from the events' ``token_ids`` (xxh3, its own) and keeps our chained hashes as node identity.

The overlap it reports must be the pool's own, in tokens: the prompt's leading full blocks
that the pool holds (read from its prefix tree), through stores, a prefix shared by two
prompts, evictions (blocks removed) and a reset (all cleared).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from tests.helpers.tool_venvs import tool_venv

from tensorrt_llm._torch.pyexecutor.kv_cache.events import block_hashes
from tensorrt_llm.llmapi import LLM, SamplingParams

DYNAMO = "ai-dynamo-runtime==1.6.1"
TPB = 4
WORKER = "7"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dynamo_python() -> Path:
    """The python of Dynamo's own venv (created on first use, then reused)."""
    return tool_venv(DYNAMO) / "bin" / "python"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(dynamo_python, one_torch_thread):
    """``(llm, query)``: an LLM publishing its events, and Dynamo's indexer subscribed to it."""
    zmq_port, http_port = free_port(), free_port()
    llm = LLM("tiny-random", max_seq_len=64, max_num_tokens=64,
              kv_cache_config={"tokens_per_block": TPB, "num_blocks": 12},
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{zmq_port}"})
    indexer = subprocess.Popen(
        [str(dynamo_python), "-m", "dynamo.indexer", "--block-size", str(TPB), "--threads", "1",
         "--workers", f"{WORKER}=tcp://127.0.0.1:{zmq_port}", "--port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def query(token_ids: list[int]) -> dict:
        body = json.dumps({"token_ids": token_ids, "model_name": "default"}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/query", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())

    try:
        deadline = time.monotonic() + 60
        while True:  # up once its HTTP port answers
            try:
                query([1, 2, 3, 4])
                break
            except OSError:
                assert indexer.poll() is None and time.monotonic() < deadline, indexer.communicate(timeout=5)[0][-3000:]
                time.sleep(0.2)
        time.sleep(1.0)  # its SUB socket connects to the publisher (a slow joiner misses what is sent before)
        yield llm, query
    finally:
        llm.shutdown()
        indexer.terminate()
        try:
            indexer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            indexer.kill()


def pool_overlap(llm: LLM, token_ids: list[int]) -> int:
    """Tokens of ``token_ids``' leading full blocks that the pool's prefix tree holds (either tier)."""
    pool = llm.executor.kv_cache_manager.pool
    held, stack = set(), list(pool.tree.root.iter_children())
    while stack:
        node = stack.pop()
        held.add(node.event_hash)
        stack.extend(node.iter_children())
    matched = 0
    for block_hash in block_hashes(token_ids, TPB):
        if block_hash not in held:
            break
        matched += 1
    return matched * TPB


def dynamo_overlap(answer: dict) -> int:
    return answer.get("instances", {}).get(WORKER, {}).get("longest_matched", 0)


def assert_agrees(llm: LLM, query, token_ids: list[int], expected: int) -> None:
    """Dynamo reports ``expected`` tokens of overlap, which is the pool's own (it applies events
    asynchronously: asked until it agrees, for up to 10 s)."""
    assert pool_overlap(llm, token_ids) == expected, "the pool is not where the test expects it"
    deadline, answer = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        answer = query(token_ids)
        if dynamo_overlap(answer) == expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"Dynamo reports {answer} for {token_ids}, the pool holds {expected} tokens of it")


def run(llm: LLM, token_ids: list[int]) -> None:
    llm.generate(token_ids, SamplingParams(max_tokens=1))  # computes the prompt only: its full blocks are stored


def test_dynamo_reports_the_overlap_the_pool_holds(served):
    llm, query = served
    first = list(range(1, 14))  # 3 full blocks (and a token)
    assert_agrees(llm, query, first, 0)
    run(llm, first)
    assert_agrees(llm, query, first, 12)
    shares = first[:8] + [90, 91, 92, 93, 94]  # the first two blocks, then its own
    assert_agrees(llm, query, shares, 8)
    run(llm, shares)  # stores only its third block, under the shared second
    assert_agrees(llm, query, shares, 12)
    assert_agrees(llm, query, first + [0, 0, 0], 12)

    # 12 blocks in all: a 45-token prompt needs all of them, so eviction removes every cached block
    unrelated = list(range(200, 245))
    run(llm, unrelated)
    assert_agrees(llm, query, first, 0)
    assert_agrees(llm, query, shares, 0)
    assert_agrees(llm, query, unrelated, 44)

    assert llm.reset_prefix_cache()  # all cleared
    assert_agrees(llm, query, unrelated, 0)
    run(llm, first)  # and it starts over from an empty index
    assert_agrees(llm, query, first, 12)
