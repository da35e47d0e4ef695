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
QUANTIZATIONS = ("gguf", "none")
DERIVED_DEFAULTS = {
    "dtype": "the model's on the CPU, bfloat16 on a GPU",
    "quantization": "gguf for a GGUF file with quantized weights on the CPU when no dtype is given, else none",
    "max_seq_len": "the model's max_position_embeddings, lowered to what the KV pool holds for one sequence",
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class LlmArgs:
    """Every ``LLM(...)`` keyword, validated at construction (``LLM`` resolves the device)."""

    # The weights' and activations' dtype (float32, float16, bfloat16, ...).
    dtype: str | None = None
    seed: int | None = None  # random-weight models: the seed the weights are drawn from
    # a GGUF file's quantized weights (vLLM's name): gguf keeps them as stored (Q4_0, Q4_1, Q8_0 blocks,
    # torch's int4 kernel, bfloat16 activations; CPU only), none dequantizes them to dtype
    quantization: str | None = field(default=None, metadata={"choices": QUANTIZATIONS})
    # auto: the GPU when torch sees one, else the CPU; also cuda:N.
    device: str = field(default="auto", metadata={"metavar": "{" + ",".join(DEVICES) + "}"})
    tensor_parallel_size: int = 1  # tensor parallelism over N rank processes (CPU, gloo on loopback)
    enable_attention_dp: bool = False  # with several ranks: each serves its own requests on a full replica
    # with several ranks: before each forward the ranks compare a digest of their decisions (the
    # batch, chunks, re-check); a divergence fails the group naming what differs (one exchange a step)
    check_decisions: bool = False
    executor: ExecutorConfig = nested(ExecutorConfig, inline=True)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))} (or unset: the"
                             f" checkpoint's own), got {self.quantization!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))} (or 'cuda:N'), got {self.device!r}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
