"""Drafting on the engine's device (``speculative/device_drafting.py``), checked on the CPU.

* :func:`propose_ngram_batch` is the numpy reference (``propose_ngram_drafts``), row for row.
* :class:`TokenHistories` keeps each drafting request's real tokens: what the host uploads and
  what the device appends after it, rows reused and grown.
* The CUDA engine's launch logic itself (``CudaTorchModelEngine``: the in-flight inputs, the
  device acceptance, the drafts proposed from the token histories, the move-back, the drafts
  copied back with the picks) runs here on CPU tensors, with the CPU's attention in place of the
  Triton kernels and without graphs: an executor over it, overlap on, gives greedy decoding's
  tokens and the acceptance of the host path.
"""

from __future__ import annotations

import dataclasses
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers import cuda_logic_on_cpu, factories
from tests.helpers.triton_interpreter import run_interpreted

from tensorrt_llm._torch.attention_backend.staging import PinnedStaging
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import SpeculativeConfig
from tensorrt_llm._torch.speculative.device_drafting import TokenHistories, propose_ngram_batch
from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=16), st.integers(0, 5)), min_size=1, max_size=6),
    max_draft_len=st.integers(1, 5),
    ngram=st.integers(1, 4),
    slack=st.integers(0, 3),
    filler=st.integers(-1, 3),
)
def test_the_batched_proposal_is_the_numpy_reference(rows, max_draft_len, ngram, slack, filler):
    """Row by row, whatever the buffer holds past each row's length (``filler``) and however wide it is."""
    width = max(1, max(len(tokens) for tokens, _ in rows) + slack)
    history = torch.full((len(rows), width), filler, dtype=torch.int64)
    for row, (tokens, _) in zip(history, rows):
        row[: len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    lengths = torch.tensor([len(tokens) for tokens, _ in rows])
    room = torch.tensor([room for _, room in rows])
    drafts, counts = propose_ngram_batch(history, lengths, room, max_draft_len, ngram)
    assert drafts.shape == (len(rows), max_draft_len)
    for s, (tokens, limit) in enumerate(rows):
        want = propose_ngram_drafts(np.asarray(tokens, dtype=np.int64), min(max_draft_len, limit), ngram)
        assert drafts[s, : counts[s]].tolist() == want, (tokens, limit)
        assert (drafts[s, counts[s] :] == -1).all()


def test_token_histories_upload_what_the_device_lacks_and_append_runs():
    histories = TokenHistories("cpu", width=16, rows=1)
    first = histories.place([7], [[1, 2, 3, 4]], [3])  # the host knows 3 tokens
    assert first.rows.tolist() == [0] and first.upload_index(16).tolist() == [0, 1, 2]
    histories.write(torch.from_numpy(first.upload_index(16)), torch.from_numpy(first.upload_tokens))
    # the forward in flight gave 2 tokens (a draft accepted, then the bonus): appended on the device
    histories.write(torch.tensor([3, 4]), torch.tensor([5, 6]))
    assert histories.gather(torch.tensor([0]), 5).tolist() == [[1, 2, 3, 5, 6]]
    # next launch: the host now knows those two; only they are uploaded (the same values)
    second = histories.place([7], [array("q", [1, 2, 3, 5, 6, 9])], [5])
    assert second.upload_index(16).tolist() == [3, 4] and second.upload_tokens.tolist() == [5, 6]
    assert (second.upload_start.tolist(), second.upload_count.tolist()) == ([3], [2])
    # a second request in the same launch grows the buffer; one outside it gives its row back
    grown = histories.place([7, 8], [[1, 2, 3, 5, 6], [4, 4]], [5, 2])
    assert grown.rows.tolist() == [0, 1] and histories.tokens.shape[0] == 2
    assert grown.upload_index(16).tolist() == [16, 17], "request 7 has its five: only request 8 uploads"
    reused = histories.place([9], [[3]], [1])
    assert reused.rows.tolist() == [0] and histories.tokens.shape[0] == 2, "request 7's row, the oldest"
    assert histories.place([7], [[1, 2, 3, 5, 6]], [5]).upload_index(16).tolist() == list(range(16, 21)), \
        "request 7 lost its row: uploaded whole again"
    shorter = histories.place([9], [[4]], [0])  # fewer tokens than uploaded: they changed
    assert shorter.upload_count.tolist() == [0]
    assert histories.place([9], [[8, 1]], [2]).upload_tokens.tolist() == [8, 1], "uploaded whole again"


# --------------------------------------------------------------------------- the CUDA engine's logic on the CPU


MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")
PROMPTS = [[(i * 37 + j * 11) % 500 + 1 for j in range(12)] for i in range(4)] + [[3, 9, 27, 11, 4]]
SPEC = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=3)


