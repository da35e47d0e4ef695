"""From logits to tokens: the sampler, logits processors (penalties, min_tokens), beam search,
guided decoding (grammar masks), the stop rule, the n-gram drafter and the synthetic sampler the
tests and the simulated engine use."""
