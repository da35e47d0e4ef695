"""``LLM(..., batch_invariant=True)``: a request's tokens and logprobs are the same bits whatever
else is in its batches (docs/determinism.md).

Each example draws a batch mix (block size, token budget and chunked prefill, block reuse off /
on / partial, a host tier under a tight pool, the overlap scheduler, a target request with its
prompt length, sampling and logprobs, batch mates that share its prefix or not, cached prompts
warmed first, when the target arrives) and serves it on a fresh float32 tiny-random LLM. The target's tokens, sampled
logprobs and prompt logprobs must equal, bit for bit, what the same request gets alone on an LLM
with none of that (one chunk, no reuse, no overlap). float32 on purpose: there the default
kernels do differ between batch shapes (``tests/unittest/serve/test_completions_batch.py``
failed on an AMD EPYC for that).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm.llmapi.llm import LLM, SamplingParams
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tests.helpers.strategies import examples

VOCAB = 512  # tiny-random
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32: one token in every pool
RESULT_TIMEOUT_S = 60

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def document(doc: int, length: int) -> tuple[int, ...]:
    """Prompts cut from a few documents share prefixes (block reuse has something to claim)."""
    return tuple(1 + (doc * 7919 + i * 104729 + (i * i) % 11) % (VOCAB - 2) for i in range(length))


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed,
                              logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, ignore_eos=True)

    def __repr__(self) -> str:
        return (f"Request(len {len(self.prompt)}, max_tokens {self.max_tokens}, T {self.temperature}, "
                f"logprobs {self.logprobs}, prompt_logprobs {self.prompt_logprobs})")


@dataclasses.dataclass(frozen=True)
class Mix:
    tokens_per_block: int
    max_num_tokens: int
    chunked: bool
    reuse: str  # off, on, partial
    host_blocks: int  # the host tier (offload and onboard); 0: none
    overlap: bool
    warm: tuple[Request, ...]  # served one at a time first: the prefix tree holds them
    early: tuple[Request, ...]  # submitted first; the target comes once they are running
    target: Request
    late: tuple[Request, ...]  # submitted with the target

    def llm(self) -> LLM:
        return LLM("tiny-random", batch_invariant=True, max_num_tokens=self.max_num_tokens, max_batch_size=8,
                   max_seq_len=128, enable_chunked_prefill=self.chunked, disable_overlap_scheduler=not self.overlap,
                   kv_cache_config=KvCacheConfig(tokens_per_block=self.tokens_per_block, num_blocks=self.num_blocks,
                                                 enable_block_reuse=self.reuse != "off",
                                                 enable_partial_reuse=self.reuse == "partial",
                                                 host_cache_size=self.host_blocks * self.tokens_per_block * TOKEN_BYTES))

    @property
    def num_blocks(self) -> int:
        """Enough for every request at once, and a tight pool (evictions, host round trips) when the tier is on."""
        requests = [self.target, *self.early, *self.late, *self.warm]
        need = sum(-(-(len(r.prompt) + r.max_tokens) // self.tokens_per_block) for r in requests)
        return need + 2 if self.host_blocks else 4 * need + 8


@st.composite
def requests(draw, shared_doc: int) -> Request:
    doc = draw(st.sampled_from([shared_doc, shared_doc, 5, 6]))
    head = document(doc, draw(st.integers(0, 40)))
    tail = tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=6)))
    sampled = draw(st.booleans())
    return Request(
        prompt=head + tail or (1,),
        max_tokens=draw(st.integers(1, 6)),
        temperature=0.8 if sampled else 0.0,
        seed=draw(st.integers(0, 2**31)) if sampled else None,
        logprobs=draw(st.sampled_from([None, 0, 2])),
        prompt_logprobs=draw(st.sampled_from([None, None, 1])),  # scoring the prompt claims no cached block
    )


@st.composite
def mixes(draw) -> Mix:
    tpb = draw(st.sampled_from([2, 4, 8, 16]))
    chunked = draw(st.booleans())
    doc = draw(st.integers(0, 3))
    target = draw(requests(doc))
    mates = draw(st.lists(requests(doc), max_size=4))
    warm = tuple(draw(st.lists(requests(doc), max_size=2)))
    split = draw(st.integers(0, len(mates)))
    longest = max(len(r.prompt) + r.max_tokens for r in [target, *mates, *warm])
    budget = draw(st.integers(tpb, 6 * tpb)) if chunked else draw(st.integers(longest, longest + 32))
    return Mix(
        tokens_per_block=tpb,
        max_num_tokens=budget,
        chunked=chunked,
        reuse=draw(st.sampled_from(["off", "on", "partial"])),
        host_blocks=draw(st.sampled_from([0, 0, 4, 16])),
        overlap=draw(st.booleans()),
        warm=warm,
        early=tuple(mates[:split]),
        target=target,
        late=tuple(mates[split:]),
    )


def outcome(output) -> tuple:
    """Everything that must be the same bits: tokens, their logprobs, the prompt's."""
    completion = output.outputs[0]
    return tuple(completion.token_ids), completion.logprobs, output.prompt_logprobs


