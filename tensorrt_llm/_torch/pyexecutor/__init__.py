"""The executor layer: requests, paged KV cache, two-stage scheduler, token budget, engine, loop.

Its parts, lowest first; each imports only those above it (``test_import_graph.py``)::

    values            llm_request (LlmRequest, RequestCounters), config, errors, forward_cost
                      (the one forward-pass cost), scheduled_requests, priority, response,
                      beam_state, sampling_config
    kv_cache/         the paged KV cache: blocks, prefix reuse, host tier, KVCacheManager
    budget/           the token-budget policies and the re-check (decisions as values)
    scheduler/        capacity and micro-batch scheduling, priority preemption
    resource_manager  prepare_resources: the re-check before any KV allocation, then allocation
    engine/           forward inputs and the model engines (torch, simulated, CUDA graphs)
    sampling/         samplers, drafter, guided decoding, stop rules
    iteration/        one iteration's parts: admission, launch, completion, failures, stats
    executor/         the loop thread, the ExecutorClient interface, request validation
    py_executor       PyExecutor: the iteration on one screen
    py_executor_creator, kv_cache_manager, model_engine, sampler
                      wiring from a config, and upstream's module names kept as shims
"""
