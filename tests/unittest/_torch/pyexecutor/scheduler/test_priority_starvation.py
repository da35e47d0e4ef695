"""Aging bounds every request's wait (the bound stated in ``pyexecutor/priority.py``).

A simulated executor where only batch slots limit (B = 2 slots, every request holds one for
exactly L = 4 iterations: a one-chunk prompt, then 3 more tokens), on a clock of one second per
iteration. Load: a burst of 120 high-priority requests, then a steady stream of them at 0.45
per iteration (capacity is B / L = 0.5), and a low-priority request every 40 iterations.

* The order: every request admitted while request ``i`` waited arrived before ``a_i + H_i``
  (``H_i = (1 - p_i) / rate``), checked on every admission.
* The bound: ``i`` waits at most ``ceil((Q_i + n(H_i) + 1) / B) * L`` iterations, with ``Q_i``
  the requests waiting when it arrived and ``n(H_i)`` those arriving in ``(a_i, a_i + H_i]``.
* Without aging the same traffic starves the low-priority requests: the first waits for the
  whole backlog of higher-priority requests (775 iterations here against 279 with aging).
"""

from __future__ import annotations

import math

from tests.helpers.factories import KV_BYTES_PER_TOKEN, VOCAB, make_config, make_request

from tensorrt_llm._torch.pyexecutor.config import SchedulerConfig
from tensorrt_llm._torch.pyexecutor.priority import PriorityOrder
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler

B, L = 2, 4
BURST, RATE_PER_ITERATION, LOW_EVERY = 120, 0.45, 40
ARRIVAL_ITERATIONS = 600


def _traffic() -> list[tuple[int, float]]:
    """(arrival iteration, priority), in arrival order: deterministic."""
    arrivals = [(1, 0.9)] * BURST
    owed = 0.0
    for t in range(2, ARRIVAL_ITERATIONS):
        owed += RATE_PER_ITERATION
        while owed >= 1:
            owed -= 1
            arrivals.append((t, 0.9))
        if t % LOW_EVERY == 2:
            arrivals.append((t, 0.0))
    return arrivals


def _replay(aging_rate: float):
    """Each request's (arrival, priority, first iteration in a batch), and the admissions."""
    config = make_config(max_num_tokens=512, max_batch_size=B, tokens_per_block=4, num_blocks=256,
                         scheduler_config=SchedulerConfig(waiting_queue_policy="priority", priority_aging_rate=aging_rate))
    now = [0.0]
    sampler = SyntheticSampler(VOCAB)
    executor = create_py_executor(config, engine_factory=lambda kv: SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB),
                                  sampler=sampler, kv_bytes_per_token=KV_BYTES_PER_TOKEN, clock=lambda: now[0])
    traffic = _traffic()
    requests = [make_request(prompt_len=4, max_new_tokens=L, priority=p, arrival_time=float(a)) for a, p in traffic]
    started: dict[int, int] = {}
    nxt, t = 0, 0
    while nxt < len(requests) or executor.has_work:
        t += 1
        now[0] = float(t)
        while nxt < len(requests) and requests[nxt].arrival_time <= t:
            executor.enqueue_request(requests[nxt])
            nxt += 1
        iteration = executor.step()
        if iteration is not None:
            for chunk in iteration.batch.context_chunks:
                started.setdefault(chunk.request.request_id, t)
        assert t < 20_000, "the replay does not drain"
    return requests, started


def _waiting_at(requests, started, request) -> int:
    """Q_i: the other requests waiting when ``request`` arrived (those arriving with it included)."""
    t = request.arrival_time
    return sum(1 for r in requests if r is not request and r.arrival_time <= t and started[r.request_id] >= t)


def test_with_aging_every_wait_is_within_the_bound_and_only_earlier_arrivals_pass():
    rate = 0.02
    order = PriorityOrder(rate)
    requests, started = _replay(rate)
    assert len(started) == len(requests)
    for r in requests:
        a, begin, horizon = r.arrival_time, started[r.request_id], order.horizon(r.priority)
        wait = begin - a
        passed_by = [o for o in requests if a <= started[o.request_id] < begin and o is not r and o.arrival_time >= a]
        assert all(o.arrival_time <= a + horizon + 1e-9 for o in passed_by), (
            f"{r!r} (priority {r.priority}, arrived {a}) passed over by a request that arrived after {a + horizon}")
        q = _waiting_at(requests, started, r)
        n = sum(1 for o in requests if a < o.arrival_time <= a + horizon)
        bound = math.ceil((q + n + 1) / B) * L
        assert wait <= bound, f"{r!r} waited {wait} iterations, bound {bound} (Q={q}, n={n})"


def test_without_aging_low_priority_requests_starve():
    aged_requests, aged_started = _replay(0.02)
    requests, started = _replay(0.0)
    low = [r for r in requests if r.priority == 0.0]
    aged_low = [r for r in aged_requests if r.priority == 0.0]
    waits = [started[r.request_id] - r.arrival_time for r in low]
    aged_waits = [aged_started[r.request_id] - r.arrival_time for r in aged_low]
    print(f"\nlow-priority waits (iterations): longest {max(waits):.0f} without aging,"
          f" {max(aged_waits):.0f} with aging 0.02/iteration")
    assert max(waits) > 2.5 * max(aged_waits), (max(waits), max(aged_waits))  # and it grows with the span, the bound does not
