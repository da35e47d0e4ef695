"""The executor's host cost per iteration: ``overhead`` (``make overhead``), ``phases`` (each phase
of the step) and ``ab`` (this tree against other commits, alternated). docs/host-path.md."""
