"""FP8 KV cache variants, per paragraph: which scheme keeps perplexity within 1% on every paragraph.

An experiment harness, not the serving path: each variant wraps the model's ``Attention.attend``
(after RoPE, before the paged backend) with a transform of q, k, v and its inverse on the output,
and simulates the FP8 cache by storing ``dequantize(quantize(x))`` in a pool of the model's dtype
(exact: every e4m3 value times a power-of-two scale is exact in bf16 and float32, so this is what
an FP8 pool returns; ``--check-real`` compares the plain variant against a real FP8 pool). Scales
are derived per variant from the transformed values (``kv_calibration``'s rule: max |x| x 2 / 448
rounded up to a power of two, over the built-in calibration text), or 1.0 (``unit``).

Variants (``--variants``, comma-separated; each one feature or several joined by ``+``):

    none        FP8 K and V as stored today
    rot-k       q and k through an orthonormal Hadamard matrix H (D x D): q H . k H = q . k
    rot-kv      the same, and v H (the output o H, turned back by H^T)
    rrot-k(v)   the same with H times a seeded random +-1 diagonal (QuaRot's randomized Hadamard)
    center-k(v) a per-layer, per-head mean (calibration) subtracted from k (and v, added back to the
                output): exact in real arithmetic, softmax ignores a shift common to all keys
    sink        the first position of each sequence kept exact (the attention sink)
    bf16        K and V rounded to bf16 instead of FP8: how much any rounding moves a paragraph (on
                a bf16 model no rounding at all, so ``rrot-kv+bf16`` is the rotation's own arithmetic)
    int8-tok    K and V as int8 with a scale per token and head (not FP8: a reference)
    fp8-tok     K and V as FP8 with a scale per token and head (absmax / 448, vLLM's
                ``fp8_per_token_head``): the same 3 mantissa bits, no value below e4m3's normal range
    int8-layer  K and V as int8 with a scale per layer (calibration max x 2 / 127; not FP8: a reference)
    k-only      only K goes through the variant's rounding; V is stored exact (v-only: the converse)

``--exact-layers 0,1,29`` keeps those layers as the model runs them with no variant (no transform,
K and V stored exact: a layer served from a pool of the model's dtype), the others as the variant
says. Calibration still sees every layer, so a layer's scale is the same whichever layers are exact.

Besides each paragraph's perplexity change, it prints the RMS change of a token's log-probability
and the mean KL divergence from the unquantized cache over all paragraphs: a paragraph of ~65
tokens averages ~65 such changes, so its perplexity moves by about RMS / sqrt(65) either way.

Per layer (``--sweep-layers``): for each variant, once calibrated, every layer quantized; each
layer alone quantized (every other exact), with its share of the sum of the single-layer KLs;
K alone and V alone over every layer; then, greedily, the ``--keep-exact`` counts (1,2,4,8) of the
layers with the largest single-layer KL kept exact: how many layers of the model's dtype it takes
to bring every paragraph within 1%. About 30 + 6 runs a variant for a 30-layer model.

    python -m benchmarks.model.kv_fp8_variants [--dtype float32] [--kv-scales derived]
        [--variants none,rot-k,rot-kv] [--exact-layers 0,29] [--chunk-size 16] [--json OUT.json]
    python -m benchmarks.model.kv_fp8_variants --sweep-layers [--variants none,rrot-kv]
        [--keep-exact 1,2,4,8] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
from typing import Callable

import torch

from benchmarks.model.perplexity import (
    HELD_OUT_PARAGRAPHS, PARAGRAPHS, paged_log_probs, paged_perplexity, paragraph_ids,
)
from tensorrt_llm._torch.attention_backend.kv_quant import dequantize, quantize
from tensorrt_llm._torch.models.kv_calibration import HEADROOM, calibration_token_ids, power_of_two_scale
from tensorrt_llm._torch.modules.attention import Attention

FEATURES = ("none", "rot-k", "rot-kv", "rrot-k", "rrot-kv", "center-k", "center-kv", "sink", "bf16", "int8-tok",
            "fp8-tok", "int8-layer", "k-only", "v-only")


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix over sqrt(n) (orthonormal, symmetric); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class Variant:
    """One variant (features joined by ``+``) with its per-layer scales and means once calibrated."""

    def __init__(self, name: str, head_dim: int, dtype: torch.dtype, seed: int = 0,
                 exact_layers: frozenset[int] = frozenset()) -> None:
        features = set(name.split("+"))
        unknown = features - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown variant feature(s) {sorted(unknown)}: one of {', '.join(FEATURES)}")
        if {"k-only", "v-only"} <= features:
            raise ValueError(f"{name}: k-only and v-only together quantize nothing (use --exact-layers for that)")
        if any(layer < 0 for layer in exact_layers):
            raise ValueError(f"exact layers must be layer indices >= 0, got {sorted(exact_layers)}")
        self.name = name
        self.quantize_k = "v-only" not in features
        self.quantize_v = "k-only" not in features
        self.exact_layers = frozenset(exact_layers)
        self.rot_k = bool(features & {"rot-k", "rot-kv", "rrot-k", "rrot-kv"})
        self.rot_v = bool(features & {"rot-kv", "rrot-kv"})
        self.center_k = bool(features & {"center-k", "center-kv"})
        self.center_v = "center-kv" in features
        self.sink = "sink" in features
        self.bf16 = "bf16" in features
        self.int8_token = "int8-tok" in features
        self.fp8_token = "fp8-tok" in features
        self.int8_layer = "int8-layer" in features
        matrix = hadamard(head_dim)
        if features & {"rrot-k", "rrot-kv"}:
            signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
            matrix = signs.double()[:, None] * matrix  # diag(s) H: still orthonormal
        self.matrix = matrix.to(dtype)
        self.phase = "mean"  # "mean" -> "max" -> "run"
        self.sums: dict[int, list] = {}
        self.means: dict[int, tuple] = {}
        self.maxima: dict[int, list[float]] = {}
        self.scales: list[tuple[float, float]] = []
        self.first_position = False  # whether row 0 of this call's k is position 0 (set by the caller)

    def restricted(self, exact_layers: frozenset[int] | None = None, part: str | None = None) -> Variant:
        """This variant, calibration shared, with ``exact_layers`` exact and only ``part`` ("k" or "v";
        None: both) quantized; for a sweep that calibrates once."""
        if part not in (None, "k", "v"):
            raise ValueError(f"part is 'k', 'v' or None, got {part!r}")
        other = copy.copy(self)
        if exact_layers is not None:
            other.exact_layers = frozenset(exact_layers)
        if part is not None:
            other.quantize_k, other.quantize_v = part == "k", part == "v"
            other.name = f"{self.name}+{part}-only"
        return other

    def is_exact(self, layer: int) -> bool:
        """Whether ``layer`` runs as the model does (calibration sees every layer)."""
        return self.phase == "run" and layer in self.exact_layers

    def transform(self, layer: int, q, k, v):
        h = self.matrix
        if self.rot_k:
            q, k = q @ h, k @ h  # (T, H, D) @ (D, D)
        if self.rot_v:
            v = v @ h
        if self.phase == "mean":
            s = self.sums.setdefault(layer, [0, 0, 0])
            s[0], s[1], s[2] = s[0] + k.double().sum(0), s[1] + v.double().sum(0), s[2] + k.shape[0]
        elif layer in self.means:
            mk, mv = self.means[layer]
            k, v = k - mk, v - mv
        return q, k, v

    def restore(self, layer: int, y):
        if layer in self.means and self.center_v:
            mv = self.means[layer][1]  # (Hkv, D)
            y = y + mv.repeat_interleave(y.shape[1] // mv.shape[0], 0)
        return y @ self.matrix.T if self.rot_v else y

    def end_phase(self, dtype) -> None:
        if self.phase == "mean":
            for layer, (sk, sv, n) in self.sums.items():
                if self.center_k or self.center_v:
                    mk = (sk / n).to(dtype) if self.center_k else torch.zeros_like(sk, dtype=dtype)
                    mv = (sv / n).to(dtype) if self.center_v else torch.zeros_like(sv, dtype=dtype)
                    self.means[layer] = (mk, mv)
            self.maxima = {}
            self.phase = "max"
        elif self.phase == "max":
            self.scales = [tuple(power_of_two_scale(m) for m in self.maxima[i]) for i in range(len(self.maxima))]
            self.phase = "run"

    def store(self, layer: int, k, v):
        """k, v as the cache would return them."""
        if self.phase != "run":  # calibration: record the largest magnitudes
            seen = self.maxima.setdefault(layer, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], float(k.abs().max())), max(seen[1], float(v.abs().max()))
            return k, v
        if self.int8_token:
            kq, vq = int8_per_token(k), int8_per_token(v)
        elif self.fp8_token:
            kq, vq = fp8_per_token(k), fp8_per_token(v)
        elif self.int8_layer:  # the calibration's largest magnitude x 2 (FP8's headroom) is 127
            kq, vq = (int8_with_scale(x, m * HEADROOM / 127) for x, m in zip((k, v), self.maxima[layer]))
        elif self.bf16:
            kq, vq = k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)
        else:
            ks, vs = self.scales[layer]
            kq, vq = dequantize(quantize(k, ks), ks, k.dtype), dequantize(quantize(v, vs), vs, v.dtype)
        if self.sink and self.first_position:
            kq[0], vq[0] = k[0], v[0]
        return (kq if self.quantize_k else k), (vq if self.quantize_v else v)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) through int8 with a scale per token and head (absmax / 127): not an FP8 cache,
    a reference for what 8 bits with a finer scale would keep (it needs a scale stored per row)."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127  # (T, H, 1)
    return (x / scale).round().clamp(-127, 127) * scale


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) through e4m3 with a scale per token and head (absmax / 448): each row's largest
    value at e4m3's largest, so none of a row falls below its normal range (a layer's scale leaves
    the rows of small norm there); the relative rounding of the rest is e4m3's as before."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30).float() / 448  # (T, H, 1)
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def int8_with_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through int8 with one scale (a layer's: TensorRT-LLM's INT8 KV cache), saturated."""
    return (x / scale).round().clamp(-127, 127) * scale


