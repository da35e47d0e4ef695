"""SmolLM2-135M-Instruct on the CPU: the engine beside its limits, in one run.

For each weight format (``--dtypes``; the first is the reference of the goals) and each batch
size, on the same weights and threads, alternating A and B within each repeat (this machine is
shared and noisy: every speed is reported as a ratio to a reference measured in the same run,
fastest of ``--repeats``):

* **executor decode**: ``LLM("smollm2-135m-instruct", dtype=...)`` serves ``batch`` prompts of
  ``--prompt-len`` tokens and generates ``--output-len`` each (``ignore_eos``). The executor's
  iteration statistics time every iteration from its start to its record (schedule, KV
  preparation, forward, sampling, responses); the decode iterations are those with all
  ``batch`` requests generating and none in prefill, and their median is one decode step. The
  engine's forward (paged model forward, LM head, greedy pick) is timed inside each iteration,
  which gives the share of a step outside the forward. (The benchmark reaches into
  ``llm._executor.model_engine`` for that timer.)
* **dense forward**: the same model's modules (same packed weights, norms, RoPE) over a
  contiguous KV cache, ``(batch, kv_heads, positions, head_dim)`` per layer, with torch's SDPA:
  no pages, no plan, no executor. What the engine would cost if paging and serving were free.
* **prefill**: one ``--prefill-len``-token prompt through the executor (one chunk) against the
  dense forward of the same tokens.
* **the weights' bound**: the bytes a decode step reads (every linear weight in its stored
  format, the norms; the embedding's rows are negligible) over the memory bandwidth of a copy
  benchmark run in this process (bytes read + written per second, torch's ``copy_`` on 256 MB).
* **llama.cpp**: ms per generated token of ``llama-cpp-python`` on the same GGUF file and
  threads when it is importable (never a dependency; "not installed" otherwise).

Perplexity (``benchmarks.model.perplexity``: four ordinary English paragraphs) of every format against
float32 (what the 2% rule is measured against), float64, and the q/k rows left in llama.cpp's
order (a wrong layout, for scale).

    python -m benchmarks.model.decode_speed [--dtypes float16-weights,float32] [--batch-sizes 1,16,64]
        [--prompt-len 64] [--output-len 32] [--prefill-len 2048] [--repeats 3] [--threads N]
        [--skip-perplexity] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.model.perplexity import PARAGRAPHS, paragraph_ids, perplexity
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoints import load_llama_from_gguf, packaged_checkpoint_path
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM, apply_rotary
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_utils import default_checkpoint_dtype, load_model

MODEL = "smollm2-135m-instruct"
TOKENS_PER_BLOCK = 32
PERPLEXITY_FORMATS = ("float32", "float16-weights", "bfloat16", "float64")
GOALS = {  # name -> (limit, what the ratio is)
    "batch1_vs_dense": (1.2, "executor decode step / dense forward step, batch 1"),
    "batch16_vs_batch1": (2.0, "executor decode step, batch 16 / batch 1"),
    "batch1_vs_llama_cpp": (3.0, "executor ms per token, batch 1 / llama.cpp's"),
    "prefill_vs_dense": (1.3, "executor prefill / dense prefill"),
}


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
    """Times the engine's forwards (``TorchModelEngine._run``: model, LM head, greedy pick)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm._executor.model_engine
        self.spans: list[tuple[float, float]] = []  # (start, end), the executor's clock
        run = engine._run

        def timed(inputs):
            start = time.monotonic()
            try:
                return run(inputs)
            finally:
                self.spans.append((start, time.monotonic()))

        engine._run = timed

    def within(self, start: float, end: float) -> float:
        return sum(b - a for a, b in self.spans if a >= start and b <= end)


def executor_decode(llm: LLM, timer: ForwardTimer, prompts: list[list[int]], output_len: int) -> dict:
    before = len(llm.iteration_stats)
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    batch = len(prompts)
    stats = llm.iteration_stats[before:]
    steps = [s for s in stats if s.num_generation_requests == batch and s.num_context_requests == 0]
    if not steps:
        raise RuntimeError(f"no decode iteration ran all {batch} requests together")
    step = statistics.median(s.end_time - s.start_time for s in steps)
    forward = statistics.median(timer.within(s.start_time, s.end_time) for s in steps)
    return {"ms_per_step": step * 1e3, "forward_ms": forward * 1e3, "decode_iterations": len(steps)}


def executor_prefill(llm: LLM, timer: ForwardTimer, prompt: list[int]) -> float:
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
        x = inner.embed_tokens(ids)  # (B, T, hidden)
        cos, sin = inner.rotary_emb(torch.arange(start, start + T))  # (T, head_dim/2)
        end = start + T
        for layer, k_cache, v_cache in zip(inner.layers, self.k, self.v):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rotary(attn.q_proj(h).view(B, T, attn.n_head, attn.head_dim), cos, sin)  # (B, T, Hq, D)
            k = apply_rotary(attn.k_proj(h).view(B, T, attn.n_kv_head, attn.head_dim), cos, sin)  # (B, T, Hkv, D)
            k_cache[:, :, start:end] = k.transpose(1, 2)
            v_cache[:, :, start:end] = attn.v_proj(h).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end], is_causal=T > 1, scale=attn.scale,
                enable_gqa=True,
            )  # (B, Hq, T, D)
            x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, attn.n_head * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.compute_logits(inner.norm(x[:, -1]))  # (B, vocab)
        return logits.argmax(dim=-1)


