"""The HTTP edge's limits, driven over raw sockets where a client library would hide the bytes:
every refusal is a whole HTTP response with the OpenAI error body, and no client
can hold a connection open by sending slowly.

- malformed framing (request line, Content-Length, chunk size) -> 400 JSON, closed;
- a head that stops arriving -> 408 (also on a kept-alive connection); a connection that
  sends nothing is closed silently;
- a body that stops arriving -> 408;
- a head over ``max_header_bytes`` -> 431, whether it arrives in pieces or whole;
- a body over ``max_body_bytes`` -> 413 that httpx and the ``openai`` client read (not a reset);
- connections beyond ``limit_concurrency`` -> 503 JSON with Retry-After;
- admission: a stalled executor -> 503 with Retry-After on ``/v1`` while ``/health`` is 503; a
  queue at ``max_queue_size`` -> 503; both counted in ``trtllm_requests_rejected_total``.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.serve.server_config import ServerConfig

TIMEOUT_S = 0.5  # the edge server's head and body timeouts
MAX_BODY = 64 * 1024
MAX_HEAD = 8 * 1024
EDGE = ServerConfig(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_body_bytes=MAX_BODY,
                    max_header_bytes=MAX_HEAD)
READ_S = 10  # no answer within this is a hang


def tiny_llm(**options) -> LLM:
    options.setdefault("kv_cache_config", KvCacheConfig(tokens_per_block=16, num_blocks=64))
    return LLM("tiny-random", dtype="float64", max_seq_len=256, **options)


@pytest.fixture(scope="module")
def edge_server(one_torch_thread):
    server = RunningServer(tiny_llm(), api_key=None, config=EDGE)
    yield server
    server.stop()


class Answer:
    """One HTTP response read off a socket, and how long it took to come."""

    def __init__(self, raw: bytes, elapsed_s: float) -> None:
        self.raw, self.elapsed_s = raw, elapsed_s
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0] else None
        self.headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}

    def error(self) -> dict:
        """The OpenAI error body, checked for shape and for its code matching the status."""
        assert self.headers.get("content-type") == "application/json", self.raw
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == self.status, error
        return error


def exchange(server: RunningServer, *parts: bytes, pause_s: float = 0.0) -> Answer:
    """Send ``parts`` (``pause_s`` apart) on a fresh connection, then read until the server
    closes it; the time is counted from the last part sent."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(READ_S)
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            sock.sendall(part)
        sent = time.monotonic()
        return Answer(read_to_close(sock), time.monotonic() - sent)


