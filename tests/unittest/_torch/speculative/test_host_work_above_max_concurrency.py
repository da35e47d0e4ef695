"""Above ``max_concurrency``, a speculative config's iteration does plain decoding's host work.

SmolLM2 is host-bound on a GPU: under the overlap scheduler the host's work per iteration is the
step time, so anything a speculative config runs on every iteration, even one where nobody
drafts, would be paid on every step. This serves a burst far above the limit for its whole life
(``test_drafts_above_max_concurrency``'s workload: the requests' lengths make them all finish in
the same iteration) through the CUDA engine's launch logic on CPU tensors
(``tests.helpers.cuda_logic_on_cpu``: ``CudaTorchModelEngine.launch`` and everything it calls,
with the overlap scheduler on), once with an n-gram ``speculative_config`` and once without, and
counts, per iteration:

* the device ops each launch enqueues, the host arrays it ships and the values it reads back
  (``LaunchRecord``): equal launch for launch;
* the engine's drafting state: the device token histories are never placed, uploaded to or
  appended to (``TokenHistories.place`` / ``write``: the engine keeps a request's history only
  for a step it drafts);
* every Python function of ``tensorrt_llm`` the executor's ``step`` calls, by count: equal, but
  for the drafter's one pass over the requests (``Drafter.prepare_draft_tokens``, ``observe``,
  ``ModelEngine.proposes_drafts``: about 5 us at 64 requests). The iteration that admits the
  burst also validates and admits each request as speculative, once.

Counts, not time: they do not depend on the machine.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import pytest
from tests.helpers import cuda_logic_on_cpu
from tests.helpers.speculative_burst import (BUDGET, MAX_TOKENS, NUM_REQUESTS, PROMPTS, SPEC, burst_model,
                                             lengths_ending_together)

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, KvCacheConfig, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the drafter's pass over the requests, once an iteration (observe: once per completed forward)
DRAFTER_PASS = {"sampling/drafter.py:prepare_draft_tokens", "sampling/drafter.py:<listcomp>",
                "sampling/drafter.py:observe", "engine/interface.py:proposes_drafts"}


@pytest.fixture(scope="module")
def model():
    return burst_model()


@dataclasses.dataclass
class _Run:
    outputs: list[list[int]]
    launches: list[cuda_logic_on_cpu.LaunchRecord]
    calls: list[collections.Counter]  # per iteration: "module path:function" -> calls
    first_token_steps: list[int]
    history_writes: int  # TokenHistories.place and write calls


def _serve(model, spec: SpeculativeConfig | None, lengths: list[int], *, count_calls: bool) -> _Run:
    """The burst on a fresh executor (overlap on) over the CUDA engine's launch logic."""
    config = ExecutorConfig(max_num_tokens=BUDGET, max_seq_len=4096, max_batch_size=64, speculative_config=spec,
                            disable_overlap_scheduler=False, enable_chunked_prefill=True,
                            kv_cache_config=KvCacheConfig(tokens_per_block=32, num_blocks=1024))
    with cuda_logic_on_cpu.cuda_stand_ins():
        executor = cuda_logic_on_cpu.recording_executor(model, config)
        assert executor.overlap
        engine = executor.model_engine
        writes = [0]
        if engine._drafting is not None:
            histories = engine._drafting.histories
            for name in ("place", "write"):
                original = getattr(histories, name)

                def counted(*args, _original=original, **kwargs):
                    writes[0] += 1
                    return _original(*args, **kwargs)

                setattr(histories, name, counted)
        requests = [LlmRequest(input_token_ids=list(p), max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
        for request in requests:
            executor.enqueue_request(request)
        calls: list[collections.Counter] = []
        first = [None] * len(requests)
        while executor.has_work:
            counter: collections.Counter = collections.Counter()
            if count_calls:
                sys.setprofile(_call_counter(counter))
            try:
                executor.step()
            finally:
                sys.setprofile(None)
            for index, request in enumerate(requests):
                if first[index] is None and request.first_token_time is not None:
                    first[index] = len(calls)
            calls.append(counter)
    assert all(r.error is None for r in requests), [r.error for r in requests if r.error]
    return _Run([list(r.output_token_ids) for r in requests], engine.records, calls, first, writes[0])


def _call_counter(counter: collections.Counter):
    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if "/tensorrt_llm/_torch/" in path:
                counter[f"{path.split('/pyexecutor/')[-1]}:{frame.f_code.co_name}"] += 1
    return profile


def _lengths_ending_together(model) -> list[int]:
    return lengths_ending_together(_serve(model, None, [MAX_TOKENS] * NUM_REQUESTS, count_calls=False).first_token_steps)


def test_each_iteration_above_max_concurrency_does_plain_decodings_host_work(model):
    lengths = _lengths_ending_together(model)
    speculative = _serve(model, SPEC, lengths, count_calls=True)
    plain = _serve(model, None, lengths, count_calls=True)
    assert speculative.outputs == plain.outputs
    assert len(speculative.calls) == len(plain.calls)
    # the device: launch for launch the same ops, copies and reads back; nothing drafted
    assert [dataclasses.astuple(r) for r in speculative.launches] == [dataclasses.astuple(r) for r in plain.launches]
    assert all(r.engine_drafts == 0 and r.syncs == 0 for r in speculative.launches)
    assert speculative.history_writes == 0, "no device token history is kept while nobody drafts"
    # the host: every iteration after the admitting one calls what plain decoding calls, plus the drafter's pass
    for iteration, (spec_calls, plain_calls) in enumerate(zip(speculative.calls, plain.calls)):
        extra = dict(spec_calls - plain_calls)
        missing = dict(plain_calls - spec_calls)
        assert not missing, (iteration, missing)
        allowed = DRAFTER_PASS if iteration else None
        if allowed is not None:
            assert set(extra) <= allowed, (iteration, extra)
            assert sum(extra.values()) <= len(allowed) + 1, (iteration, extra)
        else:  # admission: each request validated and made speculative once
            per_request = {key: count for key, count in extra.items() if key not in DRAFTER_PASS}
            assert all(count % NUM_REQUESTS == 0 for count in per_request.values()), per_request


def test_below_max_concurrency_the_counts_see_drafting(model):
    """The counters above are not blind: with the limit above the burst, the same workload keeps
    device token histories and its drafting launches enqueue more ops than plain ones."""
    lengths = _lengths_ending_together(model)
    spec = dataclasses.replace(SPEC, max_concurrency=NUM_REQUESTS)
    drafted = _serve(model, spec, lengths, count_calls=False)
    plain = _serve(model, None, lengths, count_calls=False)
    assert drafted.outputs == plain.outputs
    assert drafted.history_writes > 0
    drafting = [r for r in drafted.launches if r.engine_drafts]
    assert drafting and max(r.ops for r in drafting) > max(r.ops for r in plain.launches)