def dense_decode(model: LlamaForCausalLM, prompts: list[list[int]], output_len: int) -> dict:
    dense = DenseForward(model, len(prompts), len(prompts[0]) + output_len)
    ids = torch.tensor(prompts)  # (B, prompt_len)
    token = dense.step(ids, 0)
    steps = []
    for i in range(output_len - 1):
        start = time.perf_counter()
        token = dense.step(token[:, None], ids.shape[1] + i)
        steps.append(time.perf_counter() - start)
    return {"ms_per_step": statistics.median(steps) * 1e3}


def dense_prefill(model: LlamaForCausalLM, prompt: list[int]) -> float:
    dense = DenseForward(model, 1, len(prompt))
    start = time.perf_counter()
    dense.step(torch.tensor([prompt]), 0)
    return (time.perf_counter() - start) * 1e3


# --------------------------------------------------------------------------- limits


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes read + written per second by torch's ``copy_`` between two float32 buffers."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes_per_step(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: every linear layer in its stored format (a tied
    LM head counted once, as the head), the norms; not the embedding (a few rows per step)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.weight.numel() * (2 if module.packed_float16 else module.weight.element_size())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            total += param.numel() * param.element_size()
    return total


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


def measure_perplexity(formats: tuple[str, ...] = PERPLEXITY_FORMATS) -> dict:
    path = packaged_checkpoint_path(MODEL)
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    texts = paragraph_ids(Tokenizer.from_gguf(path))
    result: dict = {"tokens": sum(len(t) - 1 for t in texts), "formats": {}}
    for dtype in formats:
        result["formats"][dtype] = perplexity(load_llama_from_gguf(path, dtype=dtype), texts)
    result["wrong_qk_float32"] = perplexity(load_llama_from_gguf(path, undo_qk_permutation=False), texts)
    reference = result["formats"]["float32"]
    result["relative_to_float32"] = {k: v / reference - 1 for k, v in result["formats"].items()}
    return result


# --------------------------------------------------------------------------- the run


def run_format(dtype: str, batches: list[int], args: argparse.Namespace) -> dict:
    max_batch = max(batches)
    positions = args.prompt_len + args.output_len + TOKENS_PER_BLOCK
    kv = KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=max_batch * positions + args.prefill_len + 2 * TOKENS_PER_BLOCK,
                       enable_block_reuse=False)
    dense_model = load_model(MODEL, dtype=dtype).model
    result: dict = {"dtype": dtype, "weight_bytes_per_step": weight_bytes_per_step(dense_model), "decode": []}
    max_tokens = max(args.prefill_len, max_batch * args.prompt_len)
    with LLM(MODEL, dtype=dtype, max_batch_size=max_batch, max_num_tokens=max_tokens, kv_cache_config=kv) as llm:
        timer = ForwardTimer(llm)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        for batch in batches:
            runs, dense = [], []
            for repeat in range(args.repeats):  # A, B, A, B, ...
                prompts = _prompts(llm.tokenizer, batch, args.prompt_len, salt=repeat)
                runs.append(executor_decode(llm, timer, prompts, args.output_len))
                dense.append(dense_decode(dense_model, prompts, args.output_len))
            best = min(runs, key=lambda r: r["ms_per_step"])
            dense_ms = min(r["ms_per_step"] for r in dense)
            result["decode"].append({
                "batch": batch, **best,
                "share_outside_forward": 1 - best["forward_ms"] / best["ms_per_step"],
                "ms_per_token": best["ms_per_step"] / batch, "tokens_per_s": 1e3 * batch / best["ms_per_step"],
                "dense_ms_per_step": dense_ms, "vs_dense": best["ms_per_step"] / dense_ms,
                "ms_per_step_all_runs": [round(r["ms_per_step"], 2) for r in runs],
                "dense_ms_per_step_all_runs": [round(r["ms_per_step"], 2) for r in dense],
            })
            _print_row(dtype, result["decode"][-1])
        if args.prefill_len:
            prompt_ids = _prompts(llm.tokenizer, 1, args.prefill_len, salt=99)[0]
            engine, dense = [], []
            for _ in range(args.repeats):
                engine.append(executor_prefill(llm, timer, prompt_ids))
                dense.append(dense_prefill(dense_model, prompt_ids))
            result["prefill"] = {"tokens": args.prefill_len, "ms": min(engine), "dense_ms": min(dense),
                                 "vs_dense": min(engine) / min(dense)}
            print(f"  {dtype:>16} prefill {args.prefill_len}: executor {min(engine):.0f} ms, dense {min(dense):.0f} ms"
                  f" ({min(engine) / min(dense):.2f}x)", flush=True)
    return result


