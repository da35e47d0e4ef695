"""Settings of the HTTP front itself (not of the model or the executor): where it listens and the
limits it holds every client to. ``trtllm-serve``'s server flags are generated from these fields.

Why the defaults are what they are:

* ``timeout_keep_alive_s`` (75 s, nginx's default; uvicorn's own is 5 s): an idle pooled
  connection must be closed by the *client* first. httpx (and so the ``openai`` client) drops
  an idle connection after 5 s; a server that also closes after 5 s closes it just as the
  client reuses it, and that request is lost as a transport error the server never sees.
* ``header_timeout_s`` / ``body_timeout_s``: a request whose head or body stops arriving is
  answered 408 and closed, instead of holding a connection open forever.
* ``limit_concurrency``: connections beyond it are answered 503 before anything is parsed.
* ``max_queue_size``: requests waiting in the executor beyond it are answered 503 with
  ``Retry-After`` instead of being queued without bound.
* ``freeze_gc_heap``: once the model and the app are built, everything alive is moved out of
  the garbage collector's sight (``gc.freeze()``, as vLLM does). A serving process tracks
  ~0.7M objects (torch, the app, the model); a full collection walked all of them, 0.2-1 s
  with the GIL held, and the event loop stood still for it: ``/health`` took up to 1 s, and a
  request that arrived on a keep-alive connection in that pause could meet its close.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm.serve.tool_parsers import TOOL_PARSERS

MAX_BODY_BYTES = 16 * 1024 * 1024


def _check(name: str, value: object, *, minimum: float, kind: type | tuple[type, ...], optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, kind) or not value >= minimum or value != value:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}a number >= {minimum:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front's settings; validated at construction."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 takes a free port
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1/*
    timeout_keep_alive_s: float = 75.0  # an idle keep-alive connection is closed after this
    backlog: int = 2048  # connections the kernel queues before the server accepts them
    limit_concurrency: int | None = None  # open connections beyond this get 503; None: no limit
    header_timeout_s: float = 30.0  # a request head not complete after this: 408, closed
    body_timeout_s: float = 30.0  # a request body not complete after this: 408, closed
    max_header_bytes: int = 64 * 1024  # a request head larger than this: 431, closed
    max_body_bytes: int = MAX_BODY_BYTES  # a body larger than this: 413 (drained, so every client reads it)
    max_queue_size: int | None = None  # requests waiting in the executor beyond this get 503; None: no bound
    freeze_gc_heap: bool = True  # gc.freeze() once the model and the app are built
    # How the model writes tool calls (chat tools with tool_choice auto, required or a named function)
    tool_parser: str | None = field(default=None, metadata={"choices": tuple(sorted(TOOL_PARSERS))})
    # A Jinja chat template file used instead of the model's (e.g. one with a tool section)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        _check("port", self.port, minimum=0, kind=int)
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        for name in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s"):
            _check(name, getattr(self, name), minimum=0.001, kind=(int, float))
        for name in ("backlog", "max_header_bytes", "max_body_bytes"):
            _check(name, getattr(self, name), minimum=1, kind=int)
        for name in ("limit_concurrency", "max_queue_size"):
            _check(name, getattr(self, name), minimum=1, kind=int, optional=True)
        if not isinstance(self.freeze_gc_heap, bool):
            raise ValueError(f"freeze_gc_heap must be a bool, got {self.freeze_gc_heap!r}")
        if self.tool_parser is not None and self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {self.tool_parser!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ValueError("chat_template must be the path of a Jinja template file")
