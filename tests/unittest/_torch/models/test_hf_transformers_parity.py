"""Every architecture the engine loads, held to transformers' own forward on checkpoints transformers wrote.

For each row of the architecture table (``hf_reference.CASES``: Llama with llama3 / linear /
dynamic RoPE, tied embeddings, biases, one KV head, a head_dim of its own; Mistral; Qwen2's
q/k/v biases; Qwen3's q/k norms), a tiny random checkpoint is saved by ``save_pretrained`` with
small shards and served by ``LLM(directory)`` in float64:

* the logits the executor samples from, through chunked prefill, block reuse, a host-tier round
  trip (evicted to the host, onboarded again) and decode, equal transformers' forward on the
  same tokens within 1e-9;
* greedy generations of 32 tokens equal transformers' greedy decoding, under the ``recheck``
  and ``claim`` token-budget policies, with and without the overlap scheduler.
"""

from __future__ import annotations

import collections

import pytest
import torch
from tests.helpers.hf_reference import CASE_NAMES, CASES, float64_reference, reference_greedy, reference_logits, write_checkpoint

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

TOL = 1e-9
TOKENS_PER_BLOCK = 4


@pytest.fixture(scope="module", params=CASES, ids=CASE_NAMES)
def checkpoint(request, tmp_path_factory):
    case = request.param
    directory = write_checkpoint(case, tmp_path_factory.mktemp(case.name) / case.name, seed=CASES.index(case))
    return case, directory, float64_reference(directory)


def tokens(seed: int, n: int, vocab: int = 160) -> list[int]:
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % vocab for i in range(n)]


def serve(directory, *, policy="recheck", overlap=False, num_blocks=24, host_blocks=32) -> LLM:
    kv_bytes = 2 * 2 * 4 * 16 * 8  # at most: 2 layers, K and V, 4 KV heads of 16, float64 (host tier sized in bytes)
    return LLM(str(directory), dtype="float64", max_num_tokens=16, enable_chunked_prefill=True, max_batch_size=4,
               token_budget_policy=policy, disable_overlap_scheduler=not overlap,
               kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=num_blocks,
                                             host_cache_size=host_blocks * TOKENS_PER_BLOCK * kv_bytes))


class LogitsRecorder:
    """Wraps the engine's forward: every logits row the sampler reads, by request id, in order."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        engine = llm.executor.model_engine
        launch = engine.forward_async
        recorder = self

        class Recorded:
            def __init__(self, pending) -> None:
                self._pending, self.num_tokens = pending, pending.num_tokens

            def result(self):
                out = self._pending.result()
                for request_id, row in out.logits.items():
                    recorder.rows[request_id].append(row.detach().clone())
                return out

            def __getattr__(self, name):
                return getattr(self._pending, name)

        engine.forward_async = lambda batch: Recorded(launch(batch))


def test_logits_equal_transformers_through_chunks_reuse_host_tier_and_decode(checkpoint):
    case, directory, reference = checkpoint
    llm = serve(directory)
    try:
        assert llm.model_id == case.name
        recorder = LogitsRecorder(llm)
        shared = tokens(1, 40)
        steps = SamplingParams(max_tokens=6)
        runs = []  # (request id, prompt, output)

        def run(prompt):
            handle = llm.generate_async(prompt, steps)
            out = handle.result(timeout=120).outputs[0].token_ids
            runs.append((handle.request_id, prompt, out))

        run(shared)  # 40 tokens over a budget of 16: three chunks, then decode
        claimed = sum(s.reuse_claimed_tokens for s in llm.iteration_stats)
        run(shared[:32] + tokens(2, 5))  # 8 of A's blocks reused
        assert sum(s.reuse_claimed_tokens for s in llm.iteration_stats) > claimed, "the prefix must be reused"
        for seed in (3, 4, 5):  # unrelated prompts push A's blocks out of a 24-block pool to the host tier
            run(tokens(seed, 36))
        onboards = llm.executor.load().kv.num_onboards
        run(shared[:36] + tokens(6, 3))  # A's prefix comes back from the host
        assert llm.executor.load().kv.num_onboards > onboards, "the prefix must be onboarded from the host tier"
    finally:
        llm.shutdown()

    worst = 0.0
    for request_id, prompt, out in runs:
        rows = torch.stack(recorder.rows[request_id])  # (len(out), vocab): one per sampled token
        assert rows.shape[0] == len(out) == 6
        expected = reference_logits(reference, prompt + out[:-1])[len(prompt) - 1:]  # the rows that predict out
        worst = max(worst, (rows - expected).abs().max().item())
    print(f"{case.name}: max |engine - transformers| logits = {worst:.3g}")
    assert worst <= TOL, f"{case.name}: logits differ from transformers' by {worst}"


@pytest.mark.parametrize("policy, overlap", [("recheck", False), ("claim", False), ("recheck", True), ("claim", True)])
def test_greedy_generations_equal_transformers(checkpoint, policy, overlap):
    case, directory, reference = checkpoint
    base = tokens(7, 20)
    prompts = [base + tokens(8 + i, 3 + 5 * i) for i in range(3)] + [tokens(11, 30)]
    expected = _greedy(case.name, reference, prompts)
    with serve(directory, policy=policy, overlap=overlap, num_blocks=48) as llm:
        assert llm.executor.overlap == overlap
        outputs = llm.generate(prompts, SamplingParams(max_tokens=32))
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert sum(s.reuse_claimed_tokens for s in llm.iteration_stats) > 0


_GREEDY: dict[str, list[list[int]]] = {}


def _greedy(name, reference, prompts):
    if name not in _GREEDY:
        _GREEDY[name] = [reference_greedy(reference, prompt, 32) for prompt in prompts]
    return _GREEDY[name]
