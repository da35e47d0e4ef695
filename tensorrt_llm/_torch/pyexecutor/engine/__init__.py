"""What runs a forward: the engine interface (``interface``), the inputs a batch becomes
(``inputs``: ``ForwardInputs``, upstream's ``_prepare_tp_inputs``), which rows of the logits are
whose (``logit_rows``), the torch engines per device (``torch_engine``),
the simulated engine, fault injection and the CUDA graph runners. The package itself imports no
torch: only ``torch_engine`` and the graph runners do."""
