"""The fused n-gram drafting kernel (``speculative/triton_drafting.py``) under TRITON_INTERPRET=1.

Called by ``test_device_drafting`` in a fresh process (the interpreter must be on before Triton is
imported); prints one JSON line:

* ``cases``: per random case (requests with histories partly on the device, uploads, runs of the
  previous launch with and without a runs table, room, several n-gram sizes and draft lengths),
  whether the kernel's drafts, counts, history rows and draft slots are the numpy reference's
  (``ngram.propose_ngram_drafts`` over the request's real tokens), and that it wrote nothing else;
* ``served``: the CUDA engine's launch logic on CPU tensors (``cuda_logic_on_cpu``) drafting with
  the kernel and with the proposer's torch form, overlap on: outputs against plain decoding,
  acceptance, and the device ops of a drafting launch over a plain one (the kernel counted once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers

from tests.helpers.interpreted_kernels import _fix_interpreter_for_numpy_2_4  # noqa: E402

_COLUMNS = ("rows", "known", "source", "room", "first", "upload_start", "upload_count", "upload_offset")


def run_case(seed: int, device: str = "cpu") -> dict:
    """One random case on ``device`` (the CPU under the interpreter, or a GPU)."""
    from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts
    from tensorrt_llm._torch.speculative.triton_drafting import propose_ngram_in_flight

    rng = random.Random(seed)
    entries, max_draft_len, ngram, width = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 4), 48
    sampled = entries + rng.randint(0, 3)  # the previous launch's sampling requests
    has_runs = seed % 3 != 0
    run_width = rng.randint(2, max_draft_len + 1)
    runs = torch.randint(0, 4, (sampled, run_width)) if has_runs else torch.randint(0, 4, (sampled,))
    accepted = torch.randint(0, run_width, (sampled,)) if has_runs else None
    histories = torch.full((entries + 2, width), 7, dtype=torch.int32)  # 7: never a token below
    rows = rng.sample(range(entries + 2), entries)
    columns = {name: [] for name in _COLUMNS}
    uploads, want = [], []
    ids = torch.full((8 * entries,), -5, dtype=torch.int64)
    for e in range(entries):
        known = rng.randint(0, 30)
        tokens = [rng.randint(0, 3) for _ in range(known)]
        on_device = rng.randint(0, known)  # uploaded at an earlier launch
        histories[rows[e], :on_device] = torch.tensor(tokens[:on_device], dtype=torch.int32)
        source, room = rng.randrange(sampled), rng.randint(0, max_draft_len)
        run = runs[source, : int(accepted[source]) + 1].tolist() if has_runs else [int(runs[source])]
        full = tokens + run
        want.append((rows[e], full, propose_ngram_drafts(np.asarray(full, dtype=np.int64), room, ngram), room))
        for name, value in zip(_COLUMNS, (rows[e], known, source, room, 8 * e, on_device, known - on_device, 0)):
            columns[name].append(value)
        uploads.append(tokens[on_device:])
    at = {name: i * entries for i, name in enumerate(_COLUMNS)}
    offset = len(_COLUMNS) * entries
    for e, upload in enumerate(uploads):
        columns["upload_offset"][e] = offset
        offset += len(upload)
    at["proposals"], at["counts"] = offset, offset + entries * max_draft_len
    plan = torch.tensor([v for name in _COLUMNS for v in columns[name]] + [t for u in uploads for t in u]
                        + [99] * (entries * max_draft_len + entries), dtype=torch.int64)
    on = [t.to(device) if t is not None else None for t in (histories, plan, runs, accepted, ids)]
    propose_ngram_in_flight(on[0], on[1], at, on[2], on[3], on[4], entries, max_draft_len, ngram, 0)
    histories, plan, ids = on[0].cpu(), on[1].cpu(), on[4].cpu()
    drafts = plan[at["proposals"] : at["counts"]].view(entries, max_draft_len)
    counts = plan[at["counts"] :]
    ok = True
    for e, (row, full, expected, room) in enumerate(want):
        count = int(counts[e])
        ok &= drafts[e, :count].tolist() == expected and bool((drafts[e, count:] == -1).all())
        ok &= histories[row, : len(full)].tolist() == full
        ok &= ids[8 * e : 8 * e + room].tolist() == expected + [0] * (room - len(expected))
        ok &= ids[8 * e + room : 8 * e + 8].tolist() == [-5] * (8 - room)  # past its slots: untouched
    untouched = [r for r in range(entries + 2) if r not in rows]
    ok &= bool((histories[untouched] == 7).all())
    return {"seed": seed, "ok": bool(ok)}


def run_served() -> dict:
    from tests.helpers import cuda_logic_on_cpu, factories

    from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
    from tensorrt_llm._torch.pyexecutor.config import SpeculativeConfig

    torch.set_num_threads(1)
    model = factories.served_model(dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64"))
    prompts = [[(i * 37 + j * 11) % 500 + 1 for j in range(12)] for i in range(4)] + [[3, 9, 27, 11, 4]]
    spec = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=3)
    serve = cuda_logic_on_cpu.serve
    plain = serve(model, prompts, None, overlap=False, on_cpu_logic=False)
    in_flight = serve(model, prompts, None, overlap=True, on_cpu_logic=True)
    torch_form = serve(model, prompts, spec, overlap=True, on_cpu_logic=True)
    fused = serve(model, prompts, spec, overlap=True, on_cpu_logic=True, fused=True)
    plain_ops = min(launch.ops for launch in in_flight.launches if launch.uploads == 3)
    drafting = [launch for launch in fused.launches if launch.engine_drafts]
    return {
        "outputs_equal": fused.outputs == plain.outputs and torch_form.outputs == plain.outputs,
        "acceptance": [fused.accepted, fused.verified],
        "acceptance_torch_form": [torch_form.accepted, torch_form.verified],
        "drafting_launches": len(drafting), "plain_ops": plain_ops,
        "extra_ops": max(launch.ops for launch in drafting) - plain_ops,
        "uploads": sorted({launch.uploads for launch in drafting}), "syncs": sum(launch.syncs for launch in drafting),
        "staging_waits": fused.staging_waits,
    }


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _fix_interpreter_for_numpy_2_4()
    print(json.dumps({"cases": [run_case(seed) for seed in range(30)], "served": run_served()}))


if __name__ == "__main__":
    main()
