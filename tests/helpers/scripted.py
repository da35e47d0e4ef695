"""A scripted model for the tool-calling tests: a logits processor between the forward and the
sampler that pushes each request towards a known text, so a test does not depend on what a
small model would choose.

:class:`ScriptedSampler` wraps an executor's sampler. While a script is set, the row of every
request it samples gets ``+BIAS`` on the script's next token (the token at the request's count
of generated tokens; past the end, the end-of-generation id), and the engine's own pick is
replaced by that token, unless the request's grammar forbids it: the engine sampled the row on
its device with the grammar's mask (``engine.sampling_pass``), so its pick is already what the
masked, biased row's argmax would be when the bias falls on a forbidden id. Everything else is
the real path, so under ``tool_choice: required`` the grammar, not the script, has the last word.
"""

from __future__ import annotations

import contextlib
import threading

BIAS = 1e4


class ScriptedSampler:
    def __init__(self, inner, tokenizer) -> None:
        self._inner = inner
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._script: list[int] | None = None
        self._masks: dict[int, object] = {}  # request id -> the grammar bitmask of its forward in flight

    def token_masks(self, batch):
        masks = self._inner.token_masks(batch)
        self._masks = dict(masks or {})  # a guided request is never in flight twice (it is not overlapped)
        return masks

    def set_script(self, text: str | None) -> None:
        ids = None if text is None else self._tokenizer.encode(text, add_special_tokens=False)
        with self._lock:
            self._script = None if ids is None else ids + [self._tokenizer.eos_token_id]

    def sample_batch(self, requests, output):
        with self._lock:
            script = self._script
        if script is not None:
            for request in requests:
                k = request.num_generated_tokens
                target = script[k] if k < len(script) else script[-1]
                row = output.logits[request.request_id].clone()  # (vocab,); the forward's own is read-only
                row[target] += BIAS
                output.logits[request.request_id] = row
                mask = self._masks.get(request.request_id)
                allowed = mask is None or (int(mask[target // 32]) >> (target % 32)) & 1
                if allowed and output.greedy_tokens is not None and request.request_id in output.greedy_tokens:
                    output.greedy_tokens[request.request_id] = target
        return self._inner.sample_batch(requests, output)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def install(llm) -> ScriptedSampler:
    """Wrap ``llm``'s executor's sampler (one rank) and return the wrapper."""
    executor = llm.executor
    scripted = ScriptedSampler(executor.sampler, llm.tokenizer)
    executor.sampler = scripted
    return scripted


@contextlib.contextmanager
def scripted(sampler: ScriptedSampler, text: str):
    sampler.set_script(text)
    try:
        yield
    finally:
        sampler.set_script(None)
