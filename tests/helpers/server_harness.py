"""Real servers on 127.0.0.1 (ephemeral ports) for the serving tests.

``RunningServer`` runs uvicorn in a background thread of the test process, so a test can
drive it over HTTP with the ``openai`` client and also look inside the executor (KV pool,
kill hook). uvicorn is configured by ``http_server.uvicorn_config``, as ``trtllm-serve`` is, so
the tests go through the real edge (timeouts, size limits, JSON error answers). Stopping it
runs the app's shutdown, which shuts the LLM down.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import openai
import uvicorn

from tensorrt_llm.llmapi import LLM
from tensorrt_llm.serve.http_server import uvicorn_config
from tensorrt_llm.serve.openai_server import OpenAIServer
from tensorrt_llm.serve.server_config import ServerConfig

API_KEY = "test-key"


class RunningServer:
    """``config``: the front's settings (host and port are always 127.0.0.1 and a free port);
    ``api_key`` overrides its key (the default one, unless None is given)."""

    def __init__(self, llm: LLM, *, api_key: str | None = API_KEY, config: ServerConfig | None = None) -> None:
        self.llm = llm
        self.api_key = api_key
        self.config = dataclasses.replace(config or ServerConfig(), host="127.0.0.1", port=0, api_key=api_key)
        self.server = OpenAIServer(llm, self.config)
        self._uvicorn = uvicorn.Server(uvicorn_config(self.server.app, self.config, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def executor(self):
        return self.llm.executor

    @property
    def model(self) -> str:
        return self.llm.model_id

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.auth_headers, timeout=60)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the executor holds no request (bounded)."""
        deadline = time.monotonic() + timeout
        while self.executor.has_work:
            assert time.monotonic() < deadline, f"still busy: {self.executor.active_requests[:5]}"
            time.sleep(0.01)

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=60)
        self.llm.shutdown()  # the app's shutdown already did; idempotent
