"""The replay's built-in default scenario: multi-turn chat traffic that makes the overshoot fire.

Modelled on the upstream reproduction of the over-admission bug (``max_num_tokens=4096``,
chunked prefill, block reuse + partial reuse + host offload, about 7 requests/s). Public
long-prompt traces fire the overshoot about once per thousand requests; this scenario is
built so that both docs/design.md §1 mechanisms fire within a few hundred requests. What each
feature is for:

- **Multi-turn conversations** (turn ``k+1``'s prompt = turn ``k``'s prompt + a synthetic
  answer of turn ``k``'s ``output_len`` + a new user message). A follow-up turn is *mostly
  cached*: admission charges only its uncached tail. That is the request the *evicted
  discount* mechanism needs, and its memory-side twin (the capacity scheduler also credits
  that reuse when counting blocks).
- **Interleaving with think times** (``min_think_time_s + Exp(think_time_s)`` between a
  turn and the conversation's next one, while tens of other conversations take the arrival
  slots in between): the reused prefix has gone cold in LRU order (or out to the host tier)
  by the time it is reused, so it is first in line for eviction -> *evicted discount*
  (and host *onboarding* evicting, with offload on).
- **Long first messages of new conversations** (log-uniform, up to
  ``first_message_len_max``) arriving between reuses: first chunks that allocate fresh
  blocks for thousands of tokens in the same batch as a discounted follow-up -> the
  allocation that evicts the counted prefix (*evicted discount*).
- **Shared system prompts** (``num_system_prompts`` prompts of 1-2k tokens, each shared by
  a group of conversations): cross-conversation partial prefix reuse, so first turns are
  discounted too (*evicted discount*; partial reuse of the last shared block).
- **Poisson arrivals at ``qps``**: bursts put several first chunks in one batch (the
  eviction must come from an *earlier* request of the same batch).
- **Regenerates** (about ``regenerate_probability`` of turns are re-submitted verbatim a
  few seconds later, and such a turn's user message is padded so its prompt length is a
  multiple of ``tokens_per_block``): a fully cached, block-aligned prompt is charged 1
  token but recomputes its last block -> *whole-prompt hit* (overshoot up to
  ``tokens_per_block - 1`` without partial reuse).
- **Short-to-moderate outputs** (lognormal, clipped to ``[output_len_min,
  output_len_max]``): requests finish and free blocks steadily, so the pool churns and
  cached prefixes are evicted rather than the run stalling on long decodes.

Prompt lengths are capped at ``max_prompt_len``; a conversation whose next turn would not
fit ends. Same config -> identical trace and tokens.

Why these defaults (tuned with the replay, ``benchmarks/replay/cli.py``): with partial reuse on,
a whole-prompt hit only overshoots when the repeat's last block has gone to the host tier
and the batch is full to within a block, and an evicted discount only when a follow-up's
history is being evicted at the very moment an earlier first chunk of its batch allocates.
First messages up to 8k tokens keep the 4096-token budget saturated more of the time,
11% regenerates give more whole-prompt hits, and think times of 1 s + Exp(3 s) bring more
follow-ups back while their history is at the eviction front. With the earlier defaults
(first messages up to 4k, think 2 s + Exp(8 s), 8% regenerates) the overshoot fired on
only 3 to 5 seeds in 10 at any pool and host size tried.

Arrivals are a Poisson process at ``qps`` (``traces.poisson_arrivals``: conditioned on its
count, so the mean rate is exactly ``qps``; the i-th request arrives at the i-th point); each arrival slot goes to the conversation that has waited longest since becoming
ready (its think time over), or starts a new conversation when none is ready.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import numpy as np

from benchmarks.replay.traces import SyntheticRequest, Trace, check_vocab_size, poisson_arrivals, segment_key

__all__ = ["ScenarioConfig", "ScenarioRequest", "default_scenario"]

_TAG_SYSTEM, _TAG_USER, _TAG_ANSWER = 0x5C01, 0x5C02, 0x5C03


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    """Knobs of :func:`default_scenario`. Lengths are in tokens, times in seconds."""

    num_requests: int = 400
    qps: float = 7.0  # Poisson arrival rate, requests/s
    seed: int = 0
    vocab_size: int = 32000
    tokens_per_block: int = 32  # regenerated prompts are padded to a multiple of this
    num_system_prompts: int = 4  # distinct system prompts; each conversation picks one uniformly
    system_prompt_len_min: int = 1024
    system_prompt_len_max: int = 2048
    max_turns: int = 8  # planned turns per conversation, uniform in [1, max_turns]
    first_message_len_min: int = 128  # first user message, log-uniform
    first_message_len_max: int = 8192
    followup_len_min: int = 16  # later user messages, log-uniform
    followup_len_max: int = 1024
    max_prompt_len: int = 12288  # a conversation ends when its next turn would not fit
    min_think_time_s: float = 1.0  # gap to the next turn = min_think_time_s + Exp(mean think_time_s)
    think_time_s: float = 3.0
    regenerate_probability: float = 0.11  # chance a turn is re-submitted verbatim (once)
    regenerate_delay_s: float = 3.0  # mean of the exponential gap before the re-submission
    output_len_min: int = 16  # output lengths: lognormal around the median, clipped
    output_len_max: int = 300
    output_len_median: int = 64
    output_len_sigma: float = 0.8

    def __post_init__(self) -> None:
        check_vocab_size(self.vocab_size)
        positive_ints = ("num_requests", "tokens_per_block", "num_system_prompts", "system_prompt_len_min", "max_turns",
                         "first_message_len_min", "followup_len_min", "output_len_min")
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for lo, hi in (("system_prompt_len_min", "system_prompt_len_max"), ("first_message_len_min", "first_message_len_max"),
                       ("followup_len_min", "followup_len_max"), ("output_len_min", "output_len_max")):
            if getattr(self, hi) < getattr(self, lo):
                raise ValueError(f"{hi} must be >= {lo}")
        if not self.output_len_min <= self.output_len_median <= self.output_len_max:
            raise ValueError("output_len_median must lie in [output_len_min, output_len_max]")
        if self.system_prompt_len_max + self.first_message_len_min > self.max_prompt_len:
            raise ValueError("max_prompt_len must fit system_prompt_len_max + first_message_len_min")
        if self.tokens_per_block > self.max_prompt_len:
            raise ValueError("tokens_per_block must be <= max_prompt_len")
        if not (math.isfinite(self.qps) and self.qps > 0):
            raise ValueError(f"qps must be finite and > 0, got {self.qps}")
        for name in ("min_think_time_s", "think_time_s", "regenerate_delay_s", "output_len_sigma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not 0.0 <= self.regenerate_probability <= 1.0:
            raise ValueError("regenerate_probability must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class ScenarioRequest(SyntheticRequest):
    """A scenario request; the extra fields describe it, tokens still come only from
    :meth:`prompt_token_ids`."""

    conversation_id: int
    turn: int  # 1-based turn within the conversation (a regenerate repeats its turn number)
    regenerate_of: int | None  # request_index of the request re-submitted verbatim, if any


@dataclass(slots=True)
class _Conversation:
    conversation_id: int
    system_prompt: tuple[int, int]  # segment (key, length)
    planned_turns: int
    turn: int = 0
    prompt: tuple[tuple[int, int], ...] = ()  # segments of the latest turn's prompt
    prompt_len: int = 0
    answer: tuple[int, int] | None = None  # segment of the latest request's synthetic answer
    regenerate_of: int | None = None  # request to re-submit at the next event, if any


def default_scenario(config: ScenarioConfig = ScenarioConfig()) -> Trace:
    """Build the scenario trace (format ``"scenario"``); deterministic in ``config``."""
    c = config
    rng = np.random.default_rng(c.seed)

    def log_uniform(lo: int, hi: int) -> int:
        return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))

    def output_len() -> int:
        value = round(c.output_len_median * math.exp(c.output_len_sigma * rng.standard_normal()))
        return min(c.output_len_max, max(c.output_len_min, value))

    arrivals = poisson_arrivals(c.num_requests, c.qps, rng)
    system_prompts = [
        (segment_key(_TAG_SYSTEM, c.seed, s), int(rng.integers(c.system_prompt_len_min, c.system_prompt_len_max + 1)))
        for s in range(c.num_system_prompts)
    ]

    conversations: list[_Conversation] = []
    ready: list[tuple[float, int]] = []  # (ready_at, conversation_id): heap of waiting conversations
    requests: list[ScenarioRequest] = []
    for index, now in enumerate(arrivals):
        if ready and ready[0][0] <= now:
            conv = conversations[heapq.heappop(ready)[1]]
        else:
            conv = _Conversation(
                len(conversations), system_prompts[int(rng.integers(c.num_system_prompts))], int(rng.integers(1, c.max_turns + 1))
            )
            conversations.append(conv)

        regenerate_of = conv.regenerate_of
        if regenerate_of is not None:  # the same prompt again, verbatim
            conv.regenerate_of = None
        else:
            if conv.turn == 0:
                base, base_len = (conv.system_prompt,), conv.system_prompt[1]
                user_len = min(log_uniform(c.first_message_len_min, c.first_message_len_max), c.max_prompt_len - base_len)
            else:
                assert conv.answer is not None
                base, base_len = conv.prompt + (conv.answer,), conv.prompt_len + conv.answer[1]
                user_len = min(log_uniform(c.followup_len_min, c.followup_len_max), c.max_prompt_len - base_len)
            if rng.random() < c.regenerate_probability:
                # Pad (or trim) the user message so the prompt is block-aligned: a whole-prompt hit.
                short = (base_len + user_len) % c.tokens_per_block
                if short == 0:
                    conv.regenerate_of = index
                elif base_len + user_len + c.tokens_per_block - short <= c.max_prompt_len:
                    user_len += c.tokens_per_block - short
                    conv.regenerate_of = index
                elif user_len > short:
                    user_len -= short
                    conv.regenerate_of = index
            conv.turn += 1
            user = (segment_key(_TAG_USER, c.seed, conv.conversation_id, conv.turn), user_len)
            conv.prompt, conv.prompt_len = base + (user,), base_len + user_len

        out_len = output_len()
        conv.answer = (segment_key(_TAG_ANSWER, c.seed, index), out_len)
        requests.append(
            ScenarioRequest(index, now, conv.prompt_len, out_len, conv.prompt, c.vocab_size, conv.conversation_id, conv.turn, regenerate_of)
        )

        if conv.regenerate_of is not None:
            heapq.heappush(ready, (now + rng.exponential(c.regenerate_delay_s), conv.conversation_id))
        elif conv.turn < conv.planned_turns and conv.prompt_len + out_len + c.followup_len_min <= c.max_prompt_len:
            heapq.heappush(ready, (now + c.min_think_time_s + rng.exponential(c.think_time_s), conv.conversation_id))

    return Trace("default-scenario", "scenario", tuple(requests), _notes(c, requests, len(conversations)))


def _notes(config: ScenarioConfig, requests: list[ScenarioRequest], num_conversations: int) -> tuple[str, ...]:
    params = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))
    prompt_lens = [r.input_len for r in requests]
    output_lens = [r.output_len for r in requests]
    regenerates = sum(r.regenerate_of is not None for r in requests)
    followups = sum(r.turn > 1 and r.regenerate_of is None for r in requests)
    span = requests[-1].arrival_s
    rate = (len(requests) - 1) / span if span > 0 else float("inf")
    realised = (
        f"scenario realised: {num_conversations} conversations, {followups} follow-up turns, "
        f"{regenerates} block-aligned exact re-submissions, prompt lengths {min(prompt_lens)}-{max(prompt_lens)} "
        f"(mean {sum(prompt_lens) / len(prompt_lens):.0f}), output lengths {min(output_lens)}-{max(output_lens)} "
        f"(mean {sum(output_lens) / len(output_lens):.0f}), {span:.1f} s of arrivals ({rate:.2f} req/s)"
    )
    return (f"default scenario: {params}", realised)
