"""The GPU runs (docs/gpu.md): every script checks its preconditions first and writes under the
directory it is given. ``bench`` (kernels, forwards against the roofline, the simulator against
the engine), ``phase_b`` (every policy on the engine, the overlap scheduler), ``gaps``, ``fp8``,
``peer_serving`` (with ``peer_summary``, its comparison table against ``peer_figures.json``),
``hf_checkpoints``, ``smollm2``, ``calibrate`` (the cost model's table); ``common``, ``forward``,
``kernels``, ``sim_check``, ``peer_checkpoint``, ``peer_engine`` are their parts, ``site_check``
the check of the wheel site the peer phases carry. ``h200_runs.sh`` and
``h200_serving.sh`` hold the H200 phases, one device call each; ``fetch_wheels.sh`` the wheels
the H200 image lacks; ``nemo.yaml`` / ``nemo_faults.yaml`` the server's settings there;
``context_probe.py`` and ``eager_host_probe.py`` two one-off probes whose numbers are in
``results/h200/``."""
