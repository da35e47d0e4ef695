"""Perplexity of a model on a few ordinary English paragraphs: a loader check in one number.

A checkpoint loaded wrong in a small way (q/k rows left in llama.cpp's interleaved RoPE order,
a transposed tensor, a wrong dequantisation) often still writes fluent short text, but its
perplexity on plain prose rises several-fold. A 135M-parameter model scores roughly 7-30 here.

The paragraphs were written for this project (no data set is downloaded).

:func:`paged_perplexity` computes the same number through the executor's forward over the paged
KV cache, chunk by chunk, with the pool storing ``kv_cache_config.dtype`` (``auto`` or ``fp8``):
what an FP8 cache costs in quality, in one number, with the FP8 scales 1.0 (``unit``) or derived
at start-up from the built-in calibration text (``derived``: ``models/kv_calibration.py``, what
``LLM`` does for a checkpoint without scales). ``--text held-out`` scores three paragraphs written
for measuring the FP8 cache on text nothing was tuned or calibrated on (``HELD_OUT_PARAGRAPHS``),
each reported alone as well. From the checkout:

    python -m benchmarks.model.perplexity [--model smollm2-135m-instruct] [--dtype float32]
        [--kv-cache-dtypes auto,fp8] [--kv-scales unit,derived] [--text suite|held-out]
        [--chunk-size 16] [--device cpu] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Sequence

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import kv_cache_dtype

PARAGRAPHS = (
    "The village library opens at nine in the morning and closes at six in the evening. On Saturdays "
    "it stays open until noon, and a volunteer reads stories to the children who gather on the carpet "
    "near the window. Most people come to borrow novels or to use the computers, but a few older "
    "residents visit every day simply to read the newspaper and talk with their neighbours.",
    "To make a simple vegetable soup, start by chopping an onion, two carrots and a few sticks of "
    "celery. Warm some olive oil in a large pot, add the vegetables and cook them slowly for about ten "
    "minutes, until they are soft. Then pour in enough water or stock to cover them, add a pinch of salt, "
    "and let the soup simmer for half an hour before you serve it with fresh bread.",
    "Rain had been falling since the early afternoon, and by the time the train reached the city the "
    "streets were shining under the lights. She pulled her coat tighter, picked up her small suitcase "
    "and stepped onto the platform. Nobody was waiting for her, but she had expected that. She checked "
    "the address on the letter one more time and walked towards the exit.",
    "Regular exercise is one of the best things you can do for your health. Even a short walk every day "
    "can improve your mood, help you sleep better and lower the risk of heart disease. Doctors usually "
    "recommend at least two and a half hours of moderate activity each week, such as brisk walking, "
    "cycling or swimming, spread over several days.",
)


# Written for the FP8 cache's measurement (docs/gpu.md); used by nothing else, tuned on nothing.
HELD_OUT_PARAGRAPHS = (
    "The harbour master kept a ledger of every boat that left before dawn, noting the weather, the crew and "
    "the hour it returned. In the winter months the entries grew short and nervous, and more than once he "
    "walked to the end of the pier with a lantern, listening for engines that did not come back until the fog lifted.",
    "Sourdough bread depends on a starter, a living mixture of flour and water that collects wild yeast and "
    "bacteria from the air. Bakers feed it every day, and its sour smell changes with the temperature of the "
    "kitchen. A loaf made with a lively starter rises slowly overnight and bakes into a crust that crackles as it cools.",
    "When the committee finally published its report, most of the recommendations were modest: longer opening "
    "hours for the clinic, a second bus on the evening route, and a small grant for repairing the sports hall. "
    "Critics said it avoided the hard questions about housing, but the mayor promised a separate review before the summer.",
)


@torch.inference_mode()
def perplexity(model, token_sequences: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each sequence, with the
    model's no-cache reference forward (``forward_full``), log-softmax in float64."""
    total_nll, count = 0.0, 0
    for ids in token_sequences:
        ids = torch.tensor(list(ids), dtype=torch.long, device=model.device)  # (L,)
        logits = model.forward_full(ids).double()  # (L, vocab)
        log_probs = torch.log_softmax(logits[:-1], dim=-1)  # (L-1, vocab): position t predicts token t+1
        total_nll -= float(log_probs.gather(1, ids[1:, None]).sum())
        count += len(ids) - 1
    return math.exp(total_nll / count)


def paragraph_ids(tokenizer, paragraphs: Sequence[str] = PARAGRAPHS) -> list[list[int]]:
    return [tokenizer.encode(paragraph) for paragraph in paragraphs]


