"""Building blocks of the torch models: parallel linear layers and the tensor collectives they call."""
