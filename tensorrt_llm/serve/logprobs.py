"""Log-probabilities in OpenAI's two response shapes.

Chat (``choice.logprobs.content``): one entry per generated token, ``{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}``. Completions (the legacy shape): parallel lists
``tokens``, ``token_logprobs``, ``top_logprobs`` (a ``{token: logprob}`` dict per position) and
``text_offset`` (each token's character offset in the choice's text).

A token's text is its bytes decoded as UTF-8 (a token that holds part of a character shows
U+FFFD, as vLLM shows it); ``bytes`` are the exact bytes. An id the tokenizer has no token for
(a padded vocabulary's extra ids, ``Tokenizer.for_model``) is ``""`` with ``bytes: []``: the
text it adds to the output, so that ``tokens`` still concatenate to the text and ``text_offset``
stays right. A model without a tokenizer names each token ``token_id:N`` (vLLM's convention)
and has no bytes. In the completions shape's ``top_logprobs`` dict, alternatives with the same
text (several padded ids, say) share one key: it keeps the most probable one's log-probability.
"""

from __future__ import annotations

from typing import Sequence

from tensorrt_llm._torch.pyexecutor.sampling_config import TokenLogprob
from tensorrt_llm.serve.openai_protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    """Built once per server: it reads the tokenizer's vocabulary bytes once."""

    def __init__(self, tokenizer) -> None:
        self._bytes: list[bytes] | None = tokenizer.token_bytes() if tokenizer is not None else None
        self._vocab_size = tokenizer.model_vocab_size if tokenizer is not None else 0

    def token(self, token_id: int) -> tuple[str, list[int] | None]:
        """A token's text and bytes (module docstring)."""
        if self._bytes is not None and 0 <= token_id < len(self._bytes):
            raw = self._bytes[token_id]
            return raw.decode("utf-8", errors="replace"), list(raw)
        if self._bytes is not None and 0 <= token_id < self._vocab_size:
            return "", []  # a padded id: it decodes to no text
        return f"token_id:{token_id}", None

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text, raw = self.token(entry.token)
            top = [TopLogprob(token=t, logprob=lp, bytes=b) for t, b, lp in
                   ((*self.token(i), lp) for i, lp in entry.top)]
            content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion(self, entries: Sequence[TokenLogprob], offset: int,
                   prompt: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None
                   ) -> tuple[CompletionLogprobs, int]:
        """The entries from character ``offset`` of the choice's text; returns the offset after
        them. ``prompt`` (echo): the prompt's ids and log-probabilities go first (the first
        prompt token has none: null, as OpenAI answers)."""
        out = CompletionLogprobs()
        leading = [] if prompt is None else list(zip(*prompt))
        for token, entry in [*leading, *((e.token, e) for e in entries)]:
            text, _ = self.token(token)
            out.tokens.append(text)
            out.token_logprobs.append(None if entry is None else entry.logprob)
            out.top_logprobs.append(None if entry is None else self._top(entry))
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """``{text: logprob}`` of the alternatives (most likely first, as ``entry.top``); a text
        that several share keeps the first (the most probable) one's."""
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(self.token(token_id)[0], logprob)
        return top