def _print_row(dtype: str, row: dict) -> None:
    print(f"  {dtype:>16} {row['batch']:>5} {row['ms_per_step']:>9.1f} {row['ms_per_token']:>9.2f}"
          f" {row['tokens_per_s']:>9.1f} {100 * row['share_outside_forward']:>8.0f}% {row['dense_ms_per_step']:>9.1f}"
          f" {row['vs_dense']:>7.2f}x", flush=True)


def goals(reference: dict, llama_cpp: dict) -> dict:
    by_batch = {row["batch"]: row for row in reference["decode"]}
    ratios = {}
    if 1 in by_batch:
        ratios["batch1_vs_dense"] = by_batch[1]["vs_dense"]
        if llama_cpp.get("status") == "measured":
            ratios["batch1_vs_llama_cpp"] = by_batch[1]["ms_per_token"] / llama_cpp["ms_per_token"]
        if 16 in by_batch:
            ratios["batch16_vs_batch1"] = by_batch[16]["ms_per_step"] / by_batch[1]["ms_per_step"]
    if "prefill" in reference:
        ratios["prefill_vs_dense"] = reference["prefill"]["vs_dense"]
    return {name: {"ratio": ratios[name], "limit": GOALS[name][0], "met": ratios[name] <= GOALS[name][0],
                   "what": GOALS[name][1]} for name in GOALS if name in ratios}


def plot(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, fmt in enumerate(document["formats"]):
        color = f"C{i}"
        batches = [row["batch"] for row in fmt["decode"]]
        ax.plot(batches, [row["ms_per_step"] for row in fmt["decode"]], "o-", color=color, label=f"executor, {fmt['dtype']}")
        ax.plot(batches, [row["dense_ms_per_step"] for row in fmt["decode"]], "s--", color=color,
                label=f"dense forward, {fmt['dtype']}")
        ax.axhline(fmt["weight_bound_ms"], color=color, linestyle=":",
                   label=f"weights / bandwidth, {fmt['dtype']} ({fmt['weight_bytes_per_step'] / 1e6:.0f} MB)")
    cpp = document["llama_cpp"]
    if cpp.get("status") == "measured":
        ax.plot([1], [cpp["ms_per_token"]], "k*", markersize=12, label="llama.cpp (Q4_1), batch 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("ms per decode step")
    config = document["config"]
    ax.set_title(f"{MODEL} on the CPU, {config['threads']} threads, prompt {config['prompt_len']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default=f"{default_checkpoint_dtype()},float32",
                        help="weight formats, comma-separated; the first is the goals' reference")
    parser.add_argument("--batch-sizes", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=2048, help="0: no prefill comparison")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is reported")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a plot of ms/step against batch size here (PNG)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]

    bandwidth = copy_bandwidth()
    print(f"{MODEL}, CPU, {args.threads} threads; prompt {args.prompt_len} tokens, {args.output_len} generated;"
          f" copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)")
    print(f"  {'dtype':>16} {'batch':>5} {'ms/step':>9} {'ms/token':>9} {'tokens/s':>9} {'!forward':>9}"
          f" {'dense ms':>9} {'vs dense':>8}")
    formats = []
    for dtype in dtypes:
        fmt = run_format(dtype, batches, args)
        fmt["weight_bound_ms"] = fmt["weight_bytes_per_step"] / bandwidth * 1e3
        print(f"  {dtype:>16} weights read per step {fmt['weight_bytes_per_step'] / 1e6:.0f} MB"
              f" -> {fmt['weight_bound_ms']:.1f} ms at the copy bandwidth", flush=True)
        formats.append(fmt)

    cpp = llama_cpp_ms_per_token(args.threads, _prompts(_tokenizer(), 1, args.prompt_len)[0], args.output_len)
    print(f"llama.cpp: {cpp['status']}" + (f", {cpp['ms_per_token']:.1f} ms/token" if "ms_per_token" in cpp else ""))
    met = goals(formats[0], cpp)
    print(f"goals ({dtypes[0]}):")
    for name, goal in met.items():
        print(f"  {goal['what']:<52} {goal['ratio']:>6.2f}  (<= {goal['limit']}: {'met' if goal['met'] else 'missed'})")

    ppl = None
    if not args.skip_perplexity:
        ppl = measure_perplexity()
        print(f"\nperplexity on {len(PARAGRAPHS)} paragraphs ({ppl['tokens']} predicted tokens)")
        for dtype, value in ppl["formats"].items():
            print(f"  {dtype:>16} {value:.4f}   ({100 * ppl['relative_to_float32'][dtype]:+.3f}% against float32)")
        print(f"  q/k left permuted {ppl['wrong_qk_float32']:.4f}   ({ppl['wrong_qk_float32'] / ppl['formats']['float32']:.1f}x)")

    document = {
        "config": {**vars(args), "model": MODEL, "batch_sizes": batches, "dtypes": dtypes},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "formats": formats,
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
