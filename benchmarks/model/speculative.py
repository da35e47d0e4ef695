"""Speculative decoding (NGram) against none, A/B alternated in one run, with the overlap
scheduler on and off side by side: acceptance, tokens per forward, output tokens/s, ITL.

Two workloads:

* **repetitive**: the model is asked to repeat a given text (``--model`` with a tokenizer, e.g.
  SmolLM2: a chat prompt "Repeat this text exactly"; a random-weight model: token-id prompts made
  of a repeated random sequence). Output that copies its input is where prompt lookup pays.
  ``--batch`` may list several batch sizes (each served in turn by the same ``LLM``s).
* **default**: the replay's default scenario (``benchmarks.replay.scenario``; token-id prompts), its
  first ``--num-requests`` requests with their prompts cut to ``--max-prompt-len`` tokens and at
  most ``--max-tokens`` generated each, submitted together.

For each overlap mode of ``--overlap`` (``on``: the overlap scheduler forced on, ``off``: off,
``default``: the engine's, on for CUDA and off for the CPU), two ``LLM``s are built, one with
speculation and one without, and each of ``--repeats`` rounds serves a workload with speculation,
then without (order swapped every other round). The machine may be shared, so speeds are reported
as the ratio of the two measured in the same run (median over rounds), with absolute numbers
beside them. Greedy outputs must be equal, token for token (checked every round), in float32 and
float64 (a difference is printed as MISMATCH and the run exits 1 once its JSON is written); in
16-bit floats their agreement is reported (``_agreement``). A model with a tokenizer
stops at its end of text; a random-weight one generates ``--max-tokens``. Each workload's line
ends with the acceptance with overlap over the acceptance without, where both modes ran: drafts
proposed from the tokens the model produced keep it near 1.

    python -m benchmarks.model.speculative [--model smollm2-135m-instruct] [--workloads repetitive,default]
        [--batch 4 | --batch 1,4,8] [--overlap on,off] [--max-tokens 96] [--max-draft-len 4]
        [--max-matching-ngram-size 3] [--num-requests 16] [--max-prompt-len 512] [--repeats 3] [--device auto]
        [--kv-memory-fraction 0.4] [--max-concurrency N] [--acceptance-rate-threshold X]
        [--acceptance-rate-window-size 8] [--kv-cache-dtype auto|fp8] [--json OUT.json]

On a GPU every run uses the engine's defaults otherwise: CUDA graphs (a verification step replays
the decode graph of its rows), and under overlap the engine drafts each step built in flight on
the device (``speculative.device_drafting``). ``--disable-overlap-scheduler`` is ``--overlap off``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig, SpeculativeConfig
from tensorrt_llm.llmapi.llm import LLM, SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Actions speak louder than words. The early bird catches the worm. "
    "Knowledge is power, and time is money. Where there is a will, there is a way."
)


def repetitive_prompts(llm: LLM, batch: int) -> list:
    """``batch`` prompts whose answer repeats their input."""
    if llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompts = []
        for i in range(batch):
            sentences = TEXT.split(". ")
            text = ". ".join(sentences[i % len(sentences) :] + sentences[: i % len(sentences)])
            messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]
            prompts.append(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages)))
        return prompts
    vocab = llm.model_config.vocab_size
    return [[1 + (i * 7919 + j * 104729) % (vocab - 1) for j in range(24)] * 4 for i in range(batch)]


def default_prompts(num_requests: int, max_prompt_len: int, vocab: int) -> list[list[int]]:
    from benchmarks.replay.scenario import default_scenario

    trace = default_scenario()
    prompts = []
    for request in trace.requests[:num_requests]:
        tokens = [t % vocab for t in request.prompt_token_ids().tolist()[:max_prompt_len]]
        prompts.append(tokens or [1])
    return prompts


def run_once(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    start = time.perf_counter()
    handles = [llm.generate_async(p, params) for p in prompts]
    outputs = [tuple(h.result(timeout=3600).outputs[0].token_ids) for h in handles]
    wall = time.perf_counter() - start
    return {"outputs": outputs, "wall_s": wall}


def measure(llm: LLM, prompts: list, params: SamplingParams, max_concurrency: int | None = None) -> dict:
    """One workload served once: speeds, acceptance, and where the wall time went by iteration
    phase (``_phases``)."""
    before = len(llm.iteration_stats)
    run = run_once(llm, prompts, params)
    stats = llm.iteration_stats[before:]
    generated = sum(map(len, run["outputs"]))
    drafts = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_draft_tokens for s in stats)
    steps = sum(s.num_generation_requests for s in stats)  # forwards a generation request ran in
    iteration_ms = [1000 * (s.end_time - s.start_time) for s in stats if s.num_generation_requests]
    return {
        "outputs": run["outputs"],
        "wall_s": run["wall_s"],
        "output_tokens": generated,
        "output_tokens_per_s": generated / run["wall_s"],
        "iterations": len(stats),
        "forwards_per_request_token": len(stats) / max(1, generated / len(prompts)),
        "draft_tokens": drafts,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        # tokens a generation request gets per forward it runs in (1 without speculation)
        "tokens_per_forward": (steps + accepted) / steps if steps else 0.0,
        "iteration_ms": statistics.median(iteration_ms) if iteration_ms else 0.0,
        **_phases(stats, max_concurrency),
    }


def _phases(stats: list, max_concurrency: int | None) -> dict:
    """Host time (ms) by phase: iterations with more active requests than ``max_concurrency``
    (a speculative config drafts nothing there: it should cost what plain decoding does), the
    others, and those that verified drafts; with each phase's iteration count. The same phases
    of the plain run say what each costs without speculation."""
    limit = max_concurrency if max_concurrency is not None else float("inf")
    phases = {"above_limit": [], "at_or_below_limit": [], "drafting": []}
    for s in stats:
        ms = 1000 * (s.end_time - s.start_time)
        phases["above_limit" if s.num_active_requests > limit else "at_or_below_limit"].append(ms)
        if s.num_draft_tokens:
            phases["drafting"].append(ms)
    result = {}
    for name, times in phases.items():
        result[f"{name}_iterations"] = len(times)
        result[f"{name}_ms"] = sum(times)
        result[f"{name}_median_ms"] = statistics.median(times) if times else 0.0
    return result


def _agreement(speculative: list[tuple], plain: list[tuple]) -> dict:
    """How far greedy outputs with drafts follow those without: the share of requests whose
    outputs are identical, and the mean share of each output before the first difference."""
    identical = sum(a == b for a, b in zip(speculative, plain))
    prefixes = []
    for a, b in zip(speculative, plain):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(common / max(len(b), 1))
    return {"identical_requests": identical / max(len(plain), 1),
            "common_prefix_fraction": statistics.mean(prefixes) if prefixes else 1.0}


OVERLAP_MODES = {"on": False, "off": True, "default": None}  # -> disable_overlap_scheduler


def _serve_rounds(llms: dict[str, LLM], prompts: list, params: SamplingParams, repeats: int, exact: bool,
                  label: str, max_concurrency: int | None = None) -> dict:
    """``repeats`` A/B rounds of one workload on the ``ngram`` and ``none`` LLMs: medians, the speedup
    (median of each round's ratio) and the worst round's output agreement."""
    rounds: dict[str, list[dict]] = {"ngram": [], "none": []}
    agreements: list[dict] = []
    for repeat in range(repeats):
        order = ("ngram", "none") if repeat % 2 == 0 else ("none", "ngram")
        for name in order:
            rounds[name].append(measure(llms[name], prompts, params, max_concurrency))
        agreement = _agreement(rounds["ngram"][-1]["outputs"], rounds["none"][-1]["outputs"])
        agreements.append(agreement)
        if agreement["identical_requests"] < 1 and exact:  # recorded; main exits 1 once the JSON is written
            print(f"MISMATCH {label}: outputs with speculation differ from those without ({agreement})", flush=True)
    result = {key: min(a[key] for a in agreements) for key in agreements[0]}  # the worst round
    for name, runs in rounds.items():
        result[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "outputs"}
        # inter-token latency: a generation iteration's time over the tokens it gives a request
        result[name]["itl_ms"] = result[name]["iteration_ms"] / max(result[name]["tokens_per_forward"], 1.0)
    ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(rounds["ngram"], rounds["none"])]
    result["speedup_output_tokens_per_s"] = statistics.median(ratios)
    result["outputs"] = rounds["none"][-1]["outputs"]  # for the comparison across modes (dropped from the JSON)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workloads", default="repetitive,default")
    parser.add_argument("--batch", default="4", help="repetitive workload: prompts served together (a comma list: each in turn)")
    parser.add_argument("--overlap", default="on,off",
                        help="overlap modes, each with its own pair of LLMs: on, off, default (the engine's)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--max-matching-ngram-size", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=16, help="default workload: requests")
    parser.add_argument("--max-prompt-len", type=int, default=512, help="default workload: prompts cut to this")
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="SpeculativeConfig.max_concurrency: no drafts above this many generation requests")
    parser.add_argument("--acceptance-rate-threshold", type=float, default=None,
                        help="SpeculativeConfig: speculation off for good below this acceptance (with the window)")
    parser.add_argument("--acceptance-rate-window-size", type=int, default=8)
    parser.add_argument("--kv-memory-fraction", type=float, default=0.4,
                        help="on a GPU, each LLM's KV pool takes this share of the memory free when it starts: the two "
                             "LLMs (with and without drafts) share the device, and the second needs room for its weights")
    parser.add_argument("--disable-overlap-scheduler", action="store_true", help="the same as --overlap off")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    modes = ["off"] if args.disable_overlap_scheduler else args.overlap.split(",")
    unknown = [m for m in modes if m not in OVERLAP_MODES]
    if unknown:
        raise SystemExit(f"unknown --overlap mode(s) {unknown}: choose from {', '.join(OVERLAP_MODES)}")
    batches = [int(b) for b in str(args.batch).split(",")]

    common = dict(dtype=args.dtype, device=args.device, max_num_tokens=args.max_num_tokens, max_batch_size=64,
                  enable_chunked_prefill=True,
                  kv_cache_config=KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=args.kv_memory_fraction,
                                                dtype=args.kv_cache_dtype))
    spec = SpeculativeConfig(max_draft_len=args.max_draft_len, max_matching_ngram_size=args.max_matching_ngram_size,
                             max_concurrency=args.max_concurrency, acceptance_rate_threshold=args.acceptance_rate_threshold,
                             acceptance_rate_window_size=args.acceptance_rate_window_size)
    report: dict = {"config": vars(args), "results": {}}
    for mode in modes:
        overlap = {} if OVERLAP_MODES[mode] is None else {"disable_overlap_scheduler": OVERLAP_MODES[mode]}
        llms = {"ngram": LLM(args.model, speculative_config=spec, **common, **overlap),
                "none": LLM(args.model, **common, **overlap)}
        try:
            _run_mode(llms, mode, args, batches, report)
        finally:
            for llm in llms.values():
                llm.shutdown()
            del llms
            _release_device_memory()
        _write(report, args.json)  # after each mode: a run cut short by a timeout keeps what it measured
    _summarise(report, modes)
    _write(report, args.json)
    if report["exact_dtype"] and any(r["identical_requests"] < 1 for cases in report["results"].values()
                                     for r in cases.values()):
        raise SystemExit("greedy outputs with speculation differ from those without in an exact dtype (MISMATCH above)")
    return report


def _run_mode(llms: dict[str, LLM], mode: str, args, batches: list[int], report: dict) -> None:
    """Every workload (and batch size) with one overlap mode's pair of LLMs."""
    # A model with a tokenizer stops at its end of text (past it, SmolLM2 starts a new conversation
    # that repeats nothing: not the workload); a random-weight model generates max_tokens.
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=llms["none"].tokenizer is None)
    # Greedy outputs must be equal token for token where the arithmetic is exact enough (float32,
    # float64). In 16-bit floats a verification step (several rows per request) and a decode step
    # (one) run GEMMs of other shapes, which round differently, and a near-tie in the argmax can
    # flip: there the agreement is measured, not required (docs/sampling.md).
    exact = llms["none"].model_config.torch_dtype.itemsize >= 4
    report["exact_dtype"] = exact
    for workload in args.workloads.split(","):
        if workload == "repetitive":
            cases = [(f"repetitive_b{b}", repetitive_prompts(llms["none"], b)) for b in batches]
        elif workload == "default":
            cases = [("default", default_prompts(args.num_requests, args.max_prompt_len,
                                                 llms["none"].model_config.vocab_size))]
        else:
            raise SystemExit(f"unknown workload {workload!r}")
        for key, prompts in cases:
            result = _serve_rounds(llms, prompts, params, args.repeats, exact, f"{key}, overlap {mode}",
                                   args.max_concurrency)
            report["results"].setdefault(key, {})[mode] = result
            ngram, none = result["ngram"], result["none"]
            print(f"{key:16s} overlap {mode:7s}: acceptance {ngram['acceptance_rate']:.2f}, tokens/forward"
                  f" {ngram['tokens_per_forward']:.2f}, output tok/s {ngram['output_tokens_per_s']:.1f} vs"
                  f" {none['output_tokens_per_s']:.1f} (x{result['speedup_output_tokens_per_s']:.2f}, median of"
                  f" {args.repeats} A/B rounds), ITL {ngram['itl_ms']:.1f} vs {none['itl_ms']:.1f} ms; outputs"
                  f" identical for {result['identical_requests']:.0%} of requests", flush=True)
            print(f"{'':16s} host ms by phase (median of rounds), drafts vs plain: " + "; ".join(
                f"{phase} {ngram[phase + '_ms']:.0f} vs {none[phase + '_ms']:.0f}"
                f" ({ngram[phase + '_iterations']:.0f} vs {none[phase + '_iterations']:.0f} iterations,"
                f" median {ngram[phase + '_median_ms']:.2f} vs {none[phase + '_median_ms']:.2f})"
                for phase in ("above_limit", "at_or_below_limit", "drafting")), flush=True)


