"""Speculative decoding's building blocks: drafters and the acceptance rule (no executor state)."""
