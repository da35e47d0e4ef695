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

import contextlib
import dataclasses
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers import factories

from tensorrt_llm._torch.attention_backend.paged import PagedPlanBuilder
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS
from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.engine import torch_engine
from tensorrt_llm._torch.pyexecutor.engine.in_flight import Drafting
from tensorrt_llm._torch.pyexecutor.engine.torch_engine import CudaTorchModelEngine
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor import py_executor_creator
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
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


class _CpuStaging:
    """``PinnedStaging``'s interface on the CPU: plain copies, no buffers to turn."""

    @contextlib.contextmanager
    def step(self):
        yield self

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(array))

    def copy_to(self, dst: torch.Tensor, array: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(np.ascontiguousarray(array)))


class _Done:
    """A CUDA event's interface for work that ran at once."""

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class _DeviceLogicOnCpu(CudaTorchModelEngine):
    """``CudaTorchModelEngine.launch`` and everything it calls, over CPU tensors: the plans of the
    paged backend (the CPU's reference attention), no graphs."""

    def _prepare_device(self, cuda_graph_config, max_batch_size, max_seq_len) -> None:
        self._device_picks = None
        self._staging = _CpuStaging()
        kv = self.kv_cache_manager
        self._plans = PagedPlanBuilder(self.device, tokens_per_block=kv.tokens_per_block, num_blocks=kv.num_blocks,
                                       num_kv_heads=self.model.num_local_kv_heads)
        self._drafting = None
        if self.draft_proposer is not None:  # the proposer's torch form (the fused kernel is CUDA's)
            self._drafting = Drafting(TokenHistories(self.device, (max_seq_len or 256) + self.max_draft_len + 2, rows=2),
                                      self.draft_proposer)


MODEL = dataclasses.replace(MODEL_PRESETS["tiny-random"], dtype="float64")
PROMPTS = [[(i * 37 + j * 11) % 500 + 1 for j in range(12)] for i in range(4)] + [[3, 9, 27, 11, 4]]


def _serve(model, spec: SpeculativeConfig | None, *, overlap: bool):
    config = ExecutorConfig(max_num_tokens=96, max_seq_len=256, max_batch_size=8, speculative_config=spec,
                            disable_overlap_scheduler=not overlap,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, num_blocks=512))
    executor = create_py_executor(config, model=model)
    assert executor.overlap == overlap
    requests = [LlmRequest(input_token_ids=p, max_new_tokens=40) for p in PROMPTS]
    for request in requests:
        executor.enqueue_request(request)
    executor.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    stats = executor.iteration_stats
    engine = executor.model_engine
    if isinstance(engine, _DeviceLogicOnCpu):  # its steps in flight were drafted from its token histories
        assert engine._drafting is not None and engine._drafting.histories._placed
    return [r.output_token_ids for r in requests], sum(s.num_draft_tokens for s in stats), \
        sum(s.num_accepted_draft_tokens for s in stats)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_cuda_engines_drafting_logic_gives_greedy_tokens_and_the_host_paths_acceptance(monkeypatch):
    model = factories.served_model(MODEL)
    spec = SpeculativeConfig(max_draft_len=4, max_matching_ngram_size=3)
    plain, _, _ = _serve(model, None, overlap=False)
    host, host_verified, host_accepted = _serve(model, spec, overlap=False)
    monkeypatch.setattr(torch_engine, "_record_event", _Done)
    monkeypatch.setattr(py_executor_creator, "TorchModelEngine", _DeviceLogicOnCpu)  # the executor builds this one
    device, verified, accepted = _serve(model, spec, overlap=True)
    assert host == plain and device == plain
    print(f"host path: {host_accepted}/{host_verified} accepted; device logic, overlap: {accepted}/{verified}")
    assert accepted > 0 and verified > accepted, "drafts accepted and rejected: the move-back ran"
    assert accepted / verified >= 0.9 * host_accepted / host_verified
