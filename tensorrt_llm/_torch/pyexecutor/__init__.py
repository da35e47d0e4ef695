"""The executor layer: requests, paged KV cache, two-stage scheduler, token budget, engine, loop."""
