"""What the ingress and an LLM replica pass each other through Ray Serve: an HTTP request as the
client sent it (plus the prompt ids the router reads), and the answer's head, then its body
chunks. Plain values, pickled by Ray; nothing here imports Ray."""

from __future__ import annotations

from dataclasses import dataclass

#: The answer header naming the replica that served a request (tests and the benchmark read it).
REPLICA_HEADER = b"x-trtllm-replica"


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """An HTTP request for the replica's app, as the client sent it. ``prompt_ids``: the request's
    prompt as the server will queue it (``PromptRenderer``), for the router only; None when it is
    no generation request or the ingress could not render it (the replica answers that)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    prompt_ids: list[int] | None = None

    def asgi_scope(self) -> dict:
        """The ASGI HTTP scope the replica's app is called with."""
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
            "client": self.client, "server": None, "state": {},
        }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The first item a replica streams back: the status and headers; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)
