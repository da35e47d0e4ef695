"""The application's parts, as Ray Serve runs them (``app.build_app`` wires them)::

    client ─HTTP─► Ray Serve proxy ─► OpenAIIngress ──handle (router)──► LLMReplica x N
                                       │ prompt ids (PromptRenderer)        │ LLM + OpenAIServer.app
                                       │ /health, /prometheus/metrics       │ events, health, metrics
                                       └──────────── ReplicaRegistry (actor) ◄─┘

* :class:`LLMReplica`: one engine (``LLM``) and the unchanged ``OpenAIServer`` app over it,
  called in-process with the client's HTTP request (:meth:`LLMReplica.handle_http`): every
  endpoint, validation, error and stream is ``trtllm-serve``'s. Its answer streams back as a
  :class:`ResponseHead`, then body chunks, with ``x-trtllm-replica`` naming it. A thread pushes
  its KV cache events, health and Prometheus text to the registry. ``check_health`` is
  ``/health``'s verdict: Ray Serve replaces a replica whose executor died or stalled.
* :class:`OpenAIIngress`: reads the request, renders its prompt ids with the model's tokenizer
  and chat template (``prompt_ids``: the server's own code, so the router sees the ids the
  replica queues),
  and relays the chosen replica's answer. A replica that dies mid-request ends the request
  cleanly: a 503 error body when no answer has started, else (a stream) a last
  ``data: {"error": ...}`` event and ``data: [DONE]``. ``/health`` and ``/prometheus/metrics``
  are answered here for the whole application, from the replicas' reports.
* ``ReplicaRegistry`` (``registry``) runs as a Ray actor the ingress creates (it lives and dies
  with it; a new one is rebuilt from the replicas' next pushes).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
import uuid
from typing import AsyncIterator

import prometheus_client
import ray
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.requests import ClientDisconnect, Request

from tensorrt_llm.serve.errors import OpenAIError, error_body
from tensorrt_llm.serve.prompts import PromptRenderer
from tensorrt_llm.serve.ray_serve.config import RayServeConfig
from tensorrt_llm.serve.ray_serve.metrics_merge import merge_expositions
from tensorrt_llm.serve.ray_serve.prefix_index import PrefixIndex
from tensorrt_llm.serve.ray_serve.prompt_ids import RoutingPrompts
from tensorrt_llm.serve.ray_serve.registry import NAMESPACE, ReplicaRegistry, registry_name
from tensorrt_llm.serve.ray_serve.routers import replica_name
from tensorrt_llm.serve.ray_serve.wire import REPLICA_HEADER, ResponseHead, RoutedRequest
from tensorrt_llm.serve.server_config import ServerConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_REPLICA_FAILED_S = 1  # Ray Serve replaces the replica; the others take new requests now
_APP_STOP_GRACE_S = 5.0  # a request's app task gets this long to finish after its client left


RegistryActor = ray.remote(num_cpus=0, max_restarts=0)(ReplicaRegistry)


# ---------------------------------------------------------------------------------------------
# LLMReplica
# ---------------------------------------------------------------------------------------------


class LLMReplica:
    """One engine and the OpenAI server over it (see the module docstring). Built by Ray Serve
    from ``LLM(model, **llm_kwargs)`` and ``server_config`` (whose host, port and edge limits
    belong to Ray Serve's proxy and are not used)."""

    def __init__(self, model: str, llm_kwargs: dict, server_config: ServerConfig, settings: RayServeConfig) -> None:
        from tensorrt_llm.llmapi import LLM  # torch loads in the replica, not where the app is built
        from tensorrt_llm.serve.openai_server import OpenAIServer

        context = serve.get_replica_context()
        self.name = replica_name(context.replica_id)
        prometheus_client.disable_created_metrics()  # as trtllm-serve: no *_created series
        self.llm = LLM(model, **llm_kwargs)
        self.server = OpenAIServer(self.llm, server_config)
        if server_config.freeze_gc_heap:
            gc.collect()
            gc.freeze()
        self._reporter = _Reporter(self, registry_name(context.app_name), settings.report_period_s)
        self._reporter.start()
        logger.info("replica %s serves %s", self.name, self.llm.describe())

    async def handle_http(self, request: RoutedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to ``request``: its :class:`ResponseHead`, then body chunks. When the
        caller goes away (the stream is cancelled), the app sees ``http.disconnect`` and cancels
        the generation, freeing its KV blocks, as with a client of ``trtllm-serve``."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.put_nowait(message)

        app = asyncio.create_task(self.server.app(request.asgi_scope(), receive, send))
        app.add_done_callback(lambda _: messages.put_nowait(None))
        started = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    yield ResponseHead(message["status"], [*message.get("headers", []),
                                                           (REPLICA_HEADER, self.name.encode())])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if not started:  # the app ended without an answer (a bug): still one
                error = app.exception() if app.done() and not app.cancelled() else None
                payload = json.dumps(error_body(500, f"internal error: the server gave no answer ({error!r})"))
                yield ResponseHead(500, [(b"content-type", b"application/json"), (REPLICA_HEADER, self.name.encode())])
                yield payload.encode()
        finally:
            disconnected.set()
            if not app.done():  # the caller left mid-answer: let the app see it, then make sure it ends
                asyncio.get_running_loop().create_task(_finish(app))

    def check_health(self) -> None:
        """Ray Serve's health check: ``/health``'s verdict (the executor loop alive and, with
        work, iterating within ``health_check_timeout_s``); raising marks this replica unhealthy
        and Ray Serve replaces it."""
        health = self.llm.health()
        if not health.healthy:
            raise RuntimeError(f"replica {self.name} is unhealthy: {health.reason}")

    def __del__(self) -> None:  # Ray Serve's shutdown hook
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.stop()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


async def _finish(app: asyncio.Task) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(app), _APP_STOP_GRACE_S)
    except asyncio.TimeoutError:
        app.cancel()
    except Exception:  # noqa: BLE001 - the app's own failure was answered (or logged) by it
        pass


class _Reporter(threading.Thread):
    """Pushes the replica's KV cache events (in numbered batches; the whole block set when the
    registry has lost track), and every ``period_s`` its health and Prometheus text, to the
    registry. A daemon thread: nothing here waits on the event loop or holds up the executor."""

    def __init__(self, replica: LLMReplica, registry: str, period_s: float) -> None:
        super().__init__(name=f"trtllm-reporter-{replica.name}", daemon=True)
        self.replica, self.registry_name, self.period_s = replica, registry, period_s
        self.epoch = uuid.uuid4().hex  # this process's life: a registry never mixes two
        self.seq = 0
        self.held = PrefixIndex()  # this replica's own blocks, from its own events (the resync snapshot)
        self.pending: list[dict] = []
        self.events_on = replica.llm.config.kv_cache_config.event_buffer_max_size > 0
        self._registry = None
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        next_report = 0.0
        while not self._stop.is_set():
            try:
                if self.events_on:
                    events = self.replica.llm.get_kv_cache_events(timeout=self.period_s / 4)
                    if events:
                        self.held.apply(self.replica.name, events)
                        self.pending += events
                else:
                    self._stop.wait(self.period_s / 4)
                registry = self._lookup()
                if registry is None:
                    continue
                if self.pending:
                    self._push_events(registry)
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + self.period_s
                    ray.get(registry.report.remote(self.replica.name, self._health(), self._metrics()))
            except Exception as error:  # noqa: BLE001 - a lost registry or a shut-down LLM: try again
                if self._stop.is_set():
                    return
                # the registry dies with its ingress replica (replaced, or the application shutting down)
                level = logging.INFO if isinstance(error, ray.exceptions.RayActorError) else logging.WARNING
                logger.log(level, "replica %s: reporting failed (%s); retrying", self.replica.name,
                           type(error).__name__)
                self._registry = None
                self._stop.wait(self.period_s)

    def _push_events(self, registry) -> None:
        applied = ray.get(registry.apply.remote(self.replica.name, self.epoch, self.seq, self.pending))
        if not applied:  # the registry is new or lost a batch: send the whole set
            held = list(self.held.held(self.replica.name))
            ray.get(registry.resync.remote(self.replica.name, self.epoch, self.seq, held))
        self.seq += 1
        self.pending = []

    def _lookup(self):
        if self._registry is None:
            try:
                self._registry = ray.get_actor(self.registry_name, namespace=NAMESPACE)
            except ValueError:  # the ingress has not created it yet
                self._stop.wait(self.period_s / 4)
                return None
        return self._registry

    def _health(self) -> dict:
        return self.replica.llm.health().to_dict()

    def _metrics(self) -> str:
        return prometheus_client.generate_latest(self.replica.server.metrics.registry).decode()


# ---------------------------------------------------------------------------------------------
# OpenAIIngress
# ---------------------------------------------------------------------------------------------


class OpenAIIngress:
    """The application's HTTP entry (see the module docstring). ``replicas``: the handle to the
    LLM replicas, with the router ``build_app`` chose."""

    def __init__(self, replicas, prompts: PromptRenderer, server_config: ServerConfig,
                 settings: RayServeConfig) -> None:
        self.replicas = replicas.options(stream=True)
        self.prompts = RoutingPrompts(prompts, server_config)
        self.server_config = server_config
        app_name = serve.get_replica_context().app_name
        # created here, owned by this replica: Ray Serve's shutdown (or this replica's death) ends it
        self.registry = RegistryActor.options(name=registry_name(app_name), namespace=NAMESPACE,
                                              get_if_exists=True).remote(settings.stale_after_s)

    async def __call__(self, request: Request) -> Response:
        path = _app_path(request.scope)
        if request.method == "GET" and path == "/health":
            return await self._health()
        if request.method == "GET" and path == "/prometheus/metrics":
            return await self._metrics()
        try:
            body = await _read_body(request, self.server_config.max_body_bytes)
        except OpenAIError as error:
            return error.response()
        except ClientDisconnect:
            return Response(status_code=499)
        client = request.scope.get("client")
        routed = RoutedRequest(request.method, path, request.scope.get("query_string", b""), list(request.headers.raw),
                               body, tuple(client) if client else None, await self.prompts.prompt_ids(path, body))
        stream = self.replicas.handle_http.remote(routed)
        try:
            head = await stream.__anext__()
        except Exception as error:  # noqa: BLE001 - the replica died (or failed) before answering
            logger.warning("%s %s: the replica failed before answering: %s: %s", request.method, path,
                           type(error).__name__, error)
            return _replica_failed(error)
        response = StreamingResponse(_relay(stream, head, path))
        response.status_code = head.status
        response.raw_headers = list(head.headers)
        return response

    async def _health(self) -> JSONResponse:
        """200 while at least one replica reports healthy; each live replica's ``/health`` body."""
        try:
            reports = await self.registry.reports.remote()
        except Exception as error:  # noqa: BLE001
            return JSONResponse({"status": "unhealthy", "reason": f"the registry is unavailable: {error}"},
                                status_code=503)
        replicas = {name: report.health for name, report in sorted(reports.items())}
        healthy = sum(1 for health in replicas.values() if health.get("healthy"))
        body = {"status": "ok" if healthy else "unhealthy", "healthy_replicas": healthy, "replicas": replicas}
        if not healthy:
            body["reason"] = "no replica is healthy" if replicas else "no replica has reported yet"
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def _metrics(self) -> Response:
        """Every live replica's Prometheus metrics, each sample labelled ``replica``."""
        try:
            reports = await self.registry.reports.remote()
        except Exception as error:  # noqa: BLE001
            return JSONResponse(error_body(503, f"the registry is unavailable: {type(error).__name__}"),
                                status_code=503)
        text = merge_expositions({name: report.metrics for name, report in reports.items()})
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)


def _app_path(scope: dict) -> str:
    """The request's path within the application (the route prefix taken off)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one over ``limit`` bytes as the server's own guard would."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _relay(stream, head: ResponseHead, path: str) -> AsyncIterator[bytes]:
    """The replica's body chunks. A replica that dies mid-stream ends an event stream with an
    error event and ``[DONE]``; the client leaving cancels the replica's request."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except Exception as error:  # noqa: BLE001 - the replica died or failed mid-answer
        finished = True
        logger.warning("%s: the replica failed mid-answer: %s: %s", path, type(error).__name__, error)
        if head.is_event_stream:
            message = f"the replica serving this request failed: {type(error).__name__}"
            yield f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not finished:
            stream.cancel()


def _replica_failed(error: Exception) -> JSONResponse:
    message = f"the replica serving this request failed before answering ({type(error).__name__}); try again"
    return JSONResponse(error_body(503, message), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_REPLICA_FAILED_S)})
