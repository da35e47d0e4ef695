"""``trtllm-serve`` measured through HTTP: ``replay`` (a trace against a live server, the JSON of
docs/design.md §6), ``soak`` (a server under load for minutes, its health and memory polled),
``cpu`` (closed-loop users on the CPU), ``keepalive_race``, ``structured_output`` over random
``json_schemas``."""
