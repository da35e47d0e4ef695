"""``Drafter``: which requests speculate, and their draft tokens before each schedule.

Speculative decoding in one iteration (``ExecutorConfig.speculative_config``)::

    drafter.prepare_draft_tokens(active)   each speculative generation request gets up to
                                            max_draft_len drafts (n-gram lookup in its tokens;
                                            in flight: slots the engine fills at launch)
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
its tokens end with placeholders for what that forward will produce (one per draft it verifies,
then one for the token after them). Drafts proposed from them would continue drafts nobody has
checked yet, and after one wrong one every later draft is wrong too. So a request in flight gets
no drafts from the host: where the engine drafts itself (``engine_proposes``: it was given the
drafter's :attr:`Drafter.proposer`) it gets ``room`` draft *slots*, placeholders that the engine
fills when the forward is launched, from the tokens the previous forward really produced
(``speculative.device_drafting``); the forward is charged and laid out with them (``1 + room``
positions), and the drafts it verified come back with its tokens. Elsewhere it runs this step
without drafts. Drafts are only ever proposed from tokens the model produced.

Speculation that does not pay stops (``SpeculativeConfig``): above ``max_concurrency`` active
requests (those still in their prompt included, as upstream counts them) an iteration gets no
drafts and its speculative requests run exactly as plain ones, and once the acceptance over the last
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
from tensorrt_llm._torch.pyexecutor.llm_request import IN_FLIGHT_TOKEN_ID, LlmRequest, LlmRequestState
from tensorrt_llm._torch.speculative.ngram import NGramProposer
from tensorrt_llm._torch.speculative.proposer import DraftProposer

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT

logger = logging.getLogger(__name__)


class Drafter(abc.ABC):
    """Decides which requests speculate and proposes their drafts; :meth:`propose` is the guess
    on the host, :attr:`proposer` (None: none) the same guess for an engine that drafts requests
    whose previous forward is in flight.

    Any proposal is safe: verification keeps only what the target model would have generated.
    """

    #: what an engine drafts with while a request's previous forward is in flight (module docstring)
    proposer: DraftProposer | None = None

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

    def prepare_draft_tokens(self, requests: Iterable[LlmRequest], *, engine_proposes: bool = False) -> None:
        """Decide each speculative request's drafts for its next step.

        A request in its prompt gets none (its chunks are the scheduler's to size), and no
        request gets more drafts than the tokens it may still generate after the one its next
        step yields anyway (``room``): a draft past ``max_total_len`` could only be thrown away.
        A request whose tokens are all known gets :meth:`propose`'s drafts. One whose previous
        forward is in flight gets ``room`` slots for the engine to fill where ``engine_proposes``
        (the engine drafts with :attr:`proposer`), else none (module docstring). Above
        ``max_concurrency`` active requests (``requests``: every request the executor holds, those
        in their prompt included) none gets drafts and each runs exactly as a plain request does:
        one position, charged one, no draft slots (a first draft due now is dropped, not padded to
        ``1 + max_draft_len``); the requests stay speculative. Counting only generation requests
        drafted the first requests of a burst while the rest were still in their prompts: a burst
        far above the limit ran first-draft and drafting steps in its prefill iterations. Once
        speculation is off, every request is withdrawn.
        """
        requests = list(requests)
        speculative = [request for request in requests if request.max_draft_len]
        if not self.enabled:
            for request in speculative:
                self.withdraw(request)
            return
        limit = self.config.max_concurrency
        skip_drafts_this_iteration = limit is not None and len(requests) > limit
        for request in speculative:
            if request.state is _CONTEXT_INIT:
                request.py_draft_tokens = []
                continue
            if skip_drafts_this_iteration:  # a plain step: no drafts, no slots, no first-draft padding
                request.py_draft_tokens = []
                request.is_first_draft = False
                continue
            tokens = request.tokens
            room = min(request.max_draft_len, request.max_total_len - len(tokens) - 1)
            if room < 1:
                request.py_draft_tokens = []
            elif tokens[-1] == IN_FLIGHT_TOKEN_ID:  # its previous forward is in flight
                request.py_draft_tokens = [IN_FLIGHT_TOKEN_ID] * room if engine_proposes else []
            else:
                request.py_draft_tokens = self.propose(request, room)[:room]

    @abc.abstractmethod
    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` guesses of the tokens that follow ``request.tokens`` (all known:
        no forward of the request is in flight)."""


class NGramDrafter(Drafter):
    """Prompt lookup (``DecodingType.NGRAM``): see ``speculative.ngram``."""

    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        super().__init__(config, max_seq_len)
        self.proposer = NGramProposer(config.max_draft_len, config.max_matching_ngram_size)

    def propose(self, request: LlmRequest, max_drafts: int) -> list[int]:
        tokens = np.frombuffer(request.tokens, dtype=np.int64)  # a view: gone before the tokens grow
        return self.proposer.propose(tokens, max_drafts)


def drafter_for(config: SpeculativeConfig, max_seq_len: int) -> Drafter:
    """The drafter of ``config.decoding_type``."""
    if config.decoding_type is DecodingType.NGRAM:
        return NGramDrafter(config, max_seq_len)
    raise ValueError(f"no drafter for decoding_type {config.decoding_type.value!r}")
