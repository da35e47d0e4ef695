"""What speculation costs a workload above ``max_concurrency``, by counts (CPU, overlap forced on).

The H100's default-workload line of ``benchmarks.model.speculative`` (64 requests at once,
``max_concurrency`` 16) ran drafts at 0.71x plain decoding with overlap on, at the same ITL. Wall
time on a shared CPU cannot say why; counts can. This serves the same workload shape, scaled down,
on a real torch model (``tiny-random``, float32) with the overlap scheduler forced on
(``disable_overlap_scheduler=False``: the CPU engine then builds forward n+1 before forward n's
tokens reach the requests, as the CUDA engine does), once with an n-gram ``speculative_config``
and once without, on the same executor for ``--rounds`` rounds (the benchmark serves the same
prompts three times: later rounds claim their prompts from the prefix cache), and compares:

* iterations, forwards, and the batch of each iteration (context chunks, generation requests,
  forward positions): the same schedule, or where it differs;
* overlap broken: iterations whose forward in flight had to complete before the next schedule;
* decode-graph forwards: forwards the CUDA engine replays a decode graph for (every sequence one
  new position, every request sampling, no prompt or beam rows: ``CudaGraphRunner.graph_size``'s
  rule over the forward's own ``ForwardInputs``), and their rows;
* drafting forwards: forwards with any draft position (first-draft padding, engine draft slots or
  host drafts), and the draft positions verified / accepted;
* KV step allocations: generation steps that went through ``KVCacheManager.allocate`` instead of
  the batch's one-lookup fast path (host work per request per iteration);
* deferrals (budget, KV capacity) and the blocks reserved for started requests at their peak.

Outputs are compared too (they must be equal: greedy verification). Exit 1 if a count that must
match (iterations, forwards, overlap, decode-graph forwards, drafting forwards above the limit)
does not, with ``--check``::

    python -m benchmarks.model.speculative_counts [--num-requests 32] [--max-concurrency 8]
        [--max-prompt-len 512] [--max-num-tokens 1024] [--max-tokens 24] [--rounds 2] [--check] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.scheduled_requests import ContextChunk

MUST_MATCH = ("iterations", "forwards", "overlap_broken", "graph_forwards", "graph_rows", "forward_tokens",
              "kv_step_allocations")


def count_rounds(model, prompts: list[list[int]], spec: SpeculativeConfig | None, *, max_num_tokens: int,
                 max_tokens: int | list[int], rounds: int, num_blocks: int = 8192, tokens_per_block: int = 32) -> list[dict]:
    """Serve ``prompts`` ``rounds`` times on one executor (overlap on); each round's counts.
    ``max_tokens``: every request's, or one per prompt."""
    config = ExecutorConfig(max_num_tokens=max_num_tokens, max_seq_len=4096, max_batch_size=64,
                            speculative_config=spec, disable_overlap_scheduler=False, enable_chunked_prefill=True,
                            kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, num_blocks=num_blocks))
    executor = create_py_executor(config, model=model)
    assert executor.overlap
    engine, kv = executor.model_engine, executor.kv_cache_manager
    launches: list[dict] = []
    step_allocations = [0]

    launch = engine._launch

    def counted_launch(inputs):  # the forward as built: what the CUDA engine would replay
        _, _, spans, drafts, beams = inputs.logit_layout()
        new, _, _ = inputs.attention_batch()
        graph = bool(new) and all(inputs.samples) and not spans and not beams and all(k == 1 for k in new)
        launches.append({"graph": graph, "rows": len(new) if graph else 0, "drafting": bool(drafts)})
        return launch(inputs)

    allocate = kv.allocate

    def counted_allocate(work, claim=None):
        if not isinstance(work, ContextChunk):
            step_allocations[0] += 1
        return allocate(work, claim)

    engine._launch = counted_launch
    kv.allocate = counted_allocate
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    results = []
    for _ in range(rounds):
        requests = [LlmRequest(input_token_ids=list(p), max_new_tokens=n) for p, n in zip(prompts, lengths)]
        for request in requests:
            executor.enqueue_request(request)
        first_stats, first_launch, allocations_before = len(executor.iteration_stats), len(launches), step_allocations[0]
        broken = peak_reserved = steps = 0
        first_token_steps = [None] * len(requests)  # the step after which each request had its first token
        while executor.has_work:
            flight = executor._in_flight
            if flight is not None and not flight.overlappable:
                broken += 1
            executor.step()
            peak_reserved = max(peak_reserved, kv.sequences.reserved_blocks)
            for index, request in enumerate(requests):
                if first_token_steps[index] is None and request.first_token_time is not None:
                    first_token_steps[index] = steps
            steps += 1
        assert all(r.error is None for r in requests), [r.error for r in requests if r.error]
        stats = executor.iteration_stats[first_stats:]
        ran = launches[first_launch:]
        results.append({
            "iterations": len(stats),
            "forwards": len(ran),
            "overlap_broken": broken,
            "graph_forwards": sum(r["graph"] for r in ran),
            "graph_rows": sum(r["rows"] for r in ran),
            "drafting_forwards": sum(r["drafting"] for r in ran),
            "forward_tokens": sum(s.forward_tokens for s in stats),
            "draft_tokens": sum(s.num_draft_tokens for s in stats),
            "accepted_draft_tokens": sum(s.num_accepted_draft_tokens for s in stats),
            "kv_step_allocations": step_allocations[0] - allocations_before,
            "budget_deferrals": sum(s.num_budget_deferrals for s in stats),
            "capacity_deferrals": sum(s.num_capacity_deferrals for s in stats),
            "peak_reserved_blocks": peak_reserved,
            "batches": [(s.num_context_requests, s.num_generation_requests, s.forward_tokens) for s in stats],
            "outputs": [tuple(r.output_token_ids) for r in requests],
            "first_token_steps": first_token_steps,
        })
    return results