@pytest.fixture(scope="module")
def alone():
    """The target alone on an LLM with none of the mix's machinery: one chunk, no reuse, no overlap."""
    with LLM("tiny-random", batch_invariant=True, max_num_tokens=256, max_seq_len=128,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=64, enable_block_reuse=False)) as llm:
        cache: dict[Request, tuple] = {}

        def run(request: Request) -> tuple:
            if request not in cache:
                cache[request] = outcome(llm.generate(list(request.prompt), request.params()))
            return cache[request]

        yield run


def serve(mix: Mix) -> tuple:
    with mix.llm() as llm:
        for request in mix.warm:
            llm.generate(list(request.prompt), request.params())
        early = [llm.generate_async(list(r.prompt), r.params()) for r in mix.early]
        if early:  # let them start: the target then joins batches with prefills or decodes in flight
            deadline = time.monotonic() + RESULT_TIMEOUT_S
            while not llm.iteration_stats and time.monotonic() < deadline:
                time.sleep(0.001)
        target = llm.generate_async(list(mix.target.prompt), mix.target.params())
        late = [llm.generate_async(list(r.prompt), r.params()) for r in mix.late]
        for handle in [*early, *late]:
            handle.result(timeout=RESULT_TIMEOUT_S)
        got = outcome(target.result(timeout=RESULT_TIMEOUT_S))
        stats = llm.iteration_stats
    if any(s.reuse_claimed_tokens for s in stats):
        event("reuse claimed")
    if max(s.num_context_requests + s.num_generation_requests for s in stats) > 1:
        event("batched")
    return got


@settings(max_examples=examples(1 / 15, 10))
@given(mix=mixes())
def test_a_request_gets_its_alone_bits_in_any_batch_mix(alone, mix):
    note(repr(mix))
    want = alone(mix.target)
    got = serve(mix)
    assert got[0] == want[0], f"tokens {got[0]} != alone {want[0]}"
    assert got[1] == want[1], "sampled logprobs differ from alone"
    assert got[2] == want[2], "prompt logprobs differ from alone"


def test_batch_invariant_is_an_option_refused_off_the_cpu_and_on_several_ranks():
    assert LlmArgs(batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant runs on one rank"):
        LlmArgs(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batch_invariant runs on the CPU only"):
        LlmArgs(batch_invariant=True, device="cuda")
    with pytest.raises(ValueError, match="batch_invariant runs on one rank"):
        LLM("tiny-random", batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        LLM("tiny-random", batch_invariant=1)
    with LLM("tiny-random", batch_invariant=True, kv_cache_config=KvCacheConfig(num_blocks=8)) as llm:
        assert llm.model_config.batch_invariant and "batch-invariant" in llm.describe()
