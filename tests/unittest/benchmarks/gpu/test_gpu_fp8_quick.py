"""``benchmarks.gpu.fp8 --quick``: the FP8 decode benchmark's script on the CPU, tiny shapes (the
H200 run uses the same code on the Nemo preset)."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu import fp8


@pytest.mark.usefixtures("one_torch_thread")
def test_the_fp8_decode_section_runs_both_pools_and_reports_their_bytes(tmp_path):
    assert fp8.main(["--out", str(tmp_path), "--quick", "--sections", "decode"]) == 0
    result = json.loads((tmp_path / "gpu_fp8_decode.json").read_text())
    for case in result["cases"].values():
        assert case["fp8"]["kv_bytes_per_token"] * 4 == case["auto"]["kv_bytes_per_token"]  # float32 -> fp8
        assert case["fp8"]["bytes"] < case["auto"]["bytes"]
        assert case["fp8"]["kernel"]["kv_bytes"] * 4 == case["auto"]["kernel"]["kv_bytes"]
