"""``Drafter``: which requests speculate, and their draft tokens before each schedule.

Speculative decoding in one iteration (``ExecutorConfig.speculative_config``)::

    drafter.prepare_draft_tokens(active)   each speculative generation request gets up to
                                            max_draft_len drafts (n-gram lookup in its tokens)
    schedule / re-check / allocate          charged forward_cost: 1 + drafts
                                            (a first-draft step: 1 + max_draft_len)
    forward                                 the target's greedy pick at the newest token and
                                            after each draft, in one pass
    sample                                  accept_greedy: the accepted drafts + one token
    append                                  stop_rule.finish cuts the run at a stop token or
                                            the length limit, like any delivery
    update_resources                        KV valid up to the accepted tokens; blocks holding
                                            only rejected drafts released (SequenceBlocks._trim)

A request speculates when the executor admits it greedy with one beam and its draft slots fit
``max_seq_len`` (``max_total_len + max_draft_len``) and the executor's other limits (validated
again with them; :meth:`Drafter.withdraw` otherwise): the drafter then sets its
``max_draft_len`` and marks its first generation step a first draft. Every other request runs
exactly as without speculation. Greedy verification makes the outputs equal to those without
drafts, token for token: only the number of forwards changes.

Under the overlap scheduler the drafter runs while the request's previous forward is in flight:
its tokens end with placeholders for what that forward will accept (one per draft it verifies,
then one for the token after them), laid out as if every draft were accepted. The next drafts
continue that layout: :meth:`Drafter.propose` guesses the tokens after ``request.tokens``
placeholders included (the n-gram drafter looks them up in the known tokens followed by the
drafts in flight, and skips its guess of the in-flight token). If the forward rejects some, the
engine moves the next forward back over them; the drafts may then be wrong, never the output.

Speculation that does not pay stops (``SpeculativeConfig``): above ``max_concurrency``
generation requests an iteration gets no drafts, and once the acceptance over the last
``acceptance_rate_window_size`` iterations with drafts is below ``acceptance_rate_threshold``
(the executor reports each iteration's drafts to :meth:`Drafter.observe`) the drafter withdraws
every request and admits no more.
"""

from __future__ import annotations

import abc
import collections
import logging
from typing import Iterable

import numpy as np

from tensorrt_llm._torch.pyexecutor.config import DecodingType, SpeculativeConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState, num_in_flight_tokens
from tensorrt_llm._torch.speculative.ngram import propose_ngram_drafts

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT

logger = logging.getLogger(__name__)