@contextlib.contextmanager
def wrapped_attention(model, variant: Variant):
    """Route every ``Attention.attend`` of ``model`` through ``variant``."""
    index = {id(layer.self_attn): i for i, layer in enumerate(model.model.layers)}
    original: Callable = Attention.attend

    def attend(self, q, k, v, paged):
        layer = index[id(self)]
        if variant.is_exact(layer):
            return original(self, q, k, v, paged)
        q, k, v = variant.transform(layer, q, k, v)
        k, v = variant.store(layer, k, v)
        return variant.restore(layer, original(self, q, k, v, paged))

    Attention.attend = attend
    try:
        yield
    finally:
        Attention.attend = original


@torch.inference_mode()
def calibrate(model, variant: Variant, tokenizer, unit: bool) -> None:
    sequences, _ = calibration_token_ids(tokenizer, model.config.vocab_size)
    for _ in range(2):  # the means, then the largest magnitudes of the centred values
        with wrapped_attention(model, variant):
            for ids in sequences:
                model.forward_full(torch.tensor(ids, dtype=torch.long))
        variant.end_phase(model.config.torch_dtype)
    if unit:
        variant.scales = [(1.0, 1.0)] * len(model.model.layers)


def variant_log_probs(model, variant: Variant, ids: list[int], chunk_size: int) -> torch.Tensor:
    """``perplexity.paged_log_probs`` over a pool of the model's dtype, with every stored K/V as the
    variant stores it."""
    seen: set[int] = set()
    original_store = variant.store

    def store(layer, k, v):
        # A layer's first call (the first chunk's) holds position 0 in row 0 (one sequence a run);
        # counted per layer, since exact layers do not call store.
        variant.first_position = layer not in seen
        seen.add(layer)
        return original_store(layer, k, v)

    variant.store = store
    try:
        with wrapped_attention(model, variant):
            return paged_log_probs(model, ids, chunk_size=chunk_size)
    finally:
        variant.store = original_store


