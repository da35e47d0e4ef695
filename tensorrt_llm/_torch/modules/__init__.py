"""Building blocks of the torch models."""