class Drafter(abc.ABC):
    """Decides which requests speculate and proposes their drafts; :meth:`propose` is the guess.

    Any proposal is safe: verification keeps only what the target model would have generated.
    """

    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.enabled = True  # False for good once the acceptance fell below the threshold
        # (verified, accepted) of the last iterations that verified drafts
        self._window: collections.deque[tuple[int, int]] = collections.deque(maxlen=config.acceptance_rate_window_size)

    def observe(self, verified: int, accepted: int) -> None:
        """One iteration's drafts: ``verified`` draft tokens checked, ``accepted`` of them kept.
        With ``acceptance_rate_threshold``, a full window of iterations with drafts whose
        acceptance is below it turns speculation off for good (from the next iteration)."""
        threshold = self.config.acceptance_rate_threshold
        if threshold is None or not verified or not self.enabled:
            return
        self._window.append((verified, accepted))
        if len(self._window) < self._window.maxlen:
            return
        total, kept = map(sum, zip(*self._window))
        if kept < threshold * total:
            self.enabled = False
            logger.info("speculation off: acceptance %.3f over the last %d iterations with drafts is below %s",
                        kept / total, len(self._window), threshold)

    def admit(self, request: LlmRequest) -> bool:
        """Make ``request`` speculative if it can be: greedy, one beam, no drafts of its own,
        and room for its draft slots within ``max_seq_len``. Returns whether it is.

        Verification compares each draft with the engine's unmasked greedy pick at its row, so a
        request whose next token needs its logits on the host (a grammar mask, penalties that
        depend on the tokens before, logprobs: ``LlmRequest.needs_host_logits``) does not
        speculate; letting it would take that processing on every draft row
        (``ForwardOutput.draft_targets``) before ``accept_greedy``."""
        max_draft_len = self.config.max_draft_len
        eligible = (
            self.enabled
            and request.sampling_config.is_greedy
            and not request.needs_host_logits
            and request.beam_width == 1
            and not request.max_draft_len
            and not request.py_draft_tokens
            and request.max_total_len + max_draft_len <= self.max_seq_len
        )
        if eligible:
            request.max_draft_len = max_draft_len
            request.is_first_draft = True  # its first generation step runs 1 + max_draft_len positions
        return eligible

    def withdraw(self, request: LlmRequest) -> None:
        """Undo :meth:`admit`: from its next schedule on the request runs without speculation,
        e.g. when its draft slots would not fit the executor's limits, or speculation stopped.
        Between iterations it holds KV for its tokens only (rejected drafts' slots were trimmed),
        and its reserve to completion stays as allocated (counted with the draft slots)."""
        request.max_draft_len = 0
        request.is_first_draft = False
        request.py_draft_tokens = []

    def prepare_draft_tokens(self, requests: Iterable[LlmRequest]) -> None:
        """Propose each speculative request's drafts for its next step, from its tokens as they
        are now (placeholders of a forward in flight included: module docstring).

        A request in its prompt gets none (its chunks are the scheduler's to size), and no
        request gets more drafts than the tokens it may still generate after the one its next
        step yields anyway: a draft past ``max_total_len`` could only be thrown away. Above
        ``max_concurrency`` generation requests none gets drafts (a first draft due now still runs
        padded to ``1 + max_draft_len``: only the executor clears it, once it ran); the requests
        stay speculative, so they still run without overlap. Once speculation is off, every
        request is withdrawn.
        """
        requests = list(requests)
        speculative = [request for request in requests if request.max_draft_len]
        if not self.enabled:
            for request in speculative:
                self.withdraw(request)
            return
        limit = self.config.max_concurrency
        skip_drafts_this_iteration = limit is not None and sum(r.state is not _CONTEXT_INIT for r in requests) > limit
        for request in speculative:
            if request.state is _CONTEXT_INIT:
                request.py_draft_tokens = []
                continue
            if skip_drafts_this_iteration:  # a first draft due now still runs padded, as it is charged
                request.py_draft_tokens = []
                continue
            room = min(request.max_draft_len, request.max_total_len - len(request.tokens) - 1)
            if room < 1:
                request.py_draft_tokens = []
                continue
            request.py_draft_tokens = self.propose(request, room)[:room]

    @abc.abstractmethod
    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` guesses of the tokens that follow ``request.tokens`` (which may end
        with placeholders of a forward in flight: they stand for its drafts, then the token after
        them, still ``request.py_draft_tokens`` and unknown)."""


class NGramDrafter(Drafter):
    """Prompt lookup (``DecodingType.NGRAM``): see ``speculative.ngram``."""

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        tokens = np.frombuffer(request.tokens, dtype=np.int64)  # a view: gone before the tokens grow
        pending = num_in_flight_tokens(request.tokens)
        if not pending:
            return propose_ngram_drafts(tokens, max_drafts, self.config.max_matching_ngram_size)
        # In flight: the known tokens, then the drafts the forward verifies (assumed accepted); the
        # lookup's first token guesses the one that forward picks after them, which is not a draft.
        context = np.concatenate((tokens[: len(tokens) - pending], np.asarray(request.py_draft_tokens[: pending - 1],
                                                                               dtype=np.int64)))
        return propose_ngram_drafts(context, max_drafts + 1, self.config.max_matching_ngram_size)[1:]


def drafter_for(config: SpeculativeConfig, max_seq_len: int) -> Drafter:
    """The drafter of ``config.decoding_type``."""
    if config.decoding_type is DecodingType.NGRAM:
        return NGramDrafter(config, max_seq_len)
    raise ValueError(f"no drafter for decoding_type {config.decoding_type.value!r}")
