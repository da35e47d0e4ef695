"""``SamplingParams.prompt_logprobs``: every prompt position's logits come back from the engine,
chunk by chunk, and match a float64 reference forward (tiny-random in float64: to rounding)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm.llmapi import LLM, KvCacheConfig, SamplingParams

PROMPT = list(range(1, 40))


@pytest.mark.usefixtures("one_torch_thread")
def test_prompt_logprobs_over_chunks_match_the_reference_and_samples_still_share_the_prompt():
    with LLM("tiny-random", dtype="float64", max_seq_len=128, max_num_tokens=16, enable_chunked_prefill=True,
             kv_cache_config=KvCacheConfig(tokens_per_block=8, num_blocks=64)) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=0, n=2, temperature=1.0))
        stats = llm.iteration_stats
        model = llm.executor.model_engine.model
    with torch.inference_mode():
        reference = torch.log_softmax(model.forward_full(torch.tensor(PROMPT)).to(torch.float64), dim=-1)
    scored = out.prompt_logprobs
    assert len(scored) == len(PROMPT) and scored[0] is None
    for position in range(1, len(PROMPT)):
        entry, row = scored[position], reference[position - 1]
        assert entry.token == PROMPT[position] and entry.logprob == pytest.approx(float(row[PROMPT[position]]), abs=1e-12)
        assert [i for i, _ in entry.top] == torch.topk(row, 2).indices.tolist()
    assert max(s.forward_tokens for s in stats) <= 16  # the prompt ran in chunks of at most 16
    # sample 0 computed the whole prompt (no claim: it needs every position's logits); sample 1 claimed its blocks
    assert sum(s.reuse_claimed_tokens for s in stats) == 32
    assert [len(c.logprobs) for c in out.outputs] == [3, 3]
