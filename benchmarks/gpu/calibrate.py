"""Measure forward times of a decoder on a CUDA GPU and write a calibration table for the cost model.

    python -m benchmarks.gpu.calibrate --out FILE.json [--layers N] [--shape mistral-nemo-12b]
                                   [--repeats 10 --warmup 3] [--eager] [--no-check]

Method: one decoder layer with random bf16 weights (fused QKV, RoPE, torch SDPA attention, output
projection, SwiGLU MLP, two RMSNorms) and, separately, the head (embedding gather, final norm,
LM head and greedy pick on the sampled rows). Each is captured in a CUDA graph and its replays
are timed with CUDA events (``repeats`` replays back to back after ``warmup``, mean); a row's time
is ``layers * layer + head``. Graph replay measures the GPU's work without the Python launch
cost of an eager forward, which on the lent machines is both large (3x the GPU time of a small
decode step) and unsteady (+70% between two runs); a serving engine hides it with CUDA graphs and
an overlapped scheduler. ``--eager`` times plain calls instead. The layer's weights (~0.5 GB) do
not fit in L2, so each replay streams them from HBM as the next layer of a real model would.

Attention: before the grid, every SDPA backend (cuDNN, flash, memory-efficient) is tried for each
of the three attention calls (causal prefill, a chunk over a cached prefix with lower-right
causal alignment, a decode batch), with native GQA, repeated KV heads or, for decodes, the query
heads of a group folded into the query length; each candidate is checked against a float32
reference and timed, and the fastest correct one that a CUDA graph can capture is used. The
JSON's ``attention`` field records every candidate's result.

Each row is one forward: a context chunk of ``ctx_tokens`` new tokens attending to ``prefix``
cached tokens plus itself, and ``decode_batch`` generation requests each attending to
``decode_ctx`` cached tokens plus itself. GEMMs run over all tokens together; the chunk and the
decodes get one attention call each. KV for the largest shape is allocated once.

The output has the format of the shared table (``../shared/calibration/*.json``): header fields
``gpu``, ``torch``, ``model``, ``method`` and ``rows`` of ``ctx_tokens, prefix, decode_batch,
decode_ctx, ms``; extra header fields record the grid, the measured ceilings, the attention
choice and a check of the per-layer scaling against whole eager and graph-replayed forwards.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.replay.cost_model import ModelShape

SHAPES = {"mistral-nemo-12b": ModelShape()}

CTX_TOKENS = (0, 128, 512, 1024, 2048, 4096, 8192)
PREFIXES = (0, 2048, 8192, 16384)
DECODE_BATCHES = (0, 8, 32, 64, 128, 256)
DECODE_CTXS = (1024, 4096, 16384)


@dataclass(frozen=True, slots=True)
class GridRow:
    ctx_tokens: int
    prefix: int
    decode_batch: int
    decode_ctx: int


def build_grid() -> list[GridRow]:
    """Every combination that means something: a prefix only with a chunk, a decode context only
    with a decode batch, never an empty forward. 15 decode-only rows + 6 chunks x 4 prefixes x 16."""
    rows = []
    for ctx, prefix, batch, dctx in itertools.product(CTX_TOKENS, PREFIXES, DECODE_BATCHES, DECODE_CTXS):
        if ctx == 0 and prefix != 0:
            continue
        if batch == 0 and dctx != DECODE_CTXS[0]:
            continue
        if ctx == 0 and batch == 0:
            continue
        rows.append(GridRow(ctx, prefix, batch, dctx if batch else 0))
    return rows


# --------------------------------------------------------------------------------------------
# Attention. torch is imported inside functions so that importing this module (for build_grid,
# or to see the refusal) stays cheap.
# --------------------------------------------------------------------------------------------

ATTENTION_KINDS = ("prefill_causal", "chunk_lower_right", "decode")


@dataclass(frozen=True, slots=True)
class AttnImpl:
    """One way to run an attention call through SDPA.

    backend: "cudnn" | "flash" | "efficient" | "default" (torch's own choice).
    gqa: "native" (enable_gqa), "repeat" (KV heads repeated to the query heads), or "fold"
         (decode only: the query heads sharing a KV head become that head's query positions).
    mask: "causal" (is_causal, or torch's lower-right CausalBias for a chunk over a prefix),
          "bool" or "additive" (an explicit lower-right mask tensor), or "none" (decode).
    """

    backend: str
    gqa: str
    mask: str

    def label(self) -> str:
        return f"{self.backend}/{self.gqa}/{self.mask}"


def _candidates(kind: str) -> list[AttnImpl]:
    backends = ("cudnn", "flash", "efficient", "default")
    if kind == "decode":
        return [AttnImpl(b, g, "none") for b in backends for g in ("native", "fold", "repeat")]
    masks = ("causal",) if kind == "prefill_causal" else ("causal", "bool", "additive")
    return [AttnImpl(b, g, m) for b in backends for g in ("native", "repeat") for m in masks]


def _backend_ctx(name: str):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]])


def lower_right_mask(s: int, l: int, kind: str, dtype, device):
    """(s, l) mask: query i (the i-th new token) sees keys 0 .. l - s + i. bool: True = attend."""
    import torch

    keep = torch.arange(l, device=device)[None, :] <= (torch.arange(s, device=device)[:, None] + (l - s))
    if kind == "bool":
        return keep
    return torch.zeros(s, l, device=device, dtype=dtype).masked_fill_(~keep, float("-inf"))


def attend(impl: AttnImpl, q, k, v, mask=None):
    """q: (B, Hq, S, hd); k, v: (B, Hkv, L, hd) -> (B, Hq, S, hd). Causal chunks are aligned to
    the last key (lower right); ``mask`` is the explicit mask when impl.mask is bool/additive."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    b, hq, s, hd = q.shape
    hkv, l = k.shape[1], k.shape[2]
    kw = {}
    if hq != hkv:
        if impl.gqa == "native":
            kw["enable_gqa"] = True
        elif impl.gqa == "repeat":
            k = k.repeat_interleave(hq // hkv, dim=1)              # (B, Hq, L, hd)
            v = v.repeat_interleave(hq // hkv, dim=1)
        elif impl.gqa == "fold":
            if s != 1 or impl.mask != "none":
                raise ValueError("fold is for single-token decodes only")
            qf = q.reshape(b, hkv, hq // hkv, hd)                    # (B, Hkv, group, hd)
            with _backend_ctx(impl.backend):
                out = F.scaled_dot_product_attention(qf, k, v)     # (B, Hkv, group, hd)
            return out.reshape(b, hq, 1, hd)
    with _backend_ctx(impl.backend):
        if impl.mask == "none":
            return F.scaled_dot_product_attention(q, k, v, **kw)
        if impl.mask == "causal":
            if s == l:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, l), **kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def _reference_attention(q, k, v, causal: bool):
    """float32 attention with KV heads repeated and a lower-right causal mask: the check for every impl."""
    import torch

    hq, hkv = q.shape[1], k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    scores = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5         # (B, Hq, S, L)
    if causal:
        s, l = q.shape[2], k.shape[2]
        keep = torch.arange(l, device=q.device)[None, :] <= (torch.arange(s, device=q.device)[:, None] + (l - s))
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ vf


# (batch, query len, key len) of each attention kind's correctness case and timed case.
_PROBE_SIZES = {"prefill_causal": ((1, 256, 256), (1, 4096, 4096)),
                "chunk_lower_right": ((1, 64, 320), (1, 1024, 1024 + 8192)),
                "decode": ((4, 1, 300), (64, 1, 4097))}


def choose_attention(shape: ModelShape, device, dtype, capture: bool, sizes=None) -> tuple[dict, dict]:
    """For each attention kind: check every candidate on a small case, time the correct ones on a
    representative one, and keep the fastest that (when ``capture``) a CUDA graph can capture."""
    import torch

    sizes = sizes or _PROBE_SIZES

    hq, kvh, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    g = torch.Generator(device=device).manual_seed(3)

    def rnd(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    chosen, report = {}, {}
    for kind in ATTENTION_KINDS:
        causal = kind != "decode"
        results = []
        for impl in _candidates(kind):
            entry = {"impl": impl.label()}
            try:
                (b, s, l), (tb, ts, tl) = sizes[kind]
                q, k, v = rnd(b, hq, s, hd), rnd(b, kvh, l, hd), rnd(b, kvh, l, hd)
                mask = lower_right_mask(s, l, impl.mask, dtype, device) if impl.mask in ("bool", "additive") else None
                out = attend(impl, q, k, v, mask).float()
                ref = _reference_attention(q, k, v, causal)
                err = float((out - ref).norm() / ref.norm())
                entry["rel_err"] = round(err, 5)
                if not err < 2e-2:
                    entry["error"] = "wrong result"
                    results.append(entry)
                    continue
                q, k, v = rnd(tb, hq, ts, hd), rnd(tb, kvh, tl, hd), rnd(tb, kvh, tl, hd)
                mask = lower_right_mask(ts, tl, impl.mask, dtype, device) if impl.mask in ("bool", "additive") else None
                entry["ms"] = round(_time_ms(lambda: attend(impl, q, k, v, mask), 2, 5, device, graph=False), 4)
                if capture:
                    _time_ms(lambda: attend(impl, q, k, v, mask), 1, 2, device, graph=True)
                entry["graph_ok"] = capture
            except Exception as e:  # noqa: BLE001 - a backend that refuses this case is just not a candidate
                entry["error"] = f"{type(e).__name__}: {e}"[:160]
            results.append(entry)
        ok = [(r["ms"], impl) for r, impl in zip(results, _candidates(kind)) if "ms" in r and "error" not in r]
        if not ok:
            raise RuntimeError(f"no SDPA path computes {kind} attention correctly here: {results}")
        ok.sort(key=lambda t: t[0])
        chosen[kind] = ok[0][1]
        report[kind] = {"chosen": ok[0][1].label(), "timed_case": list(sizes[kind][1]), "candidates": results}
    return chosen, report


# --------------------------------------------------------------------------------------------
# The measured decoder
# --------------------------------------------------------------------------------------------


class _Decoder:
    """One layer's weights, the LM head, RoPE tables and the pre-allocated KV pools."""

    def __init__(self, shape: ModelShape, max_chunk_kv: int, max_decodes: int, max_decode_ctx: int, device):
        import torch

        dt = {2: torch.bfloat16, 4: torch.float32}[shape.dtype_bytes]
        self.shape = shape
        self.dtype = dt
        self.device = device
        h, hd = shape.hidden_size, shape.head_dim
        q_dim, kv_dim = shape.num_heads * hd, shape.num_kv_heads * hd
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size):
            return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dt)

        self.w_qkv = w(q_dim + 2 * kv_dim, h)                     # (q+k+v, hidden)
        self.w_o = w(h, q_dim)                                    # (hidden, q)
        self.w_gate_up = w(2 * shape.intermediate_size, h)        # (2*mlp, hidden)
        self.w_down = w(h, shape.intermediate_size)               # (hidden, mlp)
        self.norm1 = torch.ones(h, device=device, dtype=dt)
        self.norm2 = torch.ones(h, device=device, dtype=dt)
        self.norm_f = torch.ones(h, device=device, dtype=dt)
        self.embed = w(shape.vocab_size, h)                       # (vocab, hidden)
        self.lm_head = w(shape.vocab_size, h)                     # (vocab, hidden)

        max_pos = max(max_chunk_kv, max_decode_ctx + 1) + 1
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos = ang.cos().to(dt)                               # (max_pos, hd/2)
        self.sin = ang.sin().to(dt)

        # Flat pools; each shape takes a contiguous view of the front.
        kvh = shape.num_kv_heads
        self.ctx_k = torch.empty(kvh * max_chunk_kv * hd, device=device, dtype=dt).normal_(generator=g)
        self.ctx_v = torch.empty_like(self.ctx_k).normal_(generator=g)
        dec_elems = max_decodes * kvh * (max_decode_ctx + 1) * hd
        self.dec_k = torch.empty(dec_elems, device=device, dtype=dt).normal_(generator=g) if dec_elems else None
        self.dec_v = torch.empty_like(self.dec_k).normal_(generator=g) if dec_elems else None


def _rms_norm(x, weight):
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)


def _rope(x, cos, sin):
    """x: (T, heads, hd); cos, sin: (T, 1, hd/2). Rotate-half RoPE."""
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Forward:
    """One layer and the head for one grid row, every input prepared outside the timed calls."""

    def __init__(self, dec: _Decoder, row: GridRow, attn: dict[str, AttnImpl]):
        import torch

        s = dec.shape
        self.dec, self.row = dec, row
        n, p, b, c = row.ctx_tokens, row.prefix, row.decode_batch, row.decode_ctx
        self.ctx_impl = attn["chunk_lower_right" if p else "prefill_causal"]
        self.dec_impl = attn["decode"]
        self.T = n + b
        g = torch.Generator(device=dec.device).manual_seed(1)
        self.x = torch.randn(self.T, s.hidden_size, generator=g, device=dec.device, dtype=torch.float32).to(dec.dtype)
        pos = torch.cat([torch.arange(p, p + n, device=dec.device), torch.full((b,), c, device=dec.device)])
        self.cos = dec.cos[pos].unsqueeze(1)                      # (T, 1, hd/2)
        self.sin = dec.sin[pos].unsqueeze(1)
        kvh, hd = s.num_kv_heads, s.head_dim
        self.mask = None
        if n:
            L = p + n
            self.kc = dec.ctx_k[: kvh * L * hd].view(1, kvh, L, hd)
            self.vc = dec.ctx_v[: kvh * L * hd].view(1, kvh, L, hd)
            if self.ctx_impl.mask in ("bool", "additive"):
                self.mask = lower_right_mask(n, L, self.ctx_impl.mask, dec.dtype, dec.device)
        if b:
            self.kd = dec.dec_k[: b * kvh * (c + 1) * hd].view(b, kvh, c + 1, hd)
            self.vd = dec.dec_v[: b * kvh * (c + 1) * hd].view(b, kvh, c + 1, hd)
        self.ids = torch.randint(0, s.vocab_size, (self.T,), generator=g, device=dec.device)
        # Sampled rows: the chunk's last token (one per chunk) and every decode token.
        sampled = ([n - 1] if n else []) + list(range(n, n + b))
        self.sampled = torch.tensor(sampled, device=dec.device)

    def layer(self):
        import torch
        import torch.nn.functional as F

        d, s = self.dec, self.dec.shape
        n, p, b, c = self.row.ctx_tokens, self.row.prefix, self.row.decode_batch, self.row.decode_ctx
        T, hq, kvh, hd = self.T, s.num_heads, s.num_kv_heads, s.head_dim
        x = self.x
        h = _rms_norm(x, d.norm1)
        qkv = h @ d.w_qkv.t()                                      # (T, (hq + 2 kvh) hd)
        q = qkv[:, : hq * hd].view(T, hq, hd)                      # (T, hq, hd)
        k = qkv[:, hq * hd: (hq + kvh) * hd].view(T, kvh, hd)      # (T, kvh, hd)
        v = qkv[:, (hq + kvh) * hd:].view(T, kvh, hd)              # (T, kvh, hd)
        q = _rope(q, self.cos, self.sin)
        k = _rope(k, self.cos, self.sin)
        out = torch.empty(T, hq, hd, device=x.device, dtype=x.dtype)
        if n:
            self.kc[0, :, p:p + n] = k[:n].transpose(0, 1)         # (kvh, n, hd) into the cache
            self.vc[0, :, p:p + n] = v[:n].transpose(0, 1)
            qc = q[:n].transpose(0, 1).unsqueeze(0)                 # (1, hq, n, hd)
            oc = attend(self.ctx_impl, qc, self.kc, self.vc, self.mask)  # (1, hq, n, hd)
            out[:n] = oc[0].transpose(0, 1)
        if b:
            self.kd[:, :, c] = k[n:]                                # (b, kvh, hd) at position c
            self.vd[:, :, c] = v[n:]
            qd = q[n:].unsqueeze(2)                                 # (b, hq, 1, hd)
            od = attend(self.dec_impl, qd, self.kd, self.vd)        # (b, hq, 1, hd)
            out[n:] = od.squeeze(2)
        x = x + out.view(T, hq * hd) @ d.w_o.t()                   # (T, hidden)
        h = _rms_norm(x, d.norm2)
        gu = h @ d.w_gate_up.t()                                   # (T, 2 mlp)
        m = s.intermediate_size
        a = F.silu(gu[:, :m]) * gu[:, m:]                          # (T, mlp)
        return x + a @ d.w_down.t()                                # (T, hidden)

    def head(self):
        d = self.dec
        e = d.embed[self.ids]                                      # (T, hidden), the embedding gather
        h = _rms_norm(e[self.sampled], d.norm_f)                   # (rows, hidden)
        logits = h @ d.lm_head.t()                                 # (rows, vocab)
        return logits.argmax(-1)


def _time_ms(fn, warmup: int, repeats: int, device, graph: bool) -> float:
    """Mean time of one call of fn. On a GPU: CUDA events around back-to-back calls, or around
    back-to-back replays of fn captured in a CUDA graph. Elsewhere: a wall clock."""
    import torch

    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    run = fn
    if graph:
        # Warm up on a side stream (plans, workspaces) before capture, as torch.cuda.graphs asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(warmup):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return sum(s.elapsed_time(e) for s, e in zip(starts, ends)) / repeats


def _ceilings(device) -> dict:
    """The roofline's two ceilings, measured like the shared table's: 8192^3 bf16 matmul, device copy."""
    import torch

    g = torch.Generator(device=device).manual_seed(2)
    a = torch.randn(8192, 8192, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn(8192, 8192, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b, 3, 10, device, graph=False)
    del a, b
    src = torch.empty(2 * 1024**3, device=device, dtype=torch.uint8).random_(generator=g)
    dst = torch.empty_like(src)
    cp_ms = _time_ms(lambda: dst.copy_(src), 3, 10, device, graph=False)
    del src, dst
    return {"bf16_matmul_8192_tflops": round(2 * 8192**3 / (mm_ms * 1e-3) / 1e12, 1),
            "device_copy_tb_s_read_plus_write": round(2 * 2 * 1024**3 / (cp_ms * 1e-3) / 1e12, 2)}


def measure(shape: ModelShape, grid: list[GridRow], attn: dict[str, AttnImpl], *, layers: int, warmup: int,
            repeats: int, device, graph: bool, progress=None, checkpoint=None) -> tuple[list[dict], dict]:
    """Time every grid row; returns (rows in the table format, facts for the header)."""
    import torch

    dec = _Decoder(shape,
                   max_chunk_kv=max(r.ctx_tokens + r.prefix for r in grid),
                   max_decodes=max(r.decode_batch for r in grid),
                   max_decode_ctx=max(r.decode_ctx for r in grid),
                   device=device)
    rows = []
    failed = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, r in enumerate(grid):
            fwd = None
            try:
                fwd = _Forward(dec, r, attn)
                layer_ms = _time_ms(fwd.layer, warmup, repeats, device, graph)
                head_ms = _time_ms(fwd.head, warmup, repeats, device, graph)
            except Exception as e:  # noqa: BLE001 - one failed shape (say, out of memory) costs one row only
                failed.append({"row": [r.ctx_tokens, r.prefix, r.decode_batch, r.decode_ctx],
                               "error": f"{type(e).__name__}: {e}"[:200]})
                if progress:
                    progress(f"[{i + 1}/{len(grid)}] {r}: FAILED {failed[-1]['error']}")
                continue
            finally:
                del fwd
            ms = layers * layer_ms + head_ms
            rows.append({"ctx_tokens": r.ctx_tokens, "prefix": r.prefix, "decode_batch": r.decode_batch,
                         "decode_ctx": r.decode_ctx, "ms": round(ms, 3)})
            if progress:
                progress(f"[{i + 1}/{len(grid)} {time.perf_counter() - t0:6.1f}s] ctx={r.ctx_tokens} "
                         f"prefix={r.prefix} batch={r.decode_batch} dctx={r.decode_ctx}: {ms:.3f} ms "
                         f"(layer {layer_ms:.4f}, head {head_ms:.3f})")
            if checkpoint and (i + 1) % 50 == 0:
                checkpoint(rows)
    del dec
    return rows, {"failed_rows": failed, "grid_seconds": round(time.perf_counter() - t0, 1)}


def _stack_check(shape: ModelShape, attn: dict[str, AttnImpl], layers: int, device, warmup: int,
                 repeats: int) -> list[dict]:
    """A few rows timed three ways: the table's per-layer graph scaling; ``layers`` layer calls plus
    the head captured as one graph; the same run eagerly (what Python launch overhead adds)."""
    import torch

    picks = [GridRow(2048, 0, 0, 0), GridRow(512, 8192, 32, 4096), GridRow(0, 0, 8, 1024),
             GridRow(0, 0, 64, 4096), GridRow(128, 2048, 128, 1024)]
    dec = _Decoder(shape, max_chunk_kv=8192 + 2048, max_decodes=128, max_decode_ctx=4096, device=device)
    out = []
    with torch.inference_mode():
        for r in picks:
            fwd = _Forward(dec, r, attn)

            def whole():
                for _ in range(layers):
                    fwd.layer()
                return fwd.head()

            few = max(2, repeats // 3)
            entry = {"ctx_tokens": r.ctx_tokens, "prefix": r.prefix, "decode_batch": r.decode_batch,
                     "decode_ctx": r.decode_ctx}
            entry["scaled_ms"] = round(layers * _time_ms(fwd.layer, warmup, repeats, device, True)
                                       + _time_ms(fwd.head, warmup, repeats, device, True), 3)
            entry["whole_graph_ms"] = round(_time_ms(whole, 1, few, device, True), 3)
            entry["whole_eager_ms"] = round(_time_ms(whole, 1, few, device, False), 3)
            out.append(entry)
            del fwd
    del dec
    return out


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="where to write the JSON table")
    ap.add_argument("--shape", default="mistral-nemo-12b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers a forward counts (default: the shape's)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA-graph replays")
    ap.add_argument("--no-check", action="store_true", help="skip the whole-forward check of the per-layer scaling")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or (args.layers is not None and args.layers < 1):
        ap.error("--repeats and --layers must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"error: benchmarks.gpu.calibrate times forwards on a CUDA GPU and none is visible "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing was written")
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    layers = args.layers or shape.num_layers
    graph = not args.eager
    grid = build_grid()

    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    header = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "model": {"layers": layers, "hidden": shape.hidden_size, "q_heads": shape.num_heads,
                  "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "mlp": shape.intermediate_size,
                  "vocab": shape.vocab_size, "dtype": {2: "bfloat16", 4: "float32"}[shape.dtype_bytes],
                  "shape_of": {"mistral-nemo-12b": "Mistral-Nemo-12B"}.get(args.shape, args.shape)},
        "date": datetime.date.today().isoformat(),
        "grid": {"ctx_tokens": CTX_TOKENS, "prefix": PREFIXES, "decode_batch": DECODE_BATCHES,
                 "decode_ctx": DECODE_CTXS, "rows": len(grid)},
    }
    log(f"{header['gpu']}, torch {header['torch']}: {len(grid)} shapes, {layers} layers, "
        f"{'CUDA-graph replays' if graph else 'eager calls'}")
    header["ceilings"] = _ceilings(device)
    log(f"ceilings: {header['ceilings']}")
    with torch.inference_mode():
        attn, header["attention"] = choose_attention(shape, device, torch.bfloat16, capture=graph)
    for kind in ATTENTION_KINDS:
        log(f"attention {kind}: {attn[kind].label()}  " + ", ".join(
            f"{c['impl']}={c.get('ms', c.get('error', '?'))}" for c in header["attention"][kind]["candidates"]))
    timing = (f"CUDA-graph replays of one layer and of the head, mean of {args.repeats} back-to-back replays "
              f"after {args.warmup}" if graph else
              f"eager calls, mean of {args.repeats} back-to-back calls after {args.warmup} warm-ups")
    header["method"] = (
        f"one forward per row: {layers} x one layer + head, each timed with CUDA events as {timing}; layer = "
        f"RMSNorm, fused QKV GEMM, RoPE, KV written into a pre-allocated cache, torch SDPA (one call for the "
        f"chunk, lower-right causal over its prefix, one for the decode batch; kernels chosen per call as "
        f"the fastest correct of cuDNN/flash/efficient: " + ", ".join(f"{k} {attn[k].label()}" for k in ATTENTION_KINDS)
        + "), output GEMM, RMSNorm, SwiGLU MLP; head = embedding gather, final norm, lm_head and argmax on the "
        "sampled rows (one per chunk, one per decode); random bf16 weights")

    def checkpoint(rows):
        _write_json(args.out, {**header, "partial": True, "rows": rows})

    rows, facts = measure(shape, grid, attn, layers=layers, warmup=args.warmup, repeats=args.repeats,
                          device=device, graph=graph, progress=log, checkpoint=checkpoint)
    header.update(facts)
    _write_json(args.out, {**header, "rows": rows})
    log(f"wrote {len(rows)} rows to {args.out}")
    if not args.no_check:
        try:
            torch.cuda.empty_cache()
            header["stack_check"] = _stack_check(shape, attn, layers, device, args.warmup, args.repeats)
            for c in header["stack_check"]:
                log(f"check {c}")
        except Exception as e:  # noqa: BLE001 - the table is written; the check is a bonus
            header["stack_check"] = f"failed: {type(e).__name__}: {e}"[:300]
            log(header["stack_check"])
    header["total_seconds"] = round(time.perf_counter() - t0, 1)
    _write_json(args.out, {**header, "rows": rows})
    log(f"done in {header['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
