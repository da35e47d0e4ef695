"""SmolLM2-135M-Instruct on the CPU: every weight format beside the memory roofline, in one run.

For each weight format (``--formats``; the first, ``float16-weights`` by default, is the reference
of the goals) and each batch size, on the same threads, the formats alternated within each repeat
(this machine is shared and noisy: every speed is compared as a ratio within the run, fastest of
``--repeats``)::

    format            weights                                          activations, KV
    float32           the packaged file dequantised, float32           float32
    bfloat16          dequantised, bfloat16 (F.linear)                 bfloat16
    float16-weights   dequantised, float16 (fbgemm)                    float32
    gguf-Q4_1         the packaged file's Q4_1 blocks kept (int4)      bfloat16
    gguf-Q8_0         a Q8_0 rewrite of it, blocks kept (int4 planes)  bfloat16
    gguf-Q4_0         a Q4_0 rewrite of it, blocks kept (int4)         bfloat16

(``benchmarks/model/gguf_variants.py`` writes the Q8_0 and Q4_0 files; the gguf formats' LM head is
the Q8_0 embedding in float16, for float32 logits: ``modules/linear_methods.logits_method``.)

* **the roofline**: the bytes a decode step must read (every linear layer's weight in the format
  it is stored in, constants included, and the norms; the embedding's few rows are left out)
  over the copy bandwidth measured in this process before the formats run (torch's ``copy_`` of
  256 MB: bytes read + written per second). Printed per format, with the step against it.
* **executor decode**: ``LLM(...)`` serves ``batch`` prompts of ``--prompt-len`` tokens and generates
  ``--output-len`` each (``ignore_eos``). The executor's iteration statistics time every iteration
  from its start to its record (schedule, KV preparation, forward, sampling, responses); the
  decode iterations are those with all ``batch`` requests generating, and their median is one
  decode step. The engine's forward (paged model forward, LM head, greedy pick) is timed inside
  each iteration, which gives the share of a step outside the forward.
* **dense forward** (``--dense``): the same model object's modules over a contiguous KV cache with
  torch's SDPA: no pages, no plan, no executor.
* **prefill** (``--prefill-len``): one prompt through the executor (one chunk) against the dense
  forward of the same tokens.
* **llama.cpp**: ms per generated token of ``llama-cpp-python`` on the packaged file and threads
  when it is importable (never a dependency; "not installed" otherwise).

Perplexity (``benchmarks.model.perplexity``: four ordinary English paragraphs) of every format, each
against the float32 dequantisation of its own file (the 1% rule), with float64 and the q/k rows
left in llama.cpp's order (a wrong layout) for scale.

    python -m benchmarks.model.decode_speed [--formats float16-weights,gguf-Q4_1,...] [--batch-sizes 1,16]
        [--prompt-len 64] [--output-len 32] [--prefill-len 0] [--repeats 3] [--threads N] [--dense]
        [--clock wall|cpu] [--skip-perplexity] [--json OUT.json] [--plot OUT.png]

``--clock cpu --threads 1`` times the forward in CPU time of the executor's thread (and the copy
likewise): on a machine shared with other work, wall-clock times move by several times between
runs, CPU time much less (memory-bandwidth contention remains).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.model.gguf_variants import variant_path
from benchmarks.model.perplexity import PARAGRAPHS, paragraph_ids, perplexity
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoints import load_llama_from_gguf, packaged_checkpoint_path
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm.llmapi import KvCacheConfig

MODEL = "smollm2-135m-instruct"
TOKENS_PER_BLOCK = 32
DEFAULT_FORMATS = "float16-weights,gguf-Q4_1,gguf-Q8_0,gguf-Q4_0,bfloat16,float32"
GOALS = {  # name -> (limit, what the ratio is)
    "batch1_vs_roofline": (2.0, "reference format: batch-1 step / its weights' roofline"),
    "batch16_vs_batch1": (2.0, "reference format: batch-16 step / batch-1 step"),
    "quantized_batch1_vs_reference": (0.5, "each gguf format: batch-1 step / the reference's"),
    "quantized_perplexity": (0.01, "each gguf format: perplexity against its file dequantised (relative)"),
    "batch1_vs_llama_cpp": (3.0, "reference format: ms per token, batch 1 / llama.cpp's"),
}


@dataclass(frozen=True, slots=True)
class Format:
    """A weight format: the file it is loaded from and how."""

    name: str
    path: Path
    dtype: str | None
    quantization: str

    @staticmethod
    def parse(name: str, variants: Path | None) -> Format:
        if name.startswith("gguf-"):
            return Format(name, variant_path(name.removeprefix("gguf-"), variants), None, "gguf")
        return Format(name, packaged_checkpoint_path(MODEL), name, "none")

    def llm_kwargs(self) -> dict:
        return {"dtype": self.dtype, "quantization": self.quantization}


def _prompts(tokenizer, batch: int, prompt_len: int, salt: int = 0) -> list[list[int]]:
    """Distinct prompts (no prefix reuse between them, nor between repeats) of exactly ``prompt_len`` tokens."""
    prompts = []
    for i in range(batch):
        text = f"Note {salt}.{i}. " + " ".join(PARAGRAPHS[j % len(PARAGRAPHS)] for j in range(i, i + 4 + prompt_len // 64))
        ids = tokenizer.encode(text)
        if len(ids) < prompt_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, fewer than {prompt_len}")
        prompts.append(ids[:prompt_len])
    return prompts


# --------------------------------------------------------------------------- the executor


class ForwardTimer:
    """Times the engine's forwards (``TorchModelEngine._run``: model, LM head, greedy pick), on the
    executor's clock and in CPU time of the executor's thread (``--clock cpu``)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm._executor.model_engine
        self.spans: list[tuple[float, float, float]] = []  # (start, end) on the executor's clock, CPU seconds
        run = engine._run

        def timed(inputs):
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return run(inputs)
            finally:
                self.spans.append((start, time.monotonic(), time.thread_time() - cpu))

        engine._run = timed

    def within(self, start: float, end: float) -> float:
        return sum(b - a for a, b, _ in self.spans if a >= start and b <= end)

    def cpu_within(self, start: float, end: float) -> float:
        return sum(c for a, b, c in self.spans if a >= start and b <= end)