@torch.inference_mode()
def paged_log_probs(
    model, sequence: Sequence[int], *, kv_cache_dtype_name: str = "auto", chunk_size: int | None = None,
    tokens_per_block: int = 16, kv_scales=None,
) -> torch.Tensor:
    """(L - 1, vocab) float64 log-probabilities of each next token of ``sequence`` through the
    paged forward (``LlamaForCausalLM.forward``: what the engines run), prefilled in chunks of
    ``chunk_size`` tokens (None: one chunk) over pools of ``kv_cache_dtype_name`` ("auto": the
    model's dtype; "fp8": float8_e4m3fn with ``kv_scales``, a ``KvScales``; None: 1.0). Every
    chunk after the first reads its prefix back from the pool, and an FP8 pool is read as stored
    everywhere, so the result measures the cache's precision, not the chunking."""
    from tensorrt_llm._torch.attention_backend.backend import plan_builder

    dtype = kv_cache_dtype(kv_cache_dtype_name, model.config.torch_dtype)
    device = model.device
    ids = torch.tensor(list(sequence), dtype=torch.long, device=device)  # (L,)
    length = len(ids)
    num_blocks = -(-length // tokens_per_block)
    shape = model.kv_cache_shape(num_blocks, tokens_per_block)
    k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_layers)]
    v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_layers)]
    table = list(range(num_blocks))
    builder = plan_builder(device, tokens_per_block=tokens_per_block, num_blocks=num_blocks,
                           num_kv_heads=model.num_local_kv_heads, dtype=model.config.torch_dtype,
                           kv_scales=kv_scales if dtype != model.config.torch_dtype else None)
    step = chunk_size or length
    rows = []
    for start in range(0, length, step):
        stop = min(length, start + step)
        plan = builder.build([stop - start], [start], [table])
        positions = torch.arange(start, stop, dtype=torch.long, device=device)
        hidden = model.forward_with_plan(ids[start:stop], positions, plan, k_cache, v_cache)  # (stop - start, hidden)
        predicted = min(stop, length - 1) - start  # rows that predict a token of the sequence
        if predicted > 0:
            rows.append(torch.log_softmax(model.compute_logits(hidden[:predicted]).double(), dim=-1))
    return torch.cat(rows)


def paged_perplexity(
    model, token_sequences: Sequence[Sequence[int]], *, kv_cache_dtype_name: str = "auto", chunk_size: int | None = None,
    tokens_per_block: int = 16, kv_scales=None,
) -> float:
    """:func:`perplexity` through :func:`paged_log_probs` (its arguments), over every sequence."""
    total_nll, count = 0.0, 0
    for sequence in token_sequences:
        log_probs = paged_log_probs(model, sequence, kv_cache_dtype_name=kv_cache_dtype_name, chunk_size=chunk_size,
                                    tokens_per_block=tokens_per_block, kv_scales=kv_scales)
        targets = torch.tensor(list(sequence[1:]), dtype=torch.long, device=log_probs.device)
        total_nll -= float(log_probs.gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(total_nll / count)


def main(argv: list[str] | None = None) -> dict:
    from tensorrt_llm.llmapi.llm_utils import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (the CPU: float32; a GPU: bfloat16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8")
    parser.add_argument("--kv-scales", default="unit,derived", help="the FP8 pool's scales: unit (1.0), derived")
    parser.add_argument("--text", default="suite", choices=("suite", "held-out"))
    parser.add_argument("--chunk-size", type=int, default=16, help="prefill chunk (the prefix read back from the pool)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype, device=torch.device(args.device))
    if loaded.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: perplexity needs text")
    texts = paragraph_ids(loaded.tokenizer, PARAGRAPHS if args.text == "suite" else HELD_OUT_PARAGRAPHS)
    report = {"config": vars(args), "tokens": sum(len(t) - 1 for t in texts),
              "no_cache": perplexity(loaded.model, texts), "paged": {}, "per_paragraph": {}}
    runs = []
    for name in args.kv_cache_dtypes.split(","):
        for scales in (args.kv_scales.split(",") if name == "fp8" else ["-"]):
            runs.append((name if name != "fp8" else f"fp8 {scales}", name, scales))
    for label, name, scales in runs:
        kv_scales = None
        if scales == "derived":
            from tensorrt_llm._torch.models.kv_calibration import calibrate_kv_scales, calibration_token_ids

            derived = calibrate_kv_scales(loaded.model, *calibration_token_ids(loaded.tokenizer,
                                                                               loaded.model.config.vocab_size))
            kv_scales = derived.scales
            report["derived_scales"] = derived.describe()
        per = [paged_perplexity(loaded.model, [t], kv_cache_dtype_name=name, chunk_size=args.chunk_size,
                                kv_scales=kv_scales) for t in texts]
        report["per_paragraph"][label] = per
        report["paged"][label] = paged_perplexity(loaded.model, texts, kv_cache_dtype_name=name,
                                                  chunk_size=args.chunk_size, kv_scales=kv_scales)
    reference = report["paged"].get("auto", report["no_cache"])
    base = report["per_paragraph"].get("auto")
    for label, value in report["paged"].items():
        line = f"kv_cache_dtype {label}: perplexity {value:.4f} ({100 * (value / reference - 1):+.3f}% against auto)"
        if base:
            line += "; per paragraph " + ", ".join(f"{v:.3f} ({100 * (v / b - 1):+.2f}%)"
                                                   for v, b in zip(report["per_paragraph"][label], base))
        print(line)
    if "derived_scales" in report:
        print(f"derived scales: {report['derived_scales']}")
    print(f"no cache (forward_full): {report['no_cache']:.4f}; {report['tokens']} predicted tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
