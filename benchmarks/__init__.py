"""Benchmarks, run from the checkout (not installed): ``replay/`` (traces, the cost model, the
replay CLI), ``host_path/`` (the executor's host cost), ``serving/`` (``trtllm-serve`` under
load), ``model/`` (the torch engine and its models on the CPU), ``gpu/`` (the H200 runs).
``benchmarks/README.md`` lists the entry points; ``results/`` holds what they measured."""