def compare(reference: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict:
    """Perplexity change (%), RMS change of the next token's log-probability, mean KL(reference || other)."""
    target = torch.tensor(ids[1:])[:, None]
    ref, oth = reference.gather(1, target)[:, 0], other.gather(1, target)[:, 0]  # (L-1,)
    kl = (reference.exp() * (reference - other)).sum(-1)  # (L-1,)
    return {"delta_pct": 100 * (math.exp(float(ref.mean() - oth.mean())) - 1),
            "rms_dlogp": float((oth - ref).pow(2).mean().sqrt()), "kl": float(kl.mean())}


def measure(model, variant: Variant, base: list[torch.Tensor], texts: list[list[int]], chunk_size: int) -> dict:
    """``variant`` (calibrated) against the unquantized log-probs ``base`` of each of ``texts``: each
    paragraph's ``compare``, and over all of them the worst |perplexity change|, the RMS change of a
    token's log-prob and the mean KL (both weighted by tokens)."""
    results = [compare(b, variant_log_probs(model, variant, t, chunk_size), t) for b, t in zip(base, texts)]
    weights = [len(t) - 1 for t in texts]
    rms = math.sqrt(sum(r["rms_dlogp"] ** 2 * w for r, w in zip(results, weights)) / sum(weights))
    kl = sum(r["kl"] * w for r, w in zip(results, weights)) / sum(weights)
    return {"per_paragraph": results, "rms_dlogp": rms, "kl": kl,
            "max_abs_delta_pct": max(abs(r["delta_pct"]) for r in results)}


def row(label: str, result: dict, extra: str = "") -> str:
    """One printed line: each paragraph's change, then the worst, the RMS and the KL."""
    return (f"{label:<22} " + " ".join(f"{r['delta_pct']:>+9.2f}%" for r in result["per_paragraph"])
            + f"   {result['max_abs_delta_pct']:6.2f}%   {result['rms_dlogp']:.4f}   {result['kl']:.5f}{extra}")


def sweep_layers(model, variant: Variant, base, texts, chunk_size: int, keep_exact: list[int]) -> dict:
    """Where ``variant``'s error comes from (docstring, ``--sweep-layers``), printing a row per run.

    Returns ``{"all", "k-only", "v-only": measure, "single_layer": [measure + "layer", "kl_share"],
    "ranking": layers by single-layer KL, largest first, "additivity": sum of single-layer KLs over
    the all-layer KL, "keep_exact": [measure + "exact_layers"]}``."""
    num_layers = len(model.model.layers)
    out = {"all": measure(model, variant.restricted(frozenset()), base, texts, chunk_size)}
    print(row(f"{variant.name}: all", out["all"]), flush=True)
    for part in ("k", "v"):
        out[f"{part}-only"] = measure(model, variant.restricted(frozenset(), part), base, texts, chunk_size)
        print(row(f"  {part.upper()} only, all layers", out[f"{part}-only"]), flush=True)
    singles = []
    for layer in range(num_layers):
        others = frozenset(range(num_layers)) - {layer}
        singles.append({"layer": layer, **measure(model, variant.restricted(others), base, texts, chunk_size)})
        print(row(f"  layer {layer} alone", singles[-1]), flush=True)
    total = sum(s["kl"] for s in singles)
    for s in singles:
        s["kl_share"] = s["kl"] / total if total > 0 else 0.0
    ranking = sorted(range(num_layers), key=lambda i: -singles[i]["kl"])
    out.update(single_layer=singles, ranking=ranking,
               additivity=total / out["all"]["kl"] if out["all"]["kl"] > 0 else float("nan"))
    print(f"  layers by single-layer KL: {ranking}; shares "
          + " ".join(f"{i}:{100 * singles[i]['kl_share']:.1f}%" for i in ranking[:8])
          + f"; sum of single-layer KLs / all-layer KL = {out['additivity']:.2f}")
    out["keep_exact"] = []
    for n in keep_exact:
        exact = frozenset(ranking[:n])
        result = {"exact_layers": sorted(exact), **measure(model, variant.restricted(exact), base, texts, chunk_size)}
        out["keep_exact"].append(result)
        print(row(f"  {n} exact ({n}/{num_layers})", result, f"   exact {sorted(exact)}"), flush=True)
    return out


def plot_sweep(variants: dict, path: str) -> None:
    """A bar per layer: its single-layer KL for each swept variant (``sweep_layers``'s results), with
    each variant's all-layer KL as a line to compare the sum against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, (name, sweep) in enumerate(variants.items()):
        layers = [s["layer"] for s in sweep["single_layer"]]
        bars = ax.bar([x + (i - (len(variants) - 1) / 2) * width for x in layers],
                      [s["kl"] for s in sweep["single_layer"]], width, label=f"{name}: layer alone quantized")
        ax.axhline(sweep["all"]["kl"] / len(layers), color=bars.patches[0].get_facecolor(), linestyle="--",
                   linewidth=1, label=f"{name}: all layers' KL / {len(layers)}")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean KL from the unquantized cache")
    ax.set_title("FP8 KV cache error per layer (each layer alone in FP8, the others exact)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layer_list(text: str) -> list[int]:
    """``"0,1,29"`` as ints; '' as none."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> dict:
    from tensorrt_llm.llmapi.llm_utils import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-scales", default="derived", choices=("unit", "derived"))
    parser.add_argument("--variants", default="none,rot-k,rot-kv")
    parser.add_argument("--exact-layers", type=layer_list, default=[],
                        help="layers kept exact (no transform, K and V unquantized), e.g. 0,1,29")
    parser.add_argument("--sweep-layers", action="store_true",
                        help="per layer: each layer alone quantized, K / V alone, the worst layers kept exact")
    parser.add_argument("--keep-exact", type=layer_list, default=[1, 2, 4, 8],
                        help="with --sweep-layers: how many of the largest single-layer KLs to keep exact")
    parser.add_argument("--plot", default=None, help="with --sweep-layers: a bar chart of the per-layer KL (PNG)")
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="the random signs of rrot-*")
    parser.add_argument("--check-real", action="store_true", help="also run the plain variant on a real FP8 pool")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.sweep_layers and args.exact_layers:
        parser.error("--sweep-layers chooses the exact layers itself; leave out --exact-layers")
    if args.plot and not args.sweep_layers:
        parser.error("--plot draws the per-layer sweep: add --sweep-layers")
    for name in args.variants.split(","):
        # A ValueError naming an unknown feature or a bad layer, before the model loads.
        Variant(name, 2, torch.float32, exact_layers=frozenset(args.exact_layers))
    loaded = load_model(args.model, dtype=args.dtype, device=torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    num_layers = len(model.model.layers)
    if any(i >= num_layers for i in args.exact_layers):
        parser.error(f"--exact-layers {args.exact_layers}: {args.model} has layers 0-{num_layers - 1}")
    if args.sweep_layers and any(not 0 <= n <= num_layers for n in args.keep_exact):
        parser.error(f"--keep-exact {args.keep_exact}: counts from 0 to {num_layers} ({args.model}'s layers)")
    names = [f"suite {i + 1}" for i in range(len(PARAGRAPHS))] + [f"held-out {i + 1}" for i in
                                                                   range(len(HELD_OUT_PARAGRAPHS))]
    texts = paragraph_ids(tokenizer, PARAGRAPHS) + paragraph_ids(tokenizer, HELD_OUT_PARAGRAPHS)
    base = [paged_log_probs(model, t, chunk_size=args.chunk_size) for t in texts]
    report = {"config": vars(args), "paragraphs": names, "variants": {}}
    exact_note = f", layers {args.exact_layers} exact" if args.exact_layers else ""
    print(f"{args.dtype}, scales {args.kv_scales}, chunks of {args.chunk_size}{exact_note}; per paragraph: "
          "perplexity change; then the worst |change|, RMS change of a token's log-prob and mean KL over all paragraphs")
    print(f"{'variant':<22} " + " ".join(f"{n:>10}" for n in names) + "    max |d|   rms dlogp   KL")
    for name in args.variants.split(","):
        variant = Variant(name, model.config.head_dim, model.config.torch_dtype, args.seed,
                          exact_layers=frozenset(args.exact_layers))
        calibrate(model, variant, tokenizer, args.kv_scales == "unit")
        if args.sweep_layers:
            report["variants"][name] = sweep_layers(model, variant, base, texts, args.chunk_size, args.keep_exact)
            continue
        report["variants"][name] = measure(model, variant, base, texts, args.chunk_size)
        print(row(name, report["variants"][name]), flush=True)
    if args.check_real:
        from tensorrt_llm._torch.attention_backend.kv_quant import KvScales

        variant = Variant("none", model.config.head_dim, model.config.torch_dtype)
        calibrate(model, variant, tokenizer, args.kv_scales == "unit")
        scales = KvScales(tuple(s[0] for s in variant.scales), tuple(s[1] for s in variant.scales))
        real = [paged_perplexity(model, [t], kv_cache_dtype_name="fp8", chunk_size=args.chunk_size, kv_scales=scales)
                for t in texts]
        print(f"{'real fp8 (perplexity)':<22} " + " ".join(f"{v:>10.3f}" for v in real))
    if args.plot:  # only with --sweep-layers (checked above)
        plot_sweep(report["variants"], args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
