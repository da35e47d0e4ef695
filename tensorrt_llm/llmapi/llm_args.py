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
from tensorrt_llm._torch.pyexecutor.engine.simulated import SimulatedEngineConfig
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


#: ``KVEventsConfig.publisher`` values (vLLM's): ``null`` keeps the events for ``LLM.get_kv_cache_events``.
KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """KV cache events published for a router, in vLLM's wire format (vLLM's ``kv_events_config``
    and field names; ``llmapi/kv_event_publisher.py``, ``docs/scale-out.md``).

    With ``enable_kv_cache_events`` and ``publisher: zmq``, a thread of its own sends every
    batch of the pool's events on a ZMQ PUB socket at ``endpoint`` (bound when the address has
    a ``*``, ``::``, or is ``ipc://`` / ``inproc://``; connected otherwise), as multipart
    ``[topic, 8-byte big-endian sequence number, msgpack(KVEventBatch)]``, and keeps the last
    ``buffer_steps`` batches for a ROUTER socket at ``replay_endpoint`` that resends them from a
    sequence number a subscriber asks for. The pool's buffer (``kv_cache_config.
    event_buffer_max_size``, or ``max_queue_size`` when that is 0) feeds the thread, which
    then is its only reader: ``LLM.get_kv_cache_events`` is refused. ``publisher: null`` keeps
    the events for ``LLM.get_kv_cache_events`` instead.
    """

    enable_kv_cache_events: bool = False  # the pool emits KV cache events (stored, removed, cleared)
    # zmq: publish them on endpoint; null: keep them for LLM.get_kv_cache_events (default: zmq when enabled)
    publisher: str | None = field(default=None, metadata={"choices": KV_EVENT_PUBLISHERS})
    endpoint: str = "tcp://*:5557"  # the ZMQ PUB socket's address (bound with * or ::, else connected)
    replay_endpoint: str | None = None  # a ROUTER socket resending kept batches from a sequence number; None: none
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: messages queued per subscriber before ZMQ drops
    # events waiting for the publisher when kv_cache_config.event_buffer_max_size is 0
    max_queue_size: int = 100_000
    topic: str = ""  # the topic frame of every message (subscribers filter on it)

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(map(repr, KV_EVENT_PUBLISHERS))},"
                             f" got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ address such as 'tcp://*:5557', got {self.endpoint!r}")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str) or "://" not in self.replay_endpoint):
            raise ValueError(f"kv_events_config.replay_endpoint must be a ZMQ address or None, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Whether a ZMQ publisher runs (enabled, publisher zmq)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


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
    # no model runs: the simulated engine (bookkeeping KV cache, synthetic tokens), each forward
    # sleeping what this cost model says; the model's config and tokenizer are still read. None: off
    simulated_engine: SimulatedEngineConfig | None = None
    # KV cache events for a router, in vLLM's wire format on a ZMQ socket; None: none published
    kv_events_config: KVEventsConfig | None = None
    # the batch-invariant kernels: a request's tokens and logprobs are the same bits whatever else
    # is in the batch, however its prompt is chunked or reused (vLLM's VLLM_BATCH_INVARIANT;
    # docs/determinism.md). CPU, one rank; slower (the docs give the cost)
    batch_invariant: bool = False
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
