"""The sim engine's forward-time models and the calibration CLI that feeds them."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.gpu import calibrate
from benchmarks.replay.cost_model import (
    DEFAULT_TABLE,
    FittedCostModel,
    ForwardShape,
    GpuSpec,
    ModelShape,
    RooflineCostModel,
    default_cost_model,
    evaluate,
    table_row_shape,
)

REPO = Path(__file__).resolve().parents[4]
# CI clones the repository with ../shared beside it; a checkout may also carry shared/ inside.
SHARED_TABLE = next((p for p in (REPO.parent / "shared" / "calibration" / "h200_mistral_nemo_12b.json",
                                 REPO / "shared" / "calibration" / "h200_mistral_nemo_12b.json") if p.exists()), None)


def prefill(n, prefix=0):
    return ForwardShape(contexts=((n, prefix),))


def decode_batch(batch, ctx):
    return ForwardShape(decodes=((1, ctx),) * batch)


@pytest.fixture(scope="module")
def fitted():
    return FittedCostModel.from_table(DEFAULT_TABLE)


# -- shapes -----------------------------------------------------------------------------------


def test_model_shape_sizes_match_mistral_nemo():
    m = ModelShape()
    assert m.kv_bytes_per_token() == 2 * 40 * 8 * 128 * 2          # 160 KiB a token
    # ~12.2B parameters: 40 layers of 272.6M plus an untied 131072 x 5120 embedding and LM head.
    assert 12.0e9 < m.weight_bytes() / 2 < 12.5e9
    assert m.forward_weight_bytes() == m.weight_bytes() - 2 * m.lm_head_params()


def test_forward_shape_counts_positions_and_rejects_nonsense():
    s = ForwardShape(contexts=((100, 0), (28, 512)), decodes=((1, 7), (4, 9), (3, 100)))
    assert s.num_tokens == 100 + 28 + 1 + 4 + 3
    assert ForwardShape().num_tokens == 0
    with pytest.raises(ValueError):
        ForwardShape(contexts=((0, 5),))
    with pytest.raises(ValueError):
        ForwardShape(decodes=((1, -1),))


# -- roofline ---------------------------------------------------------------------------------


def test_roofline_is_monotone_in_tokens_and_context():
    r = RooflineCostModel()
    for n in (1, 64, 512, 4096):
        assert r.forward_time_s(prefill(n + 1)) > r.forward_time_s(prefill(n))
        assert r.forward_time_s(prefill(n, 8192)) > r.forward_time_s(prefill(n, 1024))
    for b in (1, 8, 64):
        assert r.forward_time_s(decode_batch(b + 1, 4096)) > r.forward_time_s(decode_batch(b, 4096))
        assert r.forward_time_s(decode_batch(b, 8192)) > r.forward_time_s(decode_batch(b, 4096))


def test_roofline_bounds():
    r = RooflineCostModel()
    assert r.bound(decode_batch(64, 8192)) == "memory"
    assert r.bound(decode_batch(256, 2048)) == "memory"
    assert r.bound(prefill(4096)) == "compute"
    # The shared H200 table measured 135 ms for a 4096-token prefill.
    assert 135e-3 / 2 < r.forward_time_s(prefill(4096)) < 135e-3 * 2


def test_roofline_overhead_is_added_once():
    slow = RooflineCostModel(gpu=GpuSpec(overhead_s=0.01))
    fast = RooflineCostModel(gpu=GpuSpec(overhead_s=0.0))
    s = decode_batch(8, 1024)
    assert slow.forward_time_s(s) - fast.forward_time_s(s) == pytest.approx(0.01)


# -- fitted model -----------------------------------------------------------------------------


def test_committed_table_has_the_shared_format():
    table = json.loads(DEFAULT_TABLE.read_text())
    for key in ("gpu", "torch", "model", "method", "rows"):
        assert key in table
    assert "H200" in table["gpu"]
    assert len(table["rows"]) >= 150
    for row in table["rows"]:
        assert set(row) == {"ctx_tokens", "prefix", "decode_batch", "decode_ctx", "ms"}
        assert row["ms"] > 0


def test_fit_reproduces_its_own_table(fitted):
    err = evaluate(fitted, DEFAULT_TABLE)
    assert err["rows"] >= 150
    assert err["median_rel_err"] < 0.10, err


@pytest.mark.skipif(SHARED_TABLE is None, reason="shared calibration table not beside the repository")
def test_fit_predicts_the_shared_table(fitted):
    err = evaluate(fitted, SHARED_TABLE)
    assert err["median_rel_err"] < 0.25, err


def test_fit_coefficients_are_non_negative(fitted):
    assert all(c >= 0 for c in fitted.coef)


def test_default_cost_model_is_the_fit(fitted):
    assert isinstance(default_cost_model(), FittedCostModel)


def test_fit_generalises_to_several_chunks_and_mixed_decodes(fitted):
    # Splitting one chunk's tokens over two requests, or one decode batch over two contexts,
    # lands near the single-chunk table row it resembles, never far off.
    one = fitted.forward_time_s(ForwardShape(contexts=((2048, 0),), decodes=((1, 4096),) * 64))
    two = fitted.forward_time_s(ForwardShape(contexts=((1024, 0), (1024, 0)), decodes=((1, 4096),) * 64))
    mixed = fitted.forward_time_s(ForwardShape(contexts=((2048, 0),),
                                               decodes=((1, 2048),) * 32 + ((1, 6144),) * 32))
    assert 0.5 * one < two <= one          # two shorter causal triangles do less attention
    assert mixed == pytest.approx(one, rel=0.02)   # same KV read in total


def test_fit_falls_back_far_outside_the_table(fitted):
    far = ForwardShape(decodes=((1, 1_000_000),))
    assert not fitted.in_range(far)
    assert fitted.forward_time_s(far) == pytest.approx(fitted.fallback_scale * fitted.fallback.forward_time_s(far))
    near = decode_batch(64, 4096)
    assert fitted.in_range(near)


forward_shapes = st.builds(
    ForwardShape,
    contexts=st.lists(st.tuples(st.integers(1, 40_000), st.integers(0, 200_000)), max_size=6).map(tuple),
    decodes=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 200_000)), max_size=600).map(tuple),
)


@given(forward_shapes)
def test_property_models_are_always_positive(fitted, shape):
    assert fitted.forward_time_s(shape) > 0
    assert RooflineCostModel().forward_time_s(shape) > 0


def test_table_row_shape_matches_the_row():
    s = table_row_shape({"ctx_tokens": 512, "prefix": 2048, "decode_batch": 3, "decode_ctx": 100, "ms": 1.0})
    assert s.contexts == ((512, 2048),) and s.decodes == ((1, 100),) * 3
    assert table_row_shape({"ctx_tokens": 0, "prefix": 0, "decode_batch": 2, "decode_ctx": 9, "ms": 1.0}).contexts == ()


# -- calibration CLI --------------------------------------------------------------------------


def test_calibrate_refuses_without_cuda(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "table.json"
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--out", str(out)])
    assert "CUDA" in str(exc.value.code)
    assert not out.exists()


def test_calibration_grid_covers_the_brief_without_duplicates():
    grid = calibrate.build_grid()
    keys = {(r.ctx_tokens, r.prefix, r.decode_batch, r.decode_ctx) for r in grid}
    assert len(keys) == len(grid)
    assert all(r.ctx_tokens or r.decode_batch for r in grid)
    assert {r.ctx_tokens for r in grid} == set(calibrate.CTX_TOKENS)
    assert {r.decode_ctx for r in grid if r.decode_batch} == set(calibrate.DECODE_CTXS)


def test_every_attention_path_computes_lower_right_causal_attention():
    """The candidates calibrate.py may time all compute the same attention (on CPU: those that run)."""
    import torch

    g = torch.Generator().manual_seed(0)
    cases = {"chunk_lower_right": (1, 8, 24), "prefill_causal": (1, 16, 16), "decode": (3, 1, 20)}
    for kind, (b, s, l) in cases.items():
        q = torch.randn(b, 4, s, 16, generator=g)
        k = torch.randn(b, 2, l, 16, generator=g)
        v = torch.randn(b, 2, l, 16, generator=g)
        ref = calibrate._reference_attention(q, k, v, causal=kind != "decode")
        ran = 0
        for impl in calibrate._candidates(kind):
            mask = calibrate.lower_right_mask(s, l, impl.mask, q.dtype, q.device) \
                if impl.mask in ("bool", "additive") else None
            try:
                out = calibrate.attend(impl, q, k, v, mask)
            except RuntimeError:            # that backend does not exist on this machine
                continue
            ran += 1
            assert torch.allclose(out, ref, atol=1e-4), (kind, impl)
        assert ran > 0, kind


def test_nnls_meets_its_optimality_conditions():
    import numpy as np

    from benchmarks.replay.cost_model import nnls

    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(40, 6))
        b = rng.normal(size=40)
        x = nnls(a, b)
        w = a.T @ (b - a @ x)               # minus the gradient of ||ax - b||^2 / 2
        assert (x >= 0).all()
        assert np.allclose(w[x > 0], 0, atol=1e-8)    # free coefficients sit at a stationary point
        assert (w[x == 0] <= 1e-8).all()              # clamped ones would only grow the residual


def test_refit_to_iterations_recovers_a_known_model_and_round_trips(tmp_path):
    """Iterations timed by a known fitted model: the refit predicts the held-out half closely,
    and the saved model loads back with the same predictions."""
    from benchmarks.replay.cost_model import FittedCostModel, iteration_shape, refit_to_iterations

    truth = default_cost_model()
    rows = []
    for i in range(80):
        contexts = [[256 * (1 + i % 8), 1024 * (i % 5)]] if i % 3 == 0 else []
        decodes = [512 + 97 * ((i + j) % 40) for j in range(1 + i % 24)]
        row = {"contexts": contexts, "decodes": decodes}
        row["device_ms"] = truth.forward_time_s(iteration_shape(row)) * 1e3
        rows.append(row)
    model, held_out = refit_to_iterations(rows)
    assert held_out["train_rows"] == 40 and held_out["test_rows"] == 40
    assert held_out["p90_rel_err"] < 0.1, held_out
    path = tmp_path / "refit.json"
    model.save(path)
    loaded = FittedCostModel.load(path)
    for row in rows[:10]:
        shape = iteration_shape(row)
        assert loaded.forward_time_s(shape) == model.forward_time_s(shape)
