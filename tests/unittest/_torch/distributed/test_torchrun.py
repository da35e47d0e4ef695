"""Ranks started by ``torchrun``, as on two hosts: two ``torchrun`` invocations with
``--nnodes 2`` (one rank each, gloo, the rendezvous on 127.0.0.1), each running
``trtllm-serve``. Rank 0 serves HTTP; rank 1 follows the broadcast.

Checked: greedy completions equal one rank's, with the ranks comparing their decision
digest before every forward (``--check_decisions``); a follower killed mid-stream ends the
stream with an error and turns ``/health`` 503, naming rank 1; a follower frozen (SIGSTOP:
its sockets stay open, as when a host's network is gone, so no collective fails) is found by
its silent heartbeat within ``health_check_timeout_s``, and once let go it exits with an error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tensorrt_llm.llmapi import LLM, SamplingParams

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

HEALTH_CHECK_TIMEOUT_S = 3.0
SERVE_ARGS = ["tiny-random", "--dtype", "float64", "--max_num_tokens", "64", "--max_batch_size", "4",
              "--health_check_timeout_s", str(HEALTH_CHECK_TIMEOUT_S), "--check_decisions"]
PROMPTS = [[(5 * i + 3 * j) % 400 + 1 for j in range(9 + 7 * i)] for i in range(3)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoHosts:
    """Two torchrun invocations, node 0 and node 1, as two hosts would run them."""

    def __init__(self, log_dir: Path) -> None:
        self.port, rendezvous = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
        self.nodes, self.logs = [], []
        for node in (0, 1):
            log = open(log_dir / f"node{node}.log", "w")
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                       "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(rendezvous),
                       "-m", "tensorrt_llm.commands.serve", *SERVE_ARGS, "--port", str(self.port)]
            self.nodes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            self.logs.append(log)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(node.poll() is not None for node in self.nodes):
                self.stop()
                raise RuntimeError("the two-host launch did not come up: " + (log_dir / "node0.log").read_text()[-3000:])
            time.sleep(0.25)

    def worker_pid(self, node: int) -> int:
        """The rank process torchrun started on ``node`` (its agent's child)."""
        children = self._ranks(node)
        assert len(children) == 1, children
        return children[0]

    def _ranks(self, node: int) -> list[int]:
        """The agent's children on ``node``: its rank, or none once the agent has gone."""
        pid = self.nodes[node].pid
        try:
            return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    def health(self) -> tuple[int, dict]:
        response = httpx.get(f"{self.url}/health", timeout=5)
        return response.status_code, response.json()

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    def stop(self) -> None:
        # torchrun starts its rank in a session of its own: killing an agent's group leaves its rank
        # running (rank 0 would serve on, its follower gone, for ever), so the ranks go first.
        for node in range(len(self.nodes)):
            for pid in self._ranks(node):
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        for node in self.nodes:
            try:
                os.killpg(node.pid, signal.SIGCONT)
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait(30)
        for log in self.logs:
            log.close()


def _stream_until_error(hosts: TwoHosts, act) -> list[dict]:
    """Stream a long greedy completion, call ``act()`` after its first token; the events read."""
    body = {"model": "tiny-random", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events, acted = [], False
    with httpx.stream("POST", f"{hosts.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if not acted:
                act()
                acted = True
    return events


def _wait_unhealthy(hosts: TwoHosts, within_s: float) -> tuple[float, dict]:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        status, body = hosts.health()
        if status == 503:
            return time.monotonic() - start, body
        time.sleep(0.1)
    raise AssertionError(f"/health still 200 after {within_s} s: {body}")


@pytest.fixture(scope="module")
def expected():
    llm = LLM("tiny-random", dtype="float64")
    try:
        return [llm.generate(p, SamplingParams(max_tokens=8, temperature=0)).outputs[0].token_ids for p in PROMPTS]
    finally:
        llm.shutdown()


def test_two_hosts_answer_as_one_rank_and_a_killed_follower_is_named(tmp_path, expected):
    hosts = TwoHosts(tmp_path)
    try:
        assert [hosts.complete(p, 8) for p in PROMPTS] == expected
        status, body = hosts.health()
        assert status == 200 and body["ranks"] == 2 and body["iterations"] > 0
        events = _stream_until_error(hosts, lambda: os.kill(hosts.worker_pid(1), signal.SIGKILL))
        assert "error" in events[-1] and "rank 1" in events[-1]["error"]["message"], events[-1]
        _, body = _wait_unhealthy(hosts, 10)
        assert "rank 1" in body["reason"] and not body["alive"], body
        # the server stays up to say so; a new request is refused at once
        response = httpx.post(f"{hosts.url}/v1/completions", timeout=10,
                              json={"model": "tiny-random", "prompt": PROMPTS[1], "max_tokens": 2})
        assert response.status_code == 503, response.text
    finally:
        hosts.stop()


def test_a_frozen_follower_is_found_by_its_heartbeat_within_the_health_timeout(tmp_path):
    hosts = TwoHosts(tmp_path)
    try:
        follower = hosts.worker_pid(1)
        frozen_at = []

        def freeze():
            os.kill(follower, signal.SIGSTOP)  # sockets stay open: no collective fails by itself
            frozen_at.append(time.monotonic())

        events = _stream_until_error(hosts, freeze)
        detected_after = time.monotonic() - frozen_at[0]
        assert "error" in events[-1] and "rank 1 stopped answering" in events[-1]["error"]["message"], events[-1]
        # the heartbeat's timeout, plus one beat and the dispatcher's poll, not a collective's 60 s
        assert detected_after < HEALTH_CHECK_TIMEOUT_S + 3.0, detected_after
        status, body = hosts.health()
        assert status == 503 and "rank 1" in body["reason"], body
        os.kill(follower, signal.SIGCONT)  # its host comes back: the group is gone, so it fails
        assert hosts.nodes[1].wait(60) != 0
        assert "the group failed" in (tmp_path / "node1.log").read_text()
    finally:
        hosts.stop()