def executor_decode(llm: LLM, timer: ForwardTimer, prompts: list[list[int]], output_len: int, clock: str = "wall") -> dict:
    before = len(llm.iteration_stats)
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    batch = len(prompts)
    stats = llm.iteration_stats[before:]
    steps = [s for s in stats if s.num_generation_requests == batch and s.num_context_requests == 0]
    if not steps:
        raise RuntimeError(f"no decode iteration ran all {batch} requests together")
    step = statistics.median(s.end_time - s.start_time for s in steps)
    forward = statistics.median(timer.within(s.start_time, s.end_time) for s in steps)
    if clock == "cpu":  # the forward's CPU time on the executor's thread (one thread: all of its work)
        forward_cpu = statistics.median(timer.cpu_within(s.start_time, s.end_time) for s in steps)
        return {"ms_per_step": forward_cpu * 1e3, "forward_ms": forward_cpu * 1e3, "wall_ms_per_step": step * 1e3,
                "decode_iterations": len(steps)}
    return {"ms_per_step": step * 1e3, "forward_ms": forward * 1e3, "decode_iterations": len(steps)}


def executor_prefill(llm: LLM, prompt: list[int]) -> float:
    """The ms of ``prompt``'s prefill through the executor, required to run as one chunk."""
    before = len(llm.iteration_stats)
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    chunks = [s for s in llm.iteration_stats[before:] if s.num_context_requests == 1]
    if len(chunks) != 1 or chunks[0].forward_tokens != len(prompt):
        raise RuntimeError(f"the {len(prompt)}-token prompt did not run as one chunk")
    return (chunks[0].end_time - chunks[0].start_time) * 1e3


# --------------------------------------------------------------------------- the dense forward


