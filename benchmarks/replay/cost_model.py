"""Forward-time models for the ``sim`` engine: how long one forward pass takes on a GPU.

The replay calls ``forward_time_s`` once per simulated iteration (about 10^5 times per replay), so
every model here is plain Python arithmetic over a few per-batch sums; numpy is only used to fit.

Two models share one interface (``CostModel``):

* ``RooflineCostModel`` - ``max(FLOPs / peak, bytes / bandwidth) + overhead`` from the model's
  shape alone. It needs no measurement and is the fallback far outside a measured table.
* ``FittedCostModel`` - a non-negative least-squares fit to a calibration table measured by
  ``python -m benchmarks.gpu.calibrate`` (``benchmarks/calibration/*.json``). Each table row is one
  context chunk plus a decode batch at one uniform context; the fit's features are sums over
  context chunks and over decode requests, so they apply unchanged to a forward with several
  chunks and decodes at varied contexts.

A fitted model can also be **refitted to an engine's own iterations** (:func:`refit_to_iterations`:
the forwards a GPU replay recorded, each with its shape and measured time): it fits on one share
of them and reports its error on the held-out rest, and the model saves to / loads from JSON
(:meth:`FittedCostModel.save`, :meth:`FittedCostModel.load`)::

    python -m benchmarks.replay.cost_model refit RUN.json [--key device_ms] [--train-on recheck] [--out MODEL.json]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "ModelShape",
    "GpuSpec",
    "ForwardShape",
    "CostModel",
    "RooflineCostModel",
    "FittedCostModel",
    "default_cost_model",
    "evaluate",
    "table_row_shape",
    "iteration_shape",
    "refit_to_iterations",
    "DEFAULT_TABLE",
]

DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "calibration" / "h200_mistral_nemo_12b_ours.json"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A dense GQA decoder with a SwiGLU MLP and an untied LM head; defaults: Mistral-Nemo-12B."""

    num_layers: int = 40
    hidden_size: int = 5120
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 131072
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies, summed over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def layer_params(self) -> int:
        """Matrix parameters of one decoder layer: fused QKV, output projection, gate+up, down."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp

    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    def weight_bytes(self) -> int:
        """Bytes of every weight: all layers, the embedding table and the (untied) LM head.

        Norm weights are left out (a few hundred KB). A forward reads the layers and the LM head in
        full but only gathers its tokens' rows of the embedding; see ``forward_weight_bytes``.
        """
        return self.dtype_bytes * (self.num_layers * self.layer_params() + 2 * self.lm_head_params())

    def forward_weight_bytes(self) -> int:
        """Weight bytes one forward streams from memory: every layer plus the LM head."""
        return self.dtype_bytes * (self.num_layers * self.layer_params() + self.lm_head_params())


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Ceilings of one GPU. Defaults: the H200 as measured here (dense bf16 8192^3 matmul at
    800 TFLOP/s, device copy at 4.2 TB/s).

    ``overhead_s`` is what a small step costs beyond both ceilings: at a handful of tokens the
    GEMMs stream weights below copy bandwidth, and a forward has some 600 kernel boundaries plus
    sampling. 4 ms is the gap in this repository's H200 table (CUDA-graph timings): a decode step
    of 8 requests at 1k context measures 10.1 ms against a 5.9 ms bandwidth floor, one of 64 at
    4k 19.0 ms against 15.9 ms. Host-side scheduling is not in it; the replay accounts for that.
    """

    name: str = "H200"
    peak_flops: float = 800e12
    mem_bandwidth: float = 4.2e12
    overhead_s: float = 4e-3

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bandwidth <= 0 or self.overhead_s < 0:
            raise ValueError(f"GpuSpec needs positive ceilings and a non-negative overhead, got {self}")


@dataclass(frozen=True, slots=True)
class ForwardShape:
    """One forward pass. contexts: (new_tokens, cached_prefix_tokens) per context chunk;
    decodes: (new_tokens, cached_context_tokens) per generation request (new_tokens is 1, or beam width, or 1+drafts).
    """

    contexts: tuple[tuple[int, int], ...] = ()
    decodes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for n, cached in self.contexts:
            if n < 1 or cached < 0:
                raise ValueError(f"context chunk (new={n}, prefix={cached}) needs new >= 1 and prefix >= 0")
        for n, cached in self.decodes:
            if n < 1 or cached < 0:
                raise ValueError(f"decode (new={n}, context={cached}) needs new >= 1 and context >= 0")

    @property
    def num_tokens(self) -> int:
        """Positions in the forward: what ``_prepare_tp_inputs`` appends and ``max_num_tokens`` bounds."""
        total = 0
        for n, _ in self.contexts:
            total += n
        for n, _ in self.decodes:
            total += n
        return total


