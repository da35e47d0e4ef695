"""``benchmarks.gpu.phase_b --quick``: the GPU measurement's own CPU check runs its replay section to
the end on tiny-random (with and without overlap, the host tier's offload-ahead reserve on), so a
change to the engine's interfaces that breaks the H200 script shows here, not on the device."""

from __future__ import annotations

import json

from benchmarks.gpu.phase_b import main


def test_the_quick_replay_section_serves_every_request(tmp_path):
    assert main(["--out", str(tmp_path), "--sections", "replay", "--policies", "recheck", "--requests", "5",
                 "--quick", "--offload-ahead-blocks", "64", "--host-cache-blocks", "1024"]) == 0
    replay = json.loads((tmp_path / "gpu_phase_b.json").read_text())["sections"]["replay"]
    requests = replay["trace"]["requests"]
    assert replay["config"]["settings"]["host_cache_blocks"] == 1024
    assert requests == 5
    for run in (replay["gpu"]["recheck"], replay["gpu_no_overlap"]["recheck"], replay["sim"]["recheck"]):
        assert run["completed"] == requests and run["overshoots"] == 0, run
