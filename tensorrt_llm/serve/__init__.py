"""The OpenAI-compatible HTTP front of an :class:`~tensorrt_llm.LLM` (DESIGN.md §6).

``openai_server`` builds the FastAPI app, ``openai_protocol`` holds the request and
response models, ``openai_fields`` the table of what is done with each request field,
``tool_calling`` and ``tool_parsers`` tools on chat (``--tool_parser``), ``generation`` turns an executor request into text deltas (detokenization,
stop strings, timing), ``metrics`` the Prometheus registry, ``middleware`` the API key and
body guards, ``http_server`` uvicorn's HTTP protocol with the edge limits (``uvicorn_config``),
``server_config`` the front's settings, ``llm_options`` the ``--extra_llm_api_options`` YAML,
``errors`` the error format, ``prompts`` a request's prompt as token ids, ``ray_serve`` N
replicas under Ray Serve with a prefix-aware router (the ``[ray]`` extra). Import ``OpenAIServer`` from ``tensorrt_llm.serve.openai_server``: this package does
not import it, so that checking the options file needs neither torch nor the model.
"""
