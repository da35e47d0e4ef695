"""What KV cache events cost the executor loop: the same traffic with events off and on, alternated.

The real executor (simulated engine, bookkeeping KV, CPU clock of the thread) runs ``--active``
long generation requests while a steady stream of short requests with prompts of their own
arrives, in a pool small enough that every iteration evicts: each iteration commits blocks
(stored events), drops blocks from the tree (removed) and, with ``--host-blocks``, moves them
to and from the host tier (moved). With events on, a reader drains the buffer after every step,
as ``LLM.get_kv_cache_events`` or the ZMQ publisher would (its time is not the loop's and is not
counted). Rounds alternate off and on (A B A B ...); each round's median step time is compared
with its partner's, and the ratio's median over rounds is the result (``on / off``: 1.0 means
free).

    python -m benchmarks.host_path.kv_events [--active 64] [--rounds 6] [--iterations 150] [--host-blocks 256] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedModelEngine
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.sampling.synthetic_sampler import SyntheticSampler

VOCAB = 32000
TOKENS_PER_BLOCK = 32
PROMPT_LEN = 256
NEW_PER_ITERATION = 2
KV_BYTES_PER_TOKEN = 64  # bookkeeping mode: only sizes the host tier


def _prompt(index: int) -> list[int]:
    return [1 + (index * 104729 + i * 31) % (VOCAB - 1) for i in range(PROMPT_LEN)]


LONG_OUTPUT = 320  # the active requests' max_new_tokens: they hold their blocks to completion
WARMUP = 80  # untimed iterations of the short stream first
SPARE_BLOCKS = 48  # beyond what the active requests reserve: the short ones cycle through these, evicting


def _executor(active: int, host_blocks: int, events: bool):
    blocks_per_request = -(-(PROMPT_LEN + LONG_OUTPUT) // TOKENS_PER_BLOCK)
    config = ExecutorConfig(
        max_batch_size=active + 64, max_num_tokens=active + 2048, max_seq_len=PROMPT_LEN + LONG_OUTPUT,
        enable_chunked_prefill=True,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK, num_blocks=active * blocks_per_request + SPARE_BLOCKS,
            host_cache_size=host_blocks * TOKENS_PER_BLOCK * KV_BYTES_PER_TOKEN,
            event_buffer_max_size=100_000 if events else 0),
    )
    return create_py_executor(config, engine_factory=lambda kv: SimulatedModelEngine(config.max_num_tokens, kv, vocab_size=VOCAB),
                              sampler=SyntheticSampler(VOCAB), kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def run_round(active: int, iterations: int, host_blocks: int, events: bool) -> dict:
    executor = _executor(active, host_blocks, events)
    buffer = executor.kv_cache_manager.events
    for i in range(active):
        executor.enqueue_request(LlmRequest(_prompt(i), max_new_tokens=LONG_OUTPUT))
    while any(r.is_context_init_state for r in executor.active_requests) or not executor.active_requests:
        executor.step()
    index = active
    for _ in range(WARMUP):  # until the cached blocks fill the pool: from then on every iteration evicts
        for _ in range(NEW_PER_ITERATION):
            executor.enqueue_request(LlmRequest(_prompt(index), max_new_tokens=4))
            index += 1
        executor.step()
    if buffer is not None:
        buffer.take()
    pool = executor.kv_cache_manager.pool
    evicted = pool.num_evictions
    steps, emitted = [], 0
    for _ in range(iterations):
        for _ in range(NEW_PER_ITERATION):
            executor.enqueue_request(LlmRequest(_prompt(index), max_new_tokens=4))
            index += 1
        start = time.thread_time_ns()
        executor.step()
        steps.append((time.thread_time_ns() - start) / 1e3)
        if buffer is not None:
            emitted += len(buffer.take())
    return {"step_us": statistics.median(steps), "events_per_step": emitted / iterations,
            "evictions": pool.num_evictions - evicted, "offloads": pool.num_offloads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--active", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each, alternated off / on")
    parser.add_argument("--iterations", type=int, default=150, help="timed iterations per round")
    parser.add_argument("--host-blocks", type=int, default=256, help="the host tier (0: none)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ratios, rows = [], []
    for i in range(args.rounds):
        off = run_round(args.active, args.iterations, args.host_blocks, events=False)
        on = run_round(args.active, args.iterations, args.host_blocks, events=True)
        ratio = on["step_us"] / off["step_us"]
        ratios.append(ratio)
        rows.append({"round": i, "off": off, "on": on, "ratio": round(ratio, 4)})
        print(f"round {i}: off {off['step_us']:8.1f} us/step  on {on['step_us']:8.1f} us/step  ratio {ratio:.3f}"
              f"  ({on['events_per_step']:.1f} events/step, {on['evictions']} evictions, {on['offloads']} offloads)",
              flush=True)
    summary = {"median_ratio_on_over_off": round(statistics.median(ratios), 4),
               "rounds_on_slower": sum(r > 1 for r in ratios), "rounds": args.rounds}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"prompt_len": PROMPT_LEN, "tokens_per_block": TOKENS_PER_BLOCK,
                                               "new_requests_per_iteration": NEW_PER_ITERATION, "clock": "thread cpu"},
                       "results": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