class CostModel(Protocol):
    def forward_time_s(self, shape: ForwardShape) -> float:
        """Seconds one forward of ``shape`` takes on the GPU; always > 0."""
        ...


def table_row_shape(row: dict) -> ForwardShape:
    """The ForwardShape one calibration-table row measured: one chunk plus a uniform decode batch."""
    contexts = ((row["ctx_tokens"], row["prefix"]),) if row["ctx_tokens"] > 0 else ()
    decodes = ((1, row["decode_ctx"]),) * row["decode_batch"]
    return ForwardShape(contexts=contexts, decodes=decodes)


def _load_table(path) -> dict:
    with open(path) as f:
        table = json.load(f)
    if not table.get("rows"):
        raise ValueError(f"{path}: calibration table has no rows")
    return table


def _model_shape_from_table(table: dict) -> ModelShape:
    """The ModelShape a table's header describes; the default shape where a field is missing."""
    m = table.get("model", {})
    default = ModelShape()
    return ModelShape(
        num_layers=m.get("layers", default.num_layers),
        hidden_size=m.get("hidden", default.hidden_size),
        num_heads=m.get("q_heads", default.num_heads),
        num_kv_heads=m.get("kv_heads", default.num_kv_heads),
        head_dim=m.get("head_dim", default.head_dim),
        intermediate_size=m.get("mlp", default.intermediate_size),
        vocab_size=m.get("vocab", default.vocab_size),
        dtype_bytes={"bfloat16": 2, "float16": 2, "float32": 4}.get(m.get("dtype", "bfloat16"), 2),
    )


class RooflineCostModel:
    """``max(FLOPs / peak, bytes / bandwidth) + overhead``.

    FLOPs: the GEMMs, ``2 * layer params * tokens`` over all layers, plus the LM head on the
    sampled rows only (one per context chunk, ``new_tokens`` per decode: each beam or draft
    position gets logits); attention ``4 * head_dim * heads * layers`` per (query, key) pair,
    QK^T and PV over the cached positions plus the causal triangle of the new ones.
    Bytes: the weights once (layers and LM head), the KV of every request's cached context read,
    the KV of every new token written, and the activations each layer reads and writes.
    """

    __slots__ = ("model", "gpu", "_gemm_flops_per_token", "_head_flops_per_row", "_attn_flops_per_pair",
                 "_weight_bytes", "_kv_bytes", "_act_bytes_per_token")

    def __init__(self, model: ModelShape = ModelShape(), gpu: GpuSpec = GpuSpec()):
        self.model = model
        self.gpu = gpu
        self._gemm_flops_per_token = 2.0 * model.num_layers * model.layer_params()
        self._head_flops_per_row = 2.0 * model.lm_head_params()
        self._attn_flops_per_pair = 4.0 * model.head_dim * model.num_heads * model.num_layers
        self._weight_bytes = float(model.forward_weight_bytes())
        self._kv_bytes = float(model.kv_bytes_per_token())
        # Per token and layer, unfused eager-style traffic: the residual stream read and written by
        # two norms and two adds, QKV and attention outputs, and the MLP's gate+up, activation, down.
        q_dim = model.num_heads * model.head_dim
        kv_dim = model.num_kv_heads * model.head_dim
        elems = 8 * model.hidden_size + 2 * (q_dim + 2 * kv_dim) + 2 * q_dim + 5 * model.intermediate_size
        self._act_bytes_per_token = float(elems * model.dtype_bytes * model.num_layers)

    @staticmethod
    def _sums(shape: ForwardShape) -> tuple[int, int, float, int]:
        """(tokens, sampled rows, attention (query, key) pairs, cached tokens read) in one pass."""
        tokens = 0
        rows = 0
        pairs = 0.0
        cached = 0
        for n, prefix in shape.contexts:
            tokens += n
            rows += 1
            pairs += n * (prefix + (n + 1) * 0.5)
            cached += prefix
        for n, ctx in shape.decodes:
            tokens += n
            rows += n
            pairs += n * (ctx + (n + 1) * 0.5)
            cached += ctx
        return tokens, rows, pairs, cached

    def _flops(self, tokens: int, rows: int, pairs: float) -> float:
        return (tokens * self._gemm_flops_per_token + rows * self._head_flops_per_row
                + pairs * self._attn_flops_per_pair)

    def _bytes(self, tokens: int, cached: int) -> float:
        # New tokens' KV is written once and read back by the attention that follows.
        return self._weight_bytes + (cached + 2 * tokens) * self._kv_bytes + tokens * self._act_bytes_per_token

    def flops(self, shape: ForwardShape) -> float:
        tokens, rows, pairs, _ = self._sums(shape)
        return self._flops(tokens, rows, pairs)

    def bytes(self, shape: ForwardShape) -> float:
        tokens, _, _, cached = self._sums(shape)
        return self._bytes(tokens, cached)

    def bound(self, shape: ForwardShape) -> str:
        """'compute' or 'memory': which ceiling sets this forward's roofline time."""
        tokens, rows, pairs, cached = self._sums(shape)
        compute_s = self._flops(tokens, rows, pairs) / self.gpu.peak_flops
        return "compute" if compute_s >= self._bytes(tokens, cached) / self.gpu.mem_bandwidth else "memory"

    def forward_time_s(self, shape: ForwardShape) -> float:
        tokens, rows, pairs, cached = self._sums(shape)
        gpu = self.gpu
        compute_s = self._flops(tokens, rows, pairs) / gpu.peak_flops
        memory_s = self._bytes(tokens, cached) / gpu.mem_bandwidth
        return (compute_s if compute_s > memory_s else memory_s) + gpu.overhead_s


