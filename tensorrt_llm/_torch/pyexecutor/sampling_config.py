"""What a request asks of sampling: :class:`SamplingConfig` (validated when it is made), its limits,
the grammar a guided request holds (:class:`CompiledGrammar`), and :class:`TokenLogprob`, what
the sampler reports per token.

Values only: a request (``llm_request``) holds these, the sampler (``sampling/``) reads them, and
nothing here imports either. ``llm_request`` re-exports every name, so that older imports work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from tensorrt_llm._torch.pyexecutor.beam_state import EARLY_STOP

#: Below this temperature sampling is greedy, as vLLM's ``_SAMPLING_EPS`` made it (newer vLLM raises
#: 0 < t < 0.01 to 0.01 instead): dividing logits by a temperature this small only sharpens the
#: distribution onto its argmax. The sampler stays finite below it too (see ``TorchSampler``).
GREEDY_BELOW_TEMPERATURE = 1e-5
#: Seeds are unsigned 64-bit, as upstream's ``random_seed``: [0, SEED_LIMIT).
SEED_LIMIT = 2**64


#: Most alternatives a logprobs answer lists per position (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Per-request sampling settings; greedy when ``temperature < GREEDY_BELOW_TEMPERATURE`` (0
    included) or ``top_k == 1``. Raises ValueError for any setting the sampler cannot honour, so a
    request that holds one is refused before it is queued.

    Penalties (applied to the logits before temperature, in this order; see ``logits_processors``):
    ``repetition_penalty`` (> 0, 1 = off) divides the positive and multiplies the negative logits
    of every id in the prompt or the output; ``frequency_penalty`` and ``presence_penalty`` (in
    [-2, 2], 0 = off) subtract ``count * f + (count > 0) * p`` for ids the output holds.
    ``min_tokens``: the end ids cannot be sampled before that many tokens were generated.
    ``logprobs``: None, or how many alternatives (0..20) to report beside each sampled token's
    log-probability; log-probabilities are the model's (a log-softmax of the raw logits, before
    penalties, temperature and any mask), as vLLM reports them by default. ``prompt_logprobs``:
    the same for each prompt token after the first (the engine then returns the logits of every
    prompt position, and the request claims no cached prefix: every position is computed).

    Beam search (a request with ``beam_width`` > 1; see ``beam_search``): ``length_penalty``
    (finite; 0, the default, scores by cumulative log-probability alone), ``early_stopping`` (0, 1
    the default, 2 = "never": upstream's encoding), ``num_return_sequences`` (how many of the
    beams are returned; None: all of them).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off; keep tokens at least min_p times as likely as the likeliest
    seed: int | None = None  # None: the request id seeds the request's generator
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt position after the first
    length_penalty: float = 0.0
    early_stopping: int = EARLY_STOP
    num_return_sequences: int | None = None
    # Derived (not an argument): greedy with nothing that changes the pick or reads the row, so
    # the pick is the argmax of the raw logits row. Read once per row per step by the engine
    # (``engine.sampling_columns``), hence kept rather than recomputed.
    plain_greedy: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not _is_int(self.early_stopping) or self.early_stopping not in (0, 1, 2):
            raise ValueError(f"early_stopping must be 0, 1 or 2 (never), got {self.early_stopping!r}")
        if self.num_return_sequences is not None and (
                not _is_int(self.num_return_sequences) or self.num_return_sequences < 1):
            raise ValueError(f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}")
        plain = self.is_greedy and self.logprobs is None and not self.min_tokens and not self.has_penalties
        object.__setattr__(self, "plain_greedy", plain)  # frozen: the one write, at construction

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class CompiledGrammar(Protocol):
    """The grammar a guided request's tokens must follow (``LlmRequest.guided_grammar``).

    Written once, by the submitter: ``LLM`` compiles the request's ``GuidedDecodingParams`` into a
    ``sampling.guided_decoder.Grammar`` (the one implementation) before it is queued. Read by the
    sampler alone, which starts one matcher per sample with :meth:`matcher` and keeps it; the
    request only says that it is guided (``needs_host_logits``).
    """

    def matcher(self) -> Any:
        """A fresh matcher at the grammar's start (``sampling.guided_decoder.GrammarMatcher``)."""
        ...


class TokenLogprob(NamedTuple):
    """A sampled token's log-probability and the ``top`` alternatives ((id, logprob), most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
