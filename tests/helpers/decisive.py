"""Greedy tokens compared across runs whose arithmetic differs: the reference run must be decisive.

Two runs of one request compute the same bits only where their arithmetic is the same (the same
shapes and threads) or batch-invariant (``LLM(batch_invariant=True)``, docs/determinism.md).
Elsewhere (another batch, chunking, reuse, ranks, thread count, CPU) float32 logits move: by
about 1e-5 for SmolLM2-135M (measured: a prompt's logprobs alone and inside a batch of four), by
2e-6 for tiny-random, by 4e-15 in float64. A greedy pick flips where the two best tokens are
nearer than that, on some machine. So a test comparing such runs' greedy tokens first checks
that its reference run led by :data:`MIN_LEAD` at every step (the reference asks for
``logprobs=2``): any run whose logits stay within half of that picks the same tokens, and a
near-tie fails the same way on every machine instead of flaking on some.
"""

from __future__ import annotations

#: The smallest lead (nats) of a greedy pick over the runner-up for its token to be compared across
#: runs with other float32 arithmetic: about 100 times the movement measured for SmolLM2.
MIN_LEAD = 1e-3


def leads(completion) -> list[float]:
    """The lead of the chosen token over the best other one at each step of a greedy
    ``CompletionOutput`` generated with ``logprobs >= 2`` (nats: logprob differences are logit differences)."""
    if completion.logprobs is None or any(len(entry.top) < 2 for entry in completion.logprobs):
        raise ValueError("the reference run needs logprobs=2 (its two best tokens at every step)")
    return [entry.logprob - max(lp for token, lp in entry.top if token != entry.token) for entry in completion.logprobs]


def assert_decisive(completion, what: str = "", min_lead: float = MIN_LEAD) -> None:
    """Fail, naming the step, where the reference's greedy pick led by less than ``min_lead``:
    its tokens could not be compared with another run's (choose another prompt)."""
    for step, lead in enumerate(leads(completion)):
        assert lead >= min_lead, f"{what}: a near-tie at step {step} (lead {lead:.2g} < {min_lead:g}): not comparable"