# ---------------------------------------------------------------------------------------------
# Fitted model
#
# time = c0                                     fixed per-iteration cost (launches, sampling)
#      + c1 * max(T, G)                         GEMMs: weight-read bound below G tokens, then FLOPs
#      + c2 * T                                 per-token work outside the GEMMs (norms, RoPE, adds)
#      + c3 * sum_ctx max(n, A) * (p + n / 2)   context attention (QK^T, PV) over prefix + causal
#                                               triangle; a chunk shorter than A tokens leaves SMs
#                                               idle and costs as much as an A-token chunk
#      + c4 * sum_ctx p                         reading a chunk's cached prefix KV
#      + c5 * sum_dec (ctx + n)                 decode attention: KV bytes read
#      + c6 * rows                              per sampled row: LM head, sampling, per-request kernels
#
# with T = tokens in the forward and rows = one per context chunk plus new_tokens per decode. The
# coefficients are non-negative (NNLS), so every term only adds time; the two knees G and A are
# picked by a small grid search. Rows are weighted by 1 / measured time so the fit minimises
# relative error, which is what a replay's latencies care about.
# ---------------------------------------------------------------------------------------------

_GEMM_KNEES = (0, 64, 128, 192, 256, 384, 512)
_ATTN_KNEES = (0, 128, 256, 384, 512, 768, 1024, 1536, 2048)
_NUM_FEATURES = 7
# How far past the table's largest value a shape may reach before the fit is no longer trusted.
_EXTRAPOLATION_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class _ShapeSums:
    """The per-forward sums the fit's features and the trust region are made of (one pass)."""

    contexts: tuple[tuple[int, int], ...]
    tokens: int
    rows: int
    prefix_sum: int
    dec_kv: int
    num_decodes: int
    max_chunk_kv: int  # the largest prefix + new tokens of one chunk
    max_decode_ctx: int

    @classmethod
    def of(cls, shape: ForwardShape) -> "_ShapeSums":
        tokens = rows = prefix_sum = max_chunk_kv = 0
        for n, p in shape.contexts:
            tokens += n
            rows += 1
            prefix_sum += p
            if n + p > max_chunk_kv:
                max_chunk_kv = n + p
        dec_kv = max_ctx = 0
        for n, c in shape.decodes:
            tokens += n
            rows += n
            dec_kv += c + n
            if c > max_ctx:
                max_ctx = c
        return cls(shape.contexts, tokens, rows, prefix_sum, dec_kv, len(shape.decodes), max_chunk_kv, max_ctx)