class DenseForward:
    """The model's own modules over a contiguous KV cache: no paging, no executor, no checks."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int) -> None:
        config = model.config
        self.model = model
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=config.torch_dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=config.torch_dtype) for _ in range(config.num_layers)]

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (B, T) at positions [start, start + T) (a prefill from 0, or one decode token) ->
        the greedy next token of each sequence (B,)."""
        inner = self.model.model
        B, T = ids.shape
        x = inner.embed_tokens(ids.reshape(-1))  # (B * T, hidden)
        cos, sin = inner.rotary_emb(torch.arange(start, start + T).repeat(B))  # (B * T, head_dim/2)
        end = start + T
        for layer, k_cache, v_cache in zip(inner.layers, self.k, self.v):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # (B * T, heads, head_dim)
            k_cache[:, :, start:end] = k.reshape(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
            v_cache[:, :, start:end] = v.reshape(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
            y = F.scaled_dot_product_attention(
                q.reshape(B, T, attn.n_head, attn.head_dim).transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end],
                is_causal=T > 1, scale=attn.scale, enable_gqa=True,
            )  # (B, Hq, T, D)
            x = layer.finish(x, y.transpose(1, 2).reshape(B * T, attn.n_head, attn.head_dim))
        last = inner.norm(x.view(B, T, -1)[:, -1])  # (B, hidden)
        return self.model.compute_logits(last).argmax(dim=-1)


def dense_decode(model: LlamaForCausalLM, prompts: list[list[int]], output_len: int) -> float:
    dense = DenseForward(model, len(prompts), len(prompts[0]) + output_len)
    ids = torch.tensor(prompts)  # (B, prompt_len)
    token = dense.step(ids, 0)
    steps = []
    for i in range(output_len - 1):
        start = time.perf_counter()
        token = dense.step(token[:, None], ids.shape[1] + i)
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1e3


def dense_prefill(model: LlamaForCausalLM, prompt: list[int]) -> float:
    dense = DenseForward(model, 1, len(prompt))
    start = time.perf_counter()
    dense.step(torch.tensor([prompt]), 0)
    return (time.perf_counter() - start) * 1e3


# --------------------------------------------------------------------------- limits


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes read + written per second by torch's ``copy_`` between two float32 buffers."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        dst.copy_(src)
        best = min(best, clock() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes_per_step(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: every linear layer in the format it is stored in
    (``linear_formats``: packed float16, int4 codes and their constants, ...), and the norms; not
    the embedding (a few rows per step)."""
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("norm.weight"))
    return model.linear_formats.weight_bytes + norms


def llama_cpp_ms_per_token(threads: int, prompt: list[int], output_len: int) -> dict:
    try:
        import llama_cpp  # noqa: F401  (optional: never a dependency)
    except ImportError:
        return {"status": "not installed"}
    llm = llama_cpp.Llama(model_path=str(packaged_checkpoint_path(MODEL)), n_threads=threads, n_ctx=512,
                          n_batch=512, verbose=False)
    best = float("inf")
    for _ in range(3):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(output_len):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        best = min(best, (time.perf_counter() - start) / output_len)
    return {"status": "measured", "ms_per_token": best * 1e3, "version": getattr(llama_cpp, "__version__", "?")}


# --------------------------------------------------------------------------- perplexity


def measure_perplexity(formats: list[Format]) -> dict:
    """Each format's perplexity, against its own file dequantised to float32; float64 and the wrong
    q/k layout of the packaged file for scale."""
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    packaged = packaged_checkpoint_path(MODEL)
    texts = paragraph_ids(Tokenizer.from_gguf(packaged))
    dequantized: dict[Path, float] = {}
    result: dict = {"tokens": sum(len(t) - 1 for t in texts), "formats": {}}
    for fmt in formats:
        if fmt.path not in dequantized:
            dequantized[fmt.path] = perplexity(load_llama_from_gguf(fmt.path, dtype="float32"), texts)
        keep = fmt.quantization == "gguf"
        model = load_llama_from_gguf(fmt.path, dtype=fmt.dtype or "bfloat16", keep_quantized=keep)
        value = perplexity(model, texts)
        base = dequantized[fmt.path]
        result["formats"][fmt.name] = {"perplexity": value, "file_float32": base, "relative": value / base - 1}
    result["float64"] = perplexity(load_llama_from_gguf(packaged, dtype="float64"), texts)
    result["wrong_qk_float32"] = perplexity(load_llama_from_gguf(packaged, undo_qk_permutation=False), texts)
    return result


# --------------------------------------------------------------------------- the run


class Served:
    """One format's LLM, its forward timer and (the same object) its model, for the dense forward."""

    def __init__(self, fmt: Format, args: argparse.Namespace, max_batch: int) -> None:
        positions = args.prompt_len + args.output_len + TOKENS_PER_BLOCK
        kv = KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK,
                           max_tokens=max_batch * positions + args.prefill_len + 2 * TOKENS_PER_BLOCK,
                           enable_block_reuse=False)
        max_tokens = max(args.prefill_len, max_batch * args.prompt_len)
        self.format = fmt
        self.llm = LLM(str(fmt.path), max_batch_size=max_batch, max_num_tokens=max_tokens, kv_cache_config=kv,
                       **fmt.llm_kwargs())
        self.model = self.llm._executor.model_engine.model
        self.timer = ForwardTimer(self.llm)
        self.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up

    def close(self) -> None:
        self.llm.shutdown()


def run(args: argparse.Namespace, formats: list[Format], bandwidth: float) -> list[dict]:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    served = [Served(fmt, args, max(batches)) for fmt in formats]
    results = []
    for s in served:
        nbytes = weight_bytes_per_step(s.model)
        results.append({"format": s.format.name, "linear_layers": s.model.linear_formats.describe(),
                        "weight_bytes_per_step": nbytes, "roofline_ms": nbytes / bandwidth * 1e3, "decode": []})
        print(f"  {s.format.name:>16}: {s.model.linear_formats.describe()}", flush=True)
    tokenizer = served[0].llm.tokenizer
    for batch in batches:
        runs: dict[str, list[dict]] = {s.format.name: [] for s in served}
        dense: dict[str, list[float]] = {s.format.name: [] for s in served}
        for repeat in range(args.repeats):  # every format once per repeat: A, B, C, A, B, C, ...
            prompts = _prompts(tokenizer, batch, args.prompt_len, salt=repeat)
            for s in served:
                runs[s.format.name].append(executor_decode(s.llm, s.timer, prompts, args.output_len, args.clock))
                if args.dense:
                    dense[s.format.name].append(dense_decode(s.model, prompts, args.output_len))
        for s, result in zip(served, results):
            best = min(runs[s.format.name], key=lambda r: r["ms_per_step"])
            outside = None if args.clock == "cpu" else 1 - best["forward_ms"] / best["ms_per_step"]  # cpu: forward only
            row = {"batch": batch, **best, "share_outside_forward": outside,
                   "ms_per_token": best["ms_per_step"] / batch, "tokens_per_s": 1e3 * batch / best["ms_per_step"],
                   "vs_roofline": best["ms_per_step"] / result["roofline_ms"],
                   "ms_per_step_all_runs": [round(r["ms_per_step"], 2) for r in runs[s.format.name]]}
            if args.dense:
                row["dense_ms_per_step"] = min(dense[s.format.name])
                row["vs_dense"] = best["ms_per_step"] / row["dense_ms_per_step"]
            result["decode"].append(row)
            print(f"  {s.format.name:>16} batch {batch:>3}: {row['ms_per_step']:7.1f} ms/step"
                  f" ({row['vs_roofline']:.2f}x its roofline {result['roofline_ms']:.1f} ms)"
                  + ("" if outside is None else f", {100 * outside:.0f}% outside the forward")
                  + (f", {row['vs_dense']:.2f}x dense" if args.dense else ""), flush=True)
    if args.prefill_len:
        for s, result in zip(served, results):
            prompt_ids = _prompts(tokenizer, 1, args.prefill_len, salt=99)[0]
            engine, dense_ms = [], []
            for _ in range(args.repeats):
                engine.append(executor_prefill(s.llm, prompt_ids))
                dense_ms.append(dense_prefill(s.model, prompt_ids))
            result["prefill"] = {"tokens": args.prefill_len, "ms": min(engine), "dense_ms": min(dense_ms),
                                 "vs_dense": min(engine) / min(dense_ms)}
    for s in served:
        s.close()
    return results


def table(results: list[dict], bandwidth: float) -> str:
    """The CPU decode table: per format, batch 1 against its roofline, batch 16 against batch 1."""
    reference = _step(results[0], 1)
    lines = [f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written); ms per step, fastest of the repeats",
             f"  {'format':>16} {'MB/step':>8} {'roofline':>9} {'batch 1':>8} {'/roof':>6} {'/ref':>6}"
             f" {'batch 16':>9} {'16 / 1':>7}"]
    for r in results:
        b1, b16 = _step(r, 1), _step(r, 16)
        lines.append(
            f"  {r['format']:>16} {r['weight_bytes_per_step'] / 1e6:8.1f} {r['roofline_ms']:9.2f}"
            f" {_num(b1, 8)} {_num(b1 and b1 / r['roofline_ms'], 6)} {_num(b1 and reference and b1 / reference, 6)}"
            f" {_num(b16, 9)} {_num(b1 and b16 and b16 / b1, 7)}")
    return "\n".join(lines)


def _step(result: dict, batch: int) -> float | None:
    return next((row["ms_per_step"] for row in result["decode"] if row["batch"] == batch), None)


def _num(value: float | None, width: int) -> str:
    return f"{value:{width}.2f}" if value else f"{'-':>{width}}"


def goals(results: list[dict], llama_cpp: dict, ppl: dict | None) -> dict:
    reference, ratios = results[0], {}
    b1, b16 = _step(reference, 1), _step(reference, 16)
    if b1:
        ratios["batch1_vs_roofline"] = b1 / reference["roofline_ms"]
        if llama_cpp.get("status") == "measured":
            ratios["batch1_vs_llama_cpp"] = b1 / llama_cpp["ms_per_token"]
        if b16:
            ratios["batch16_vs_batch1"] = b16 / b1
        quantized = [_step(r, 1) / b1 for r in results if r["format"].startswith("gguf-") and _step(r, 1)]
        if quantized:
            ratios["quantized_batch1_vs_reference"] = max(quantized)
    if ppl:
        relative = [abs(v["relative"]) for name, v in ppl["formats"].items() if name.startswith("gguf-")]
        if relative:
            ratios["quantized_perplexity"] = max(relative)
    return {name: {"ratio": ratios[name], "limit": GOALS[name][0], "met": ratios[name] <= GOALS[name][0],
                   "what": GOALS[name][1]} for name in GOALS if name in ratios}


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, fmt in enumerate(document["formats"]):
        color = f"C{i}"
        batches = [row["batch"] for row in fmt["decode"]]
        ax.plot(batches, [row["ms_per_step"] for row in fmt["decode"]], "o-", color=color, label=f"executor, {fmt['format']}")
        ax.axhline(fmt["roofline_ms"], color=color, linestyle=":",
                   label=f"roofline, {fmt['format']} ({fmt['weight_bytes_per_step'] / 1e6:.0f} MB)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("ms per decode step")
    config = document["config"]
    ax.set_title(f"{MODEL} on the CPU, {config['threads']} threads, prompt {config['prompt_len']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS,
                        help="weight formats, comma-separated (module docstring); the first is the goals' reference")
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=0, help="0: no prefill comparison")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is reported")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--dense", action="store_true", help="also time the dense forward of each format")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: a step is its forward's CPU time on the executor's thread, and the bandwidth the"
                             " copy's CPU time (needs --threads 1): what a machine shared with other work still shows")
    parser.add_argument("--variants-dir", type=Path, default=None, help="where the Q8_0 / Q4_0 files are written")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a plot of ms/step against batch size here (PNG)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    formats = [Format.parse(name, args.variants_dir) for name in args.formats.split(",") if name]
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times one thread: pass --threads 1")

    bandwidth = copy_bandwidth(clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
    print(f"{MODEL}, CPU, {args.threads} threads, {args.clock} clock; prompt {args.prompt_len} tokens,"
          f" {args.output_len} generated; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)", flush=True)
    results = run(args, formats, bandwidth)
    print(table(results, bandwidth))

    cpp = llama_cpp_ms_per_token(args.threads, _prompts(_tokenizer(), 1, args.prompt_len)[0], args.output_len)
    print(f"llama.cpp: {cpp['status']}" + (f", {cpp['ms_per_token']:.1f} ms/token" if "ms_per_token" in cpp else ""))
    ppl = None
    if not args.skip_perplexity:
        ppl = measure_perplexity(formats)
        print(f"perplexity on {len(PARAGRAPHS)} paragraphs ({ppl['tokens']} predicted tokens)")
        for name, value in ppl["formats"].items():
            print(f"  {name:>16} {value['perplexity']:.4f}   ({100 * value['relative']:+.3f}% against its file in float32,"
                  f" {value['file_float32']:.4f})")
        print(f"  {'float64':>16} {ppl['float64']:.4f}   q/k left permuted {ppl['wrong_qk_float32']:.4f}")
    met = goals(results, cpp, ppl)
    print(f"goals (reference {formats[0].name}):")
    for goal in met.values():
        print(f"  {goal['what']:<70} {goal['ratio']:>7.3f}  (<= {goal['limit']}: {'met' if goal['met'] else 'missed'})")

    document = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "model": MODEL},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "formats": results,
        "llama_cpp": cpp,
        "goals": met,
        "perplexity": ppl,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
    if args.plot:
        plot(document, args.plot)
    return 0


def _tokenizer():
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    return Tokenizer.from_gguf(packaged_checkpoint_path(MODEL))


if __name__ == "__main__":
    sys.exit(main())