@pytest.fixture(scope="module")
def model():
    with torch.inference_mode(False):
        return factories.served_model(MODEL)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_cuda_engines_drafting_logic_gives_greedy_tokens_and_the_host_paths_acceptance(model):
    plain = cuda_logic_on_cpu.serve(model, PROMPTS, None, overlap=False, on_cpu_logic=False)
    host = cuda_logic_on_cpu.serve(model, PROMPTS, SPEC, overlap=False, on_cpu_logic=False)
    device = cuda_logic_on_cpu.serve(model, PROMPTS, SPEC, overlap=True, on_cpu_logic=True)
    assert host.outputs == plain.outputs and device.outputs == plain.outputs
    print(f"host path: {host.accepted}/{host.verified} accepted; "
          f"device logic, overlap: {device.accepted}/{device.verified}")
    assert device.accepted > 0 and device.verified > device.accepted, "drafts accepted and rejected: the move-back ran"
    assert device.accepted / device.verified >= 0.9 * host.accepted / host.verified
    assert any(launch.engine_drafts for launch in device.launches), "steps in flight were drafted on the device"


@pytest.mark.usefixtures("one_torch_thread")
def test_a_drafting_launch_ships_one_array_more_than_nothing_and_never_waits(model):
    """A step built in flight with draft slots costs the host what a plain step in flight does in
    copies: everything the device needs for the in-flight inputs, the move-back, the drafting and
    the verification rides in one array (``engine.in_flight``), no value is read back, and no
    staging buffer is reused while the launch that filled it may still run. (Before, such a step
    shipped 13 more arrays and ran 70 more device ops than a plain one.) In the proposer's torch
    form (the CPU's, and CUDA's where the kernel does not compile) the previous launch's acceptance,
    the proposal, the fill and the move cost 69 device ops more than a plain launch of the batch."""
    plain = cuda_logic_on_cpu.serve(model, PROMPTS, None, overlap=True, on_cpu_logic=True)
    drafted = cuda_logic_on_cpu.serve(model, PROMPTS, SPEC, overlap=True, on_cpu_logic=True)
    steady = [launch for launch in plain.launches if launch.uploads == 3]  # ids, positions, the in-flight array
    assert steady, plain.launches
    drafting = [launch for launch in drafted.launches if launch.engine_drafts]
    assert len(drafting) > 10
    assert {launch.uploads for launch in drafting} == {3}, drafting
    assert all(launch.syncs == 0 for launch in plain.launches + drafted.launches)
    assert plain.staging_waits == 0 and drafted.staging_waits == 0
    extra = cuda_logic_on_cpu.ops_over_plain(drafted.launches, plain.launches)
    print(f"device ops per launch: plain {max(launch.ops for launch in steady)}, drafting (torch form) +{max(extra)}")
    assert len(extra) > 10 and max(extra) <= 69, extra


def test_the_stand_in_staging_counts_a_buffer_reused_too_soon():
    """The staging's wait counter, as the test above reads it, can see a wait: a third launch
    before the first one's forward completed reuses its buffer."""
    with cuda_logic_on_cpu.cuda_stand_ins():
        staging = PinnedStaging("cpu", capacity=64)
        forwards = []
        for _ in range(3):
            with staging.step():
                staging.to_device(np.arange(4))
            forwards.append(torch.cuda.Event())
            forwards[-1].record()
        assert staging.num_waits == 1
        forwards[-1].synchronize()  # the last forward done: every buffer free
        with staging.step():
            pass
        assert staging.num_waits == 1


def test_the_fused_drafting_kernel_is_the_reference_interpreted():
    """The n-gram drafting kernel CUDA runs (``speculative/triton_drafting.py``) under Triton's CPU
    interpreter, in a fresh process (TRITON_INTERPRET must be set before Triton is first
    imported): on random cases its acceptance of the previous launch, fills, moves, drafts, counts,
    history rows and draft slots are the reference's; and the CUDA engine's launch logic drafting
    with it gives plain decoding's tokens, the torch form's acceptance, and a drafting launch no copy
    and at most one device op more than a plain launch in flight of the same batch (the kernel, one
    op, replaces the fill's two; the copy back takes the drafts along; the op more is the logit
    rows' reorder of a batch above one: none alone). Before the acceptance, fill and move joined the kernel, a
    drafting launch ran 16 ops more. The two forms alternated launch by launch (as the GPU profile
    alternates them) give the same tokens and acceptance."""
    results = run_interpreted(Path(__file__).parents[3] / "helpers" / "interpreted_drafting.py")
    assert len(results["cases"]) == 30 and all(case["ok"] for case in results["cases"]), results["cases"]
    served = results["served"]
    print(served)
    assert served["outputs_equal"] and served["mixed_outputs_equal"], served
    assert served["acceptance_mixed"] == served["acceptance"], served  # each form reads what the other wrote
    assert served["acceptance"] == served["acceptance_torch_form"] and served["acceptance"][0] > 0, served
    assert served["drafting_launches"] > 10 and served["extra_ops"] <= 1, served
    assert served["extra_ops_batch_1"] <= 0, served  # one request: its rows need no reorder
    assert served["uploads"] == [3] and served["syncs"] == 0 and served["staging_waits"] == 0, served
