"""Several ranks, one decision: the executor over ``torch.distributed``.

* :mod:`.communicator` — one rank's process group: the tagged, bounded ``exchange`` the
  executor's control plane uses, and the group abort that turns one rank's failure into an
  error on every rank (the model's tensor collectives are ``modules.collectives``: the
  layers below this package call them);
* :mod:`.launcher` — starting the rank processes (``torch.multiprocessing`` spawn, gloo on
  loopback) and running jobs on a long-lived group;
* :mod:`.request_spec` — requests as plain data, for the broadcast from rank 0;
* :mod:`.digest` and :mod:`.agreement` — the per-iteration decision digest and its check;
* :mod:`.attention_dp` — how new requests are spread over attention-DP ranks;
* :mod:`.rank_executor` — one rank's executor in lock-step with the others;
* :mod:`.worker` and :mod:`.multi_rank_executor` — the rank processes behind ``LLM(tensor_parallel_size=N)``.
"""