def read_to_close(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def post_head(length: int | str, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\ncontent-type: application/json\r\n"
            + f"Content-Length: {length}\r\n".encode() + extra + b"\r\n")


VALID = json.dumps({"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}).encode()


@pytest.mark.parametrize(
    "request_bytes, message",
    [
        (b"GARBAGE\r\n\r\n", "illegal request line"),
        (post_head("abc"), "bad Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
         "illegal chunk header"),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\nbad header line\r\n\r\n", "invalid HTTP request"),
    ],
    ids=["request-line", "content-length", "chunk-size", "header-line"],
)
def test_malformed_framing_gets_a_json_400(edge_server, request_bytes, message):
    answer = exchange(edge_server, request_bytes)
    assert answer.status == 400 and answer.headers["connection"] == "close"
    assert message in answer.error()["message"]


def test_a_head_that_stops_arriving_gets_408(edge_server):
    answer = exchange(edge_server, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Le")
    assert answer.status == 408 and "request head did not arrive within 0.5 s" in answer.error()["message"]
    assert TIMEOUT_S * 0.8 <= answer.elapsed_s <= TIMEOUT_S + 5


def test_a_head_that_stops_arriving_on_a_kept_alive_connection_gets_408(edge_server):
    with socket.create_connection(("127.0.0.1", edge_server.port)) as sock:
        sock.settimeout(READ_S)
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: test\r\n\r\n")
        first = b""
        while b"}" not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S * 1.5)  # idle between requests: the keep-alive timeout's (75 s), not the head's
        sock.sendall(b"GET /version HTTP/1.1\r\nHo")  # then half a head
        answer = Answer(read_to_close(sock), 0.0)
    assert answer.status == 408 and answer.error()["code"] == 408


def test_a_new_connection_is_idle_until_its_first_byte(one_torch_thread):
    """A loaded client may connect long before it writes its request. Until its first byte the
    connection is idle (the keep-alive time), not a head arriving slowly (the head timeout):
    closing it at the head timeout lost those requests without a trace. One that never sends
    is closed silently once the keep-alive time is up."""
    keep_alive_s = 1.5
    config = ServerConfig(header_timeout_s=0.2, timeout_keep_alive_s=keep_alive_s)
    server = RunningServer(tiny_llm(), api_key=None, config=config)
    try:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(READ_S)
            assert read_to_close(sock) == b""
        assert keep_alive_s * 0.8 <= time.monotonic() - start < keep_alive_s + 5
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(READ_S)
            time.sleep(1.0)  # five head timeouts
            sock.sendall(post_head(len(VALID), b"Connection: close\r\n") + VALID)
            answer = Answer(read_to_close(sock), 0.0)
        assert answer.status == 200, answer.raw
        # once its head has begun, the head timeout applies
        half = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: t")
        assert half.status == 408 and half.elapsed_s < 5
    finally:
        server.stop()


def test_a_body_that_stops_arriving_gets_408(edge_server):
    answer = exchange(edge_server, post_head(50), b'{"model')  # 7 of 50 bytes, then nothing
    assert answer.status == 408 and "request body did not arrive within 0.5 s" in answer.error()["message"]
    assert TIMEOUT_S * 0.8 <= answer.elapsed_s <= TIMEOUT_S + 5


def test_a_slow_but_steady_body_within_the_timeout_is_served(edge_server):
    answer = exchange(edge_server, post_head(len(VALID), b"Connection: close\r\n"), VALID[:10], VALID[10:],
                      pause_s=TIMEOUT_S / 5)
    assert answer.status == 200 and len(json.loads(answer.body)["choices"][0]["token_ids"]) == 2


@pytest.mark.parametrize("whole", [False, True], ids=["in-pieces", "whole"])
def test_a_head_over_the_limit_gets_431(edge_server, whole):
    big = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * (MAX_HEAD + 1000) + b"\r\n"
    answer = exchange(edge_server, big + (b"\r\n" if whole else b""))
    assert answer.status == 431 and f"exceeds the limit of {MAX_HEAD} bytes" in answer.error()["message"]


def test_a_body_over_the_limit_is_a_413_that_clients_read(edge_server):
    too_big = b" " * (MAX_BODY * 3)
    with edge_server.http() as http:
        declared = http.post("/v1/completions", content=too_big, headers={"content-type": "application/json"})
        chunked = http.post("/v1/completions", content=iter([too_big[:MAX_BODY], too_big[MAX_BODY:]]),
                            headers={"content-type": "application/json"})
    for response in (declared, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == 413
        assert f"exceeds the limit of {MAX_BODY} bytes" in response.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:
        edge_server.client().completions.create(model="tiny-random", prompt=[7] * (MAX_BODY // 2), max_tokens=1)
    assert refused.value.status_code == 413 and refused.value.body["code"] == 413
    continued = exchange(edge_server, post_head(MAX_BODY + 1, b"Expect: 100-continue\r\n"))  # no body sent
    assert continued.status == 413 and continued.error()["code"] == 413
    assert edge_server.client().completions.create(model="tiny-random", prompt=[1, 2], max_tokens=1).choices


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_over_the_limit_is_drained_before_the_413(edge_server, chunked):
    """Without the drain the server closes while the client still sends: its next write fails
    (broken pipe, or a reset), and a client that gives up on a failed write never reads the
    413. httpx happens to read on after a failed write; this client does not."""
    body = b" " * int(MAX_BODY * 3.5)
    pieces = [body[i : i + 8192] for i in range(0, len(body), 8192)]
    if chunked:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\ncontent-type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        pieces = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces] + [b"0\r\n\r\n"]
    else:
        head = post_head(len(body))
    with socket.create_connection(("127.0.0.1", edge_server.port)) as sock:
        sock.settimeout(READ_S)
        sock.sendall(head)
        for piece in pieces:
            sock.sendall(piece)  # raises BrokenPipeError / ConnectionResetError once the server has closed
            time.sleep(0.002)  # the server reads (and answers) while the body is still coming
        answer = Answer(read_to_close(sock), 0.0)
    assert answer.status == 413 and answer.error()["code"] == 413


def test_connections_beyond_the_limit_get_a_json_503(one_torch_thread):
    server = RunningServer(tiny_llm(), api_key=None, config=ServerConfig(limit_concurrency=2))
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        time.sleep(0.2)  # accepted
        answer = exchange(server, b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        assert answer.status == 503 and answer.headers["retry-after"] == "1"
        assert "limit of 2 concurrent connections" in answer.error()["message"]
        for sock in idle:
            sock.close()
        time.sleep(0.2)  # closed
        assert httpx.get(f"{server.url}/health", timeout=READ_S).status_code == 200
    finally:
        server.stop()


def rejected(server: RunningServer, reason: str) -> float:
    text = httpx.get(f"{server.url}/prometheus/metrics", timeout=READ_S).text
    line = next(line for line in text.splitlines() if line.startswith(f'trtllm_requests_rejected_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


def test_a_stalled_executor_refuses_new_work_while_health_says_so(one_torch_thread):
    """While a forward stalls past health_check_timeout_s, /health is 503 and so is /v1: a
    load balancer routes elsewhere instead of queueing behind the stall."""
    faults = FaultInjectionConfig(slow_forward_every=1, slow_forward_s=1.5)
    server = RunningServer(tiny_llm(health_check_timeout_s=0.2, fault_injection=faults), api_key=None)
    try:
        body = {"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
        stalled = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                                   kwargs={"json": body, "timeout": READ_S})
        stalled.start()
        deadline = time.monotonic() + READ_S
        while (health := httpx.get(f"{server.url}/health", timeout=READ_S)).status_code == 200:
            assert time.monotonic() < deadline, "the stall never showed on /health"
            time.sleep(0.02)
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=READ_S)
        assert health.status_code == 503 and refused.status_code == 503
        assert refused.headers["retry-after"] == "10"
        assert "cannot take requests: the executor loop has not finished an iteration" in refused.json()["error"]["message"]
        assert rejected(server, "unhealthy") == 1.0
        stalled.join(READ_S)
        server.wait_idle()
        assert httpx.get(f"{server.url}/health", timeout=READ_S).status_code == 200  # the stall is over
    finally:
        server.stop()


def test_a_full_queue_refuses_new_work(one_torch_thread):
    faults = FaultInjectionConfig(slow_forward_every=1, slow_forward_s=0.05)  # slow enough to hold a queue
    server = RunningServer(tiny_llm(max_batch_size=1, fault_injection=faults), api_key=None,
                           config=ServerConfig(max_queue_size=1))
    try:
        def body(seed: int) -> dict:
            return {"model": "tiny-random", "prompt": [1 + seed, 2, 3], "max_tokens": 40, "temperature": 0}

        results: list[int] = []
        first = threading.Thread(target=lambda: results.append(httpx.post(
            f"{server.url}/v1/completions", json=body(1), timeout=READ_S * 3).status_code))
        first.start()
        wait_until(lambda: server.executor.health().active_requests == 1)  # running: it is not waiting
        second = threading.Thread(target=lambda: results.append(httpx.post(
            f"{server.url}/v1/completions", json=body(2), timeout=READ_S * 3).status_code))
        second.start()
        wait_until(lambda: server.server.metrics.load().waiting == 1)  # behind the first (max_batch_size 1)
        refused = httpx.post(f"{server.url}/v1/completions", json=body(3), timeout=READ_S)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "1 are waiting (max_queue_size=1)" in refused.json()["error"]["message"]
        assert rejected(server, "queue_full") == 1.0 and rejected(server, "unhealthy") == 0.0
        first.join(READ_S * 3)
        second.join(READ_S * 3)
        assert results == [200, 200]  # the admitted ones were served
    finally:
        server.stop()


def wait_until(condition, timeout_s: float = READ_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