def compare(speculative: list[dict], plain: list[dict]) -> list[dict]:
    """Per round: each count side by side, the iterations whose batch differs, whether outputs agree."""
    report = []
    for spec_round, plain_round in zip(speculative, plain):
        counts = {key: (spec_round[key], plain_round[key]) for key in spec_round
                  if key not in ("batches", "outputs", "first_token_steps")}
        differing = [(i, a, b) for i, (a, b) in enumerate(zip(spec_round["batches"], plain_round["batches"])) if a != b]
        report.append({"counts": counts, "differing_batches": differing,
                       "outputs_equal": spec_round["outputs"] == plain_round["outputs"]})
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the counts of MUST_MATCH are equal")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from benchmarks.model.speculative import default_prompts
    from tensorrt_llm.llmapi.llm_utils import load_model

    torch.set_num_threads(1)  # counts do not depend on it; a shared machine's time does
    model = load_model(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float32")).model
    prompts = default_prompts(args.num_requests, args.max_prompt_len, model.config.vocab_size)
    spec = SpeculativeConfig(max_draft_len=args.max_draft_len, max_matching_ngram_size=3,
                             max_concurrency=args.max_concurrency, acceptance_rate_threshold=0.3)
    common = dict(max_num_tokens=args.max_num_tokens, max_tokens=args.max_tokens, rounds=args.rounds)
    report = compare(count_rounds(model, prompts, spec, **common), count_rounds(model, prompts, None, **common))
    mismatched = False
    for index, round_ in enumerate(report):
        print(f"round {index}: {'count':22s} {'drafts':>8s} {'plain':>8s}")
        for key, (a, b) in round_["counts"].items():
            flag = "  <-- differs" if a != b and key in MUST_MATCH else ""
            mismatched |= bool(flag)
            print(f"         {key:22s} {a:8d} {b:8d}{flag}")
        print(f"         batches differing: {len(round_['differing_batches'])} {round_['differing_batches'][:6]}")
        print(f"         outputs equal: {round_['outputs_equal']}")
        mismatched |= not round_["outputs_equal"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rounds": report}, f, indent=2)
    if args.check and mismatched:
        raise SystemExit("speculation above max_concurrency costs more than plain decoding (see '<-- differs')")
    return {"rounds": report}


if __name__ == "__main__":
    main()
