"""Where a drafting step's host time goes under the overlap scheduler, on a GPU.

A small model's decode step is host-bound: the host's time per iteration is the step's time. With
n-gram drafts and overlap on, the CUDA engine drafts each step built in flight on the device
(``engine/in_flight.py``, ``speculative/triton_drafting.py``). This steps two executors by hand
(the executor's own thread is not started: every step runs here, where the profiler sees it), one
with speculation and one without, at batch ``--batch`` on ``benchmarks.model.speculative``'s
repetitive prompt (the engine's defaults: CUDA graphs, overlap on), and prints:

* per kind of step (plain, drafting with the fused kernel, drafting with the proposer's torch form,
  alternated window by window on the same executor): the host's time per ``PyExecutor.step`` and
  the part of it spent waiting for the device (``torch.cuda.Event.synchronize``: the previous
  forward's picks, or a staging buffer still in use), medians over ``--steps`` steps each;
* a torch.profiler table (CPU and CUDA activities) of ``--steps`` drafting steps with the fused
  kernel: the top host ops by self CPU time, the kernel launches and copies per step, and every
  CUDA runtime call that can block the host (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
  ``cudaDeviceSynchronize``, a blocking ``cudaMemcpy``, ``cudaHostAlloc`` / ``cudaMallocHost``,
  ``cudaFree``), with its count;
* the same launch and copy counts per step for ``--steps`` plain steps, and the difference (a
  drafting step's device ops over a plain one's: the goal is at most ~6);
* the staging's waits (``PinnedStaging.num_waits``; 0 expected).

    PYTHONPATH=. python3 -m benchmarks.gpu.draft_step_profile --model PATH [--dtype bfloat16] [--batch 1]
        [--steps 24] [--max-tokens 64] [--json OUT.json]

About 40 s on an H100 with SmolLM2-135M (model load and graph captures included).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import types

import torch

from benchmarks.model.speculative import repetitive_prompts
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.llmapi.llm_utils import load_model

# CUDA runtime calls that block the host (the Async copies and kernel launches do not)
BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpy2D",
            "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaFree", "cudaMalloc", "cudaStreamWaitEvent")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
COPIES = ("cudaMemcpyAsync",)


class WaitTimer:
    """Time the host spends in ``torch.cuda.Event.synchronize`` (waiting for the device)."""

    def __init__(self) -> None:
        self.waited = 0.0
        original = torch.cuda.Event.synchronize
        timer = self

        def synchronize(event):
            start = time.perf_counter()
            original(event)
            timer.waited += time.perf_counter() - start

        torch.cuda.Event.synchronize = synchronize


def build(model, spec: SpeculativeConfig | None, batch: int):
    config = ExecutorConfig(max_num_tokens=2048, max_batch_size=max(8, batch), max_seq_len=2048,
                            enable_chunked_prefill=True, speculative_config=spec, disable_overlap_scheduler=False,
                            kv_cache_config=KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.2,
                                                          num_blocks=None if model.device.type == "cuda" else 512))
    return create_py_executor(config, model=model)


def step_kind(iteration) -> str | None:
    """``drafting`` (some request verifies drafts), ``plain`` (generation only, none), else None."""
    batch = iteration.batch
    if batch.context_chunks or not batch.generation_requests:
        return None
    return "drafting" if any(r.py_draft_tokens for r in batch.generation_requests) else "plain"


def run(executor, prompts, args, timer: WaitTimer, want: int, kind: str) -> list[tuple[float, float]]:
    """Step ``executor`` (submitting the prompts again whenever it is idle) until ``want`` steps
    of ``kind`` were timed; their (host ms, of which waiting ms)."""
    timed: list[tuple[float, float]] = []
    for _ in range(50 * want + 500):
        if len(timed) == want:
            return timed
        if not executor.has_work:
            for prompt in prompts:
                executor.enqueue_request(LlmRequest(input_token_ids=prompt, max_new_tokens=args.max_tokens,
                                                    end_id=args.end_id))
        waited = timer.waited
        start = time.perf_counter()
        iteration = executor.step()
        elapsed = time.perf_counter() - start
        if iteration is not None and step_kind(iteration) == kind:
            timed.append((1e3 * elapsed, 1e3 * (timer.waited - waited)))
    raise RuntimeError(f"only {len(timed)} {kind} steps in {50 * want + 500} iterations")


def summary(timed: list[tuple[float, float]]) -> dict:
    return {"steps": len(timed), "host_ms": statistics.median(t for t, _ in timed),
            "waiting_ms": statistics.median(w for _, w in timed),
            "busy_ms": statistics.median(t - w for t, w in timed)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script (no device drafting there)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--max-matching-ngram-size", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model = loaded.model
    args.end_id = loaded.tokenizer.eos_token_id if loaded.tokenizer is not None else None
    served = types.SimpleNamespace(tokenizer=loaded.tokenizer, model_config=model.config)  # what the prompts read
    prompts = repetitive_prompts(served, args.batch)
    spec = SpeculativeConfig(max_draft_len=args.max_draft_len, max_matching_ngram_size=args.max_matching_ngram_size)
    timer = WaitTimer()
    drafted, plain = build(model, spec, args.batch), build(model, None, args.batch)
    engine = drafted.model_engine
    drafting = getattr(engine, "_drafting", None)  # the CUDA engine's (engine/in_flight.Drafting)
    fused_size = drafting.ngram_size if drafting is not None else None
    report: dict = {"config": {k: v for k, v in vars(args).items()}, "fused_kernel": fused_size is not None}
    print(f"drafting with the fused kernel: {fused_size is not None}", flush=True)
    run(drafted, prompts, args, timer, 4, "drafting")  # warm: first uploads, allocator blocks
    run(plain, prompts, args, timer, 4, "plain")
    kinds: dict[str, list] = collections.defaultdict(list)
    for window in range(4):  # A/B: the fused kernel, the torch form, plain, alternated
        for name in ("fused", "torch form") if fused_size is not None else ("torch form",):
            if drafting is not None:
                drafting.ngram_size = fused_size if name == "fused" else None
            kinds[f"drafting, {name}"] += run(drafted, prompts, args, timer, args.steps // 4 + 1, "drafting")
        kinds["plain"] += run(plain, prompts, args, timer, args.steps // 4 + 1, "plain")
    if drafting is not None:
        drafting.ngram_size = fused_size
    report["steps"] = {name: summary(timed) for name, timed in kinds.items()}
    for name, line in report["steps"].items():
        print(f"{name:22s}: host {line['host_ms']:.3f} ms per step, of which waiting for the device "
              f"{line['waiting_ms']:.3f} ms (busy {line['busy_ms']:.3f} ms), {line['steps']} steps", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        profiled = run(drafted, prompts, args, timer, args.steps, "drafting")
    events = profile.key_averages()
    per_step = len(profiled)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    calls = {event.key: event.count for event in events}
    report["profile"] = {
        "steps": per_step,
        "kernel_launches_per_step": sum(calls.get(name, 0) for name in LAUNCHES) / per_step,
        "async_copies_per_step": sum(calls.get(name, 0) for name in COPIES) / per_step,
        "blocking_calls": {name: calls[name] for name in BLOCKING if calls.get(name)},
        "top_host_ops": [{"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / per_step,
                          "calls_per_step": e.count / per_step}
                         for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]],
    }
    staging = getattr(engine, "_staging", None)
    report["staging_waits"] = staging.num_waits if staging is not None else None
    profile_line = report["profile"]
    print(f"per drafting step (profiled, {per_step} steps, the whole iteration: sampling, the previous forward's "
          f"completion): {profile_line['kernel_launches_per_step']:.1f} kernel/graph launches, "
          f"{profile_line['async_copies_per_step']:.1f} async copies; blocking calls: "
          f"{profile_line['blocking_calls'] or 'none'}; staging waits {report['staging_waits']}", flush=True)
    with torch.profiler.profile(activities=activities) as profile:  # the same counts for plain steps
        plain_steps = len(run(plain, prompts, args, timer, args.steps, "plain"))
    calls = {event.key: event.count for event in profile.key_averages()}
    report["profile_plain"] = {
        "steps": plain_steps,
        "kernel_launches_per_step": sum(calls.get(name, 0) for name in LAUNCHES) / plain_steps,
        "async_copies_per_step": sum(calls.get(name, 0) for name in COPIES) / plain_steps,
    }
    plain_line = report["profile_plain"]

    def device_ops(line: dict) -> float:
        return line["kernel_launches_per_step"] + line["async_copies_per_step"]

    report["drafting_device_ops_over_plain"] = device_ops(profile_line) - device_ops(plain_line)
    print(f"per plain step (profiled, {plain_steps} steps, the whole iteration): "
          f"{plain_line['kernel_launches_per_step']:.1f} kernel/graph launches, "
          f"{plain_line['async_copies_per_step']:.1f} async copies; a drafting step's device ops over a plain "
          f"one: {report['drafting_device_ops_over_plain']:+.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
