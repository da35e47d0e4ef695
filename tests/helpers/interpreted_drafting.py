"""The fused n-gram drafting kernel (``speculative/triton_drafting.py``) under TRITON_INTERPRET=1.

Called by ``test_device_drafting`` in a fresh process (the interpreter must be on before Triton is
imported); prints one JSON line:

* ``cases``: per random case (a previous launch with and without a verification of drafts, its
  acceptance worked out by hand; requests with histories partly on the device, uploads, room,
  several n-gram sizes and draft lengths; in-flight inputs to fill; rows to move), whether the
  kernel's drafts, counts, history rows and draft slots are the numpy reference's
  (``ngram.propose_ngram_drafts`` over the request's real tokens), its fills the token after each
  request's accepted drafts, its moves the position, KV slot and attended length of the count
  accepted, and that it wrote nothing else;
* ``served``: the CUDA engine's launch logic on CPU tensors (``cuda_logic_on_cpu``) drafting with
  the kernel and with the proposer's torch form, overlap on: outputs against plain decoding,
  acceptance, and the most device ops a drafting launch ran over a plain one in flight of its batch
  (``cuda_logic_on_cpu.ops_over_plain``; the kernel and the model's forward counted once each), in
  a batch of five requests and alone; and the two forms alternated launch by launch.
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

from benchmarks.gpu.interpreter import fix_numpy_2_4  # noqa: E402

_DRAFT = ("rows", "known", "source", "room", "first", "upload_start", "upload_count", "upload_offset")


def _previous_launch(rng, verified: bool, sampled: int, max_draft_len: int):
    """The previous launch: its picks (one per logit row), and, when it ``verified`` drafts, its
    plan with target rows and draft indices as ``InFlightStep`` lays them out, with the reference
    acceptance of each of its sampling requests: (accepted, run)."""
    rows = sampled + rng.randint(0, 4)
    tokens = torch.tensor([rng.randint(0, 3) for _ in range(rows)], dtype=torch.int64)
    if not verified:
        return tokens, None, [(0, [int(tokens[m])]) for m in range(sampled)]
    width = rng.randint(2, max_draft_len + 1)
    target_rows = [[m] + [rng.randrange(rows) for _ in range(width - 1)] for m in range(sampled)]
    junk = rng.randint(0, 3)
    target_at, where_at = junk, junk + sampled * width
    none = where_at + sampled * (width - 1)  # a -1, then the drafts' values
    values, where, want = [], [], []
    for m in range(sampled):
        count = rng.randint(0, width - 1)
        targets = [int(tokens[r]) for r in target_rows[m]]
        drafts = [targets[j] if rng.random() < 0.6 else rng.randint(0, 3) for j in range(count)]  # mostly accepted
        where += [none + 1 + len(values) + j for j in range(count)] + [none] * (width - 1 - count)
        values += drafts
        accepted = 0
        while accepted < count and drafts[accepted] == targets[accepted]:
            accepted += 1
        want.append((accepted, targets[: accepted + 1]))
    plan = torch.tensor([5] * junk + [r for row in target_rows for r in row] + where + [-1] + values, dtype=torch.int64)
    return tokens, (plan, target_at, where_at, width), want


def run_case(seed: int, device: str = "cpu") -> dict:
    """One random case on ``device`` (the CPU under the interpreter, or a GPU): a previous launch
    with or without a verification, then fills, moves and drafting entries of a launch."""
    from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts
    from tensorrt_llm._torch.speculative.triton_drafting import InFlightColumns, complete_in_flight

    rng = random.Random(seed)
    entries, max_draft_len, ngram, width = rng.randint(0, 5), rng.randint(1, 5), rng.randint(1, 4), 48
    sampled = max(entries, 1) + rng.randint(0, 3)  # the previous launch's sampling requests
    verified = seed % 3 != 0
    tokens, previous, acceptance = _previous_launch(rng, verified, sampled, max_draft_len)
    histories = torch.full((entries + 2, width), 7, dtype=torch.int32)  # 7: never a token below
    rows = rng.sample(range(entries + 2), entries)
    columns = {name: [] for name in _DRAFT}
    uploads, want = [], []
    fills = rng.randint(0, 4)
    ids = torch.full((8 * entries + fills,), -5, dtype=torch.int64)
    for e in range(entries):
        known = rng.randint(0, 30)
        history = [rng.randint(0, 3) for _ in range(known)]
        on_device = rng.randint(0, known)  # uploaded at an earlier launch
        histories[rows[e], :on_device] = torch.tensor(history[:on_device], dtype=torch.int32)
        source, room = rng.randrange(sampled), rng.randint(0, max_draft_len)
        full = history + acceptance[source][1]
        want.append((rows[e], full, propose_ngram_drafts(np.asarray(full, dtype=np.int64), room, ngram), room))
        for name, value in zip(_DRAFT, (rows[e], known, source, room, 8 * e, on_device, known - on_device, 0)):
            columns[name].append(value)
        uploads.append(history[on_device:])
    fill_source = [rng.randrange(sampled) for _ in range(fills)]
    moves = rng.randint(0, 6) if verified else 0  # only a forward built on verified drafts moves
    positions = torch.full((moves + 2,), -3, dtype=torch.int64)
    slots = torch.full((moves + 2,), -4, dtype=torch.int64)
    seq_lens = torch.full((moves + 2,), -6, dtype=torch.int32)
    move_width = previous[3] if verified else 1
    move_rows = rng.sample(range(moves + 2), moves)
    move_sequences = rng.sample(range(moves + 2), moves)
    move_owners = [rng.randrange(sampled) for _ in range(moves)]
    move_base = [rng.randint(0, 40) for _ in range(moves)]
    move_slots = [[rng.randint(0, 999) for _ in range(move_width)] for _ in range(moves)]
    lists = [("fill_rows", [8 * entries + f for f in range(fills)]), ("fill_source", fill_source),
             ("move_rows", move_rows), ("move_sequences", move_sequences), ("move_owners", move_owners),
             ("move_base", move_base), ("move_slots", [c for row in move_slots for c in row])]
    lists += [(name, columns[name]) for name in _DRAFT]
    at, flat = {}, []
    for name, values in lists:
        at[name] = len(flat)
        flat += values
    for e, upload in enumerate(uploads):
        flat[at["upload_offset"] + e] = len(flat)
        flat += upload
    at["proposals"], at["counts"] = len(flat), len(flat) + entries * max_draft_len
    plan = torch.tensor(flat + [99] * (entries * max_draft_len + entries), dtype=torch.int64)
    moved = [t.to(device) for t in (histories, plan, tokens, ids, positions, slots, seq_lens)]
    before = (previous[0].to(device), *previous[1:]) if verified else None
    complete_in_flight(moved[0], moved[1], at, InFlightColumns(fills, moves, move_width, entries), before, moved[2],
                       *moved[3:], max_draft_len, ngram, 0)
    histories, plan, _, ids, positions, slots, seq_lens = (t.cpu() for t in moved)
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
    ok &= ids[8 * entries :].tolist() == [acceptance[m][1][-1] for m in fill_source]  # the token after each run
    expected_positions, expected_slots, expected_lens = [-3] * (moves + 2), [-4] * (moves + 2), [-6] * (moves + 2)
    for x in range(moves):
        accepted = acceptance[move_owners[x]][0]
        expected_positions[move_rows[x]] = move_base[x] + accepted
        expected_slots[move_rows[x]] = move_slots[x][accepted]
        expected_lens[move_sequences[x]] = move_base[x] + accepted + 1
    ok &= positions.tolist() == expected_positions and slots.tolist() == expected_slots
    ok &= seq_lens.tolist() == expected_lens
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
    plain_ops = max(launch.ops for launch in in_flight.launches if launch.uploads == 3)
    drafting = [launch for launch in fused.launches if launch.engine_drafts]
    extra = cuda_logic_on_cpu.ops_over_plain(fused.launches, in_flight.launches)
    mixed = _alternating_forms(lambda: serve(model, prompts, spec, overlap=True, on_cpu_logic=True, fused=True))
    alone = serve(model, prompts[:1], spec, overlap=True, on_cpu_logic=True, fused=True)  # batch 1
    extra_alone = cuda_logic_on_cpu.ops_over_plain(
        alone.launches, serve(model, prompts[:1], None, overlap=True, on_cpu_logic=True).launches)
    return {
        "outputs_equal": fused.outputs == plain.outputs and torch_form.outputs == plain.outputs,
        "mixed_outputs_equal": mixed.outputs == plain.outputs,
        "acceptance_mixed": [mixed.accepted, mixed.verified],
        "acceptance": [fused.accepted, fused.verified],
        "acceptance_torch_form": [torch_form.accepted, torch_form.verified],
        "drafting_launches": len(drafting), "plain_ops": plain_ops,
        "extra_ops": max(extra) if len(extra) > 10 else None,
        "extra_ops_batch_1": max(extra_alone) if len(extra_alone) > 10 else None,
        "uploads": sorted({launch.uploads for launch in drafting}), "syncs": sum(launch.syncs for launch in drafting),
        "staging_waits": fused.staging_waits,
    }


def _alternating_forms(run):
    """``run()`` with the engine drafting in the fused kernel and in the torch form launch by launch
    (as ``benchmarks.gpu.draft_step_profile`` alternates them window by window): each launch reads
    the previous one's drafts and verification whichever form wrote them."""
    from tests.helpers import cuda_logic_on_cpu

    launch = cuda_logic_on_cpu._Recording.launch

    def alternating(engine, inputs):
        drafting = engine._drafting
        drafting.ngram_size = engine.draft_proposer.max_matching_ngram_size if len(engine.records) % 2 else None
        return launch(engine, inputs)

    cuda_logic_on_cpu._Recording.launch = alternating
    try:
        return run()
    finally:
        cuda_logic_on_cpu._Recording.launch = launch


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    fix_numpy_2_4()
    print(json.dumps({"cases": [run_case(seed) for seed in range(30)], "served": run_served()}))


if __name__ == "__main__":
    main()