def _summarise(report: dict, modes: list[str]) -> None:
    """Per workload: the acceptance with overlap over the acceptance without, and whether the plain
    runs of the two modes gave the same outputs (they should: overlap changes no token)."""
    summary = {}
    for key, by_mode in report["results"].items():
        line = {mode: {"acceptance": r["ngram"]["acceptance_rate"], "speedup": r["speedup_output_tokens_per_s"],
                       "identical_requests": r["identical_requests"]} for mode, r in by_mode.items()}
        on, off = by_mode.get("on") or by_mode.get("default"), by_mode.get("off")
        if on is not None and off is not None and on is not off:
            accept_off = off["ngram"]["acceptance_rate"]
            line["acceptance_overlap_over_no_overlap"] = on["ngram"]["acceptance_rate"] / accept_off if accept_off else None
            line["plain_outputs_equal_across_modes"] = _agreement(on["outputs"], off["outputs"])["identical_requests"]
            ratio = line["acceptance_overlap_over_no_overlap"]
            print(f"{key:16s} acceptance with overlap / without: {'n/a' if ratio is None else f'{ratio:.2f}'};"
                  f" speedup with overlap x{on['speedup_output_tokens_per_s']:.2f}, without"
                  f" x{off['speedup_output_tokens_per_s']:.2f}")
        summary[key] = line
    report["summary"] = summary


def _write(report: dict, path: str | None) -> None:
    """The report as JSON (the outputs compared across modes left out)."""
    if not path:
        return
    results = {key: {mode: {k: v for k, v in r.items() if k != "outputs"} for mode, r in cases.items()}
               for key, cases in report["results"].items()}
    with open(path, "w") as f:
        json.dump({**report, "results": results}, f, indent=2)


def _release_device_memory() -> None:
    """Let the next pair of LLMs have the GPU memory of the last (their KV pools size to what is free)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
