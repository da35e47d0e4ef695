"""``LLM(...)``'s arguments, described once (upstream's ``llm_args``).

``LlmArgs``'s fields are the LLM's own keywords, and its inlined ``executor`` field stands for
``ExecutorConfig``'s fields, which ``LLM(...)`` takes as keywords at the same level. The
options file of ``trtllm-serve`` (its keys), its flags and the checks on both are generated
from this one description (``config_fields``); nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig
from tensorrt_llm.llmapi.config_fields import nested

DEVICES = ("auto", "cuda", "cpu")

#: Keywords whose default ``LLM(...)`` derives from the model, the device or the KV pool when they
#: are not given, in the words ``trtllm-serve --help`` shows instead of the field's own default
#: (``LLM`` applies each where it builds the executor; a test checks every other flag's shown
#: default against the value an ``LLM`` built without it uses).
DERIVED_DEFAULTS = {
    "dtype": "the model's on the CPU, bfloat16 on a GPU",
    "max_seq_len": "the model's max_position_embeddings, lowered to what the KV pool holds for one sequence",
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class LlmArgs:
    """Every ``LLM(...)`` keyword, validated at construction (``LLM`` resolves the device)."""

    # The weights' and activations' dtype (float32, float16, bfloat16, ...).
    dtype: str | None = None
    seed: int | None = None  # random-weight models: the seed the weights are drawn from
    # auto: the GPU when torch sees one, else the CPU; also cuda:N.
    device: str = field(default="auto", metadata={"metavar": "{" + ",".join(DEVICES) + "}"})
    tensor_parallel_size: int = 1  # tensor parallelism over N rank processes (CPU, gloo on loopback)
    enable_attention_dp: bool = False  # with several ranks: each serves its own requests on a full replica
    # with several ranks: before each forward the ranks compare a digest of their decisions (the
    # batch, chunks, re-check); a divergence fails the group naming what differs (one exchange a step)
    check_decisions: bool = False
    # the batch-invariant kernels: a request's tokens and logprobs are the same bits whatever else
    # is in the batch, however its prompt is chunked or reused (vLLM's VLLM_BATCH_INVARIANT;
    # docs/determinism.md). CPU, one rank; slower (the docs give the cost)
    batch_invariant: bool = False
    executor: ExecutorConfig = nested(ExecutorConfig, inline=True)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))} (or 'cuda:N'), got {self.device!r}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if self.batch_invariant:
            check_batch_invariant(self.device, size)


def check_batch_invariant(device: str, tensor_parallel_size: int) -> None:
    """Raise ValueError unless ``batch_invariant`` can run with ``device`` (a name; ``auto`` is
    decided where the LLM resolves it) on ``tensor_parallel_size`` ranks: the CPU, one rank."""
    if tensor_parallel_size > 1:
        raise ValueError(f"batch_invariant runs on one rank, got tensor_parallel_size={tensor_parallel_size}: the "
                         "ranks' all-reduce sums in an order set by the batch (docs/determinism.md)")
    if device.startswith("cuda"):
        raise ValueError(f"batch_invariant runs on the CPU only, got device={device!r}: the CUDA kernels' reductions "
                         "depend on the batch (docs/determinism.md)")