def _features(sums: _ShapeSums, gemm_knee: float, attn_knee: float) -> tuple[float, ...]:
    """The fit's features; the fit and every prediction compute them here, and only here."""
    attn = 0.0
    for n, p in sums.contexts:
        attn += (n if n > attn_knee else attn_knee) * (p + 0.5 * n)
    tokens = sums.tokens
    return (1.0, float(tokens if tokens > gemm_knee else gemm_knee), float(tokens), attn, float(sums.prefix_sum),
            float(sums.dec_kv), float(sums.rows))


def nnls(a, b, max_iter: int | None = None):
    """Lawson-Hanson non-negative least squares: argmin ||a x - b|| subject to x >= 0."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    max_iter = max_iter or 3 * n
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back towards x until the first passive coefficient reaches zero, drop it.
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass(frozen=True, slots=True)
class _Range:
    """The largest values a calibration table covers; the fit is trusted up to a factor past them."""

    tokens: int
    chunk_kv: int      # prefix + new tokens of one chunk
    decodes: int
    decode_ctx: int


class FittedCostModel:
    """A non-negative least-squares fit to a calibration table (features: see the comment above).

    Trust region: a shape is far outside the table, and priced by the fallback roofline (scaled
    by the table's median measured/roofline ratio, so the two agree in level), when its total
    tokens, any chunk's prefix + new tokens, its number of decodes, or any decode's context
    exceeds twice the largest such value in the table. Inside, the fit. Never returns <= 0.
    """

    __slots__ = ("coef", "gemm_knee", "attn_knee", "fallback", "fallback_scale", "range", "_floor_s")

    def __init__(self, coef, gemm_knee: float, attn_knee: float, fallback: RooflineCostModel,
                 fallback_scale: float, table_range: _Range, floor_s: float):
        if len(coef) != _NUM_FEATURES or any(c < 0 for c in coef):
            raise ValueError(f"need {_NUM_FEATURES} non-negative coefficients, got {coef}")
        self.coef = tuple(float(c) for c in coef)
        self.gemm_knee = float(gemm_knee)
        self.attn_knee = float(attn_knee)
        self.fallback = fallback
        self.fallback_scale = fallback_scale
        self.range = table_range
        self._floor_s = floor_s

    @classmethod
    def from_table(cls, path, fallback: RooflineCostModel | None = None) -> "FittedCostModel":
        table = _load_table(path)
        rows = table["rows"]
        if fallback is None:
            fallback = RooflineCostModel(_model_shape_from_table(table), GpuSpec())
        times = [r["ms"] * 1e-3 for r in rows]
        if any(t <= 0 for t in times):
            raise ValueError(f"{path}: every row needs ms > 0")
        return cls.from_shapes([table_row_shape(r) for r in rows], times, fallback)

    @classmethod
    def from_shapes(cls, shapes: list[ForwardShape], times_s: list[float],
                    fallback: RooflineCostModel) -> "FittedCostModel":
        """Fit to measured forwards of any shapes (a calibration table's rows, or an engine's
        own iterations); ``times_s`` all > 0."""
        import numpy as np

        y = np.array(times_s, dtype=float)
        sums = [_ShapeSums.of(shape) for shape in shapes]
        best = None
        for g in _GEMM_KNEES:
            for a_knee in _ATTN_KNEES:
                x = np.array([_features(row, g, a_knee) for row in sums])
                # Relative-error weighting; columns scaled to unit max so NNLS is well conditioned.
                xw = x / y[:, None]
                scale = np.abs(xw).max(axis=0)
                scale[scale == 0] = 1.0
                coef = nnls(xw / scale, np.ones(len(y))) / scale
                loss = float((((x @ coef) - y) / y) @ (((x @ coef) - y) / y))
                if best is None or loss < best[0]:
                    best = (loss, coef, g, a_knee)
        _, coef, g, a_knee = best

        ratios = sorted(float(t) / fallback.forward_time_s(s) for t, s in zip(y, shapes))
        table_range = _Range(
            tokens=max(s.num_tokens for s in shapes),
            chunk_kv=max((max((n + p for n, p in s.contexts), default=0) for s in shapes), default=0),
            decodes=max(len(s.decodes) for s in shapes),
            decode_ctx=max((max((c for _, c in s.decodes), default=0) for s in shapes), default=0),
        )
        # No forward is faster than half the fastest one measured: a guard, the fit stays above it.
        floor_s = 0.5 * float(y.min())
        return cls(coef, g, a_knee, fallback, ratios[len(ratios) // 2], table_range, floor_s)

    def in_range(self, shape: ForwardShape) -> bool:
        return self._in_range(_ShapeSums.of(shape))

    def _in_range(self, sums: _ShapeSums) -> bool:
        r, f = self.range, _EXTRAPOLATION_FACTOR
        return (
            sums.tokens <= f * r.tokens
            and sums.num_decodes <= f * r.decodes
            and sums.max_chunk_kv <= f * r.chunk_kv
            and sums.max_decode_ctx <= f * r.decode_ctx
        )

    def forward_time_s(self, shape: ForwardShape) -> float:
        sums = _ShapeSums.of(shape)
        if self._in_range(sums):
            t = sum(c * x for c, x in zip(self.coef, _features(sums, self.gemm_knee, self.attn_knee)))
        else:
            t = self.fallback_scale * self.fallback.forward_time_s(shape)
        return t if t > self._floor_s else self._floor_s

    def save(self, path) -> None:
        """Write the model (coefficients, knees, trust region, fallback) as JSON."""
        fb = self.fallback
        document = {
            "kind": "FittedCostModel", "coef": list(self.coef), "gemm_knee": self.gemm_knee,
            "attn_knee": self.attn_knee, "fallback_scale": self.fallback_scale, "floor_s": self._floor_s,
            "range": dict(zip(_Range.__dataclass_fields__, (self.range.tokens, self.range.chunk_kv,
                                                             self.range.decodes, self.range.decode_ctx))),
            "model_shape": {k: getattr(fb.model, k) for k in ModelShape.__dataclass_fields__},
            "gpu": {k: getattr(fb.gpu, k) for k in GpuSpec.__dataclass_fields__},
        }
        Path(path).write_text(json.dumps(document, indent=2))

    @classmethod
    def load(cls, path) -> "FittedCostModel":
        d = json.loads(Path(path).read_text())
        if d.get("kind") != "FittedCostModel":
            raise ValueError(f"{path}: not a saved FittedCostModel")
        fallback = RooflineCostModel(ModelShape(**d["model_shape"]), GpuSpec(**d["gpu"]))
        return cls(d["coef"], d["gemm_knee"], d["attn_knee"], fallback, d["fallback_scale"], _Range(**d["range"]),
                   d["floor_s"])

    def describe(self) -> dict:
        names = ("fixed_s", "gemm_s_per_token", "token_s", "ctx_attn_s_per_pair", "prefix_s_per_token",
                 "decode_kv_s_per_token", "row_s")
        return {"coef": dict(zip(names, self.coef)), "gemm_knee": self.gemm_knee, "attn_knee": self.attn_knee,
                "fallback_scale": self.fallback_scale, "range": {
                    "tokens": self.range.tokens, "chunk_kv": self.range.chunk_kv,
                    "decodes": self.range.decodes, "decode_ctx": self.range.decode_ctx}}


def default_cost_model() -> CostModel:
    """The fit to this repository's H200 table if it is present, else the H200 roofline."""
    if DEFAULT_TABLE.exists():
        return FittedCostModel.from_table(DEFAULT_TABLE)
    return RooflineCostModel()


def evaluate(model: CostModel, table_path) -> dict:
    """Relative error of ``model`` against a measured table: |predicted - measured| / measured."""
    rows = _load_table(table_path)["rows"]
    errs = sorted(abs(model.forward_time_s(table_row_shape(r)) * 1e3 - r["ms"]) / r["ms"] for r in rows)
    n = len(errs)

    def quantile(q: float) -> float:
        # Linear interpolation between order statistics (numpy's default).
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return errs[lo] + (errs[hi] - errs[lo]) * (pos - lo)

    return {"median_rel_err": quantile(0.5), "p90_rel_err": quantile(0.9), "max_rel_err": errs[-1], "rows": n}


# ---- refit to an engine's own iterations ---------------------------------------------------


def iteration_shape(row: dict) -> ForwardShape:
    """The shape of one recorded iteration: ``contexts`` as [[new, prefix], ...] and ``decodes``
    as the context of each one-token decode (the rows ``gpu_sim_check`` writes)."""
    return ForwardShape(contexts=tuple((int(n), int(p)) for n, p in row["contexts"]),
                        decodes=tuple((1, int(c)) for c in row["decodes"]))


def relative_errors(predicted: list[float], measured: list[float]) -> dict:
    """Median and p90 of ``|predicted - measured| / measured`` (and the median signed error)."""
    rel = sorted(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0)
    signed = sorted((p - m) / m for p, m in zip(predicted, measured) if m > 0)
    if not rel:
        return {"n": 0}

    def q(values: list[float], f: float) -> float:
        pos = f * (len(values) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    return {"median_rel_err": q(rel, 0.5), "p90_rel_err": q(rel, 0.9), "max_rel_err": rel[-1],
            "median_signed_err": q(signed, 0.5), "n": len(rel)}


def refit_to_iterations(train: list[dict], test: list[dict] | None = None, *, key: str = "device_ms",
                        fallback: RooflineCostModel | None = None) -> tuple[FittedCostModel, dict]:
    """Fit the :class:`FittedCostModel` form to measured iterations and check it on others.

    ``train``/``test``: rows with ``contexts``, ``decodes`` and ``key`` (milliseconds). Without
    ``test`` the rows are split alternately: even rows train, odd rows are held out (iterations
    of one replay are ordered in time, so both halves see every phase of it). Returns the model
    and its errors on the held-out rows (``relative_errors``), with the row counts.
    """
    rows = [r for r in train if r.get(key)]
    if test is None:
        rows, test = rows[::2], rows[1::2]
    test = [r for r in test if r.get(key)]
    if len(rows) < 10:
        raise ValueError(f"need at least 10 measured iterations to refit, got {len(rows)}")
    model = FittedCostModel.from_shapes([iteration_shape(r) for r in rows], [r[key] * 1e-3 for r in rows],
                                        fallback or RooflineCostModel())
    errors = relative_errors([model.forward_time_s(iteration_shape(r)) * 1e3 for r in test], [r[key] for r in test])
    return model, {**errors, "train_rows": len(rows), "test_rows": len(test)}


def _iteration_rows(document: dict, policy: str | None) -> dict[str, list[dict]]:
    """Per-iteration rows by replay in a GPU run's JSON (``gpu_bench``/``gpu_phase_b`` output)."""
    found: dict[str, list[dict]] = {}

    def walk(node, name):
        if isinstance(node, dict):
            if isinstance(node.get("per_iteration"), list):
                found[node.get("policy") or name] = node["per_iteration"]
            for k, v in node.items():
                walk(v, k)

    walk(document, "run")
    if policy is not None:
        found = {k: v for k, v in found.items() if k == policy} or found
    return found


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.replay.cost_model", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("refit", help="refit to a GPU run's iterations; report the held-out error")
    r.add_argument("run", help="a GPU run's JSON with per_iteration rows")
    r.add_argument("--key", default="device_ms", help="the measured time of a row (ms)")
    r.add_argument("--train-on", default=None, help="the replay whose iterations train (default: the first)")
    r.add_argument("--out", default=None, help="write the refitted model here (FittedCostModel.load reads it)")
    args = p.parse_args(argv)
    replays = _iteration_rows(json.loads(Path(args.run).read_text()), None)
    if not replays:
        raise SystemExit(f"{args.run}: no per_iteration rows")
    name = args.train_on or next(iter(replays))
    model, held_out = refit_to_iterations(replays[name], key=args.key)
    print(f"refit on half of {name}'s {len(replays[name])} iterations; the other half: median "
          f"{held_out['median_rel_err']:.1%}, p90 {held_out['p90_rel_err']:.1%} (n={held_out['n']})")
    for other, rows in replays.items():
        if other != name:
            e = relative_errors([model.forward_time_s(iteration_shape(x)) * 1e3 for x in rows if x.get(args.key)],
                                [x[args.key] for x in rows if x.get(args.key)])
            if e.get("n"):
                print(f"  on {other}: median {e['median_rel_err']:.1%}, p90 {e['p90_rel_err']:.1%} (n={e['n']})")
    if args.out:
        model.save(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
