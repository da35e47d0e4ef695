"""What the standard serving clients send, sent to a real server and read back their way.

One table (``CASES``): each row is one client's request body and headers, as that client builds
them (the source file is named beside the row), and a reader that parses the answer the way that
client does (ported in a few lines: the SSE framing it assumes, the fields it indexes, where it
reads usage and when it stamps TTFT and ITL). The test asserts what the client needs to count the
request as a success: HTTP 200, no error event, non-empty text, TTFT and ITL computable, and,
where the client takes its token counts from ``usage``, counts equal to the tokens the server
generated (the ``token_ids`` every choice carries). The server is SmolLM2's tokenizer and chat
template over a tiny model (``tiny_chat_server``): what is checked is the protocol.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx
import pytest

from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig
from tensorrt_llm.llmapi import LLM, KvCacheConfig

PROMPT = "Write a short poem about the sea."
MAX_TOKENS = 4
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Outcome:
    """What a client made of one answer."""

    text: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    completion_tokens: int | None = None  # as the client read it from usage (None: it does not read usage)
    prompt_tokens: int | None = None
    generated: int = 0  # the server's own count: the token_ids its choices carried (choice 0)
    error: str | None = None
    last: float | None = None  # when the latest piece of text arrived

    def add_text(self, stamp: float, start: float, piece: str) -> None:
        """A piece of text at ``stamp``: the first sets the TTFT, each later one an inter-token gap
        (as every client here times them: by arrival of a chunk that carries text)."""
        if self.ttft is None:
            self.ttft = stamp - start
        else:
            self.itl.append(stamp - self.last)
        self.last = stamp
        self.text += piece


# ------------------------------------------------------------------------------ transports
def _timed_pieces(response: httpx.Response) -> Iterator[tuple[float, bytes]]:
    for piece in response.iter_raw():
        yield time.perf_counter(), piece


def _timed_lines(response: httpx.Response) -> Iterator[tuple[float, bytes]]:
    """aiohttp's ``async for line in response.content``: one line at a time."""
    buffer = b""
    for stamp, piece in _timed_pieces(response):
        buffer += piece
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield stamp, line + b"\n"


def _sse_messages(response: httpx.Response) -> Iterator[tuple[float, str]]:
    """vLLM's ``StreamedResponseHandler`` (and AIPerf's SSE reader): messages split on a blank line."""
    buffer = ""
    for stamp, piece in _timed_pieces(response):
        buffer += piece.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                yield stamp, message.strip()


def _count(choice: dict) -> int:
    return len(choice.get("token_ids") or ())


# ------------------------------------------------------------------------------ readers, one per client
def read_vllm(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_{completions,chat_completions}:
    TTFT at the first chunk with choices, ITL between such chunks, usage from the chunk without."""
    out = Outcome()
    for stamp, message in _sse_messages(response):
        if message.startswith(":"):
            continue
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if "error" in data:
            out.error = json.dumps(data)
        if choices := data.get("choices"):
            piece = choices[0].get("text") if endpoint == "completions" else choices[0]["delta"].get("content")
            out.add_text(stamp, start, piece or "")
            out.generated += _count(choices[0])
        elif usage := data.get("usage"):
            out.completion_tokens = usage.get("completion_tokens")
            out.prompt_tokens = usage.get("prompt_tokens")
    return out


def read_legacy_vllm(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """vLLM's benchmarks/backend_request_func.py before the move (and SGLang's bench_serving.py,
    adapted from it): one line at a time, ``data["choices"][0]`` indexed on every chunk, a token
    only when its text is non-empty."""
    out = Outcome()
    for stamp, line in _timed_lines(response):
        line = line.strip()
        if not line:
            continue
        chunk = line.decode().removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if "error" in data:
            out.error = json.dumps(data)
            continue
        choice = data["choices"][0]  # an IndexError here is the client failing the request
        piece = choice["text"] if endpoint == "completions" else choice["delta"].get("content", "")
        out.generated += _count(choice)
        if piece:
            out.add_text(stamp, start, piece)
        out.completion_tokens = (data.get("usage") or {}).get("completion_tokens", out.completion_tokens)
    return out


def read_aiperf(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """AIPerf src/aiperf/endpoints/openai_{chat,completions}.py: each SSE message parsed by its
    ``object`` (chat.completion.chunk / text_completion); a response with text is a token
    response (TTFT at the first, ITL between them); usage read from any response carrying it."""
    out = Outcome()
    kinds = {"chat": ("chat.completion.chunk", "delta"), "completions": ("text_completion", None)}
    kind, key = kinds[endpoint]
    for stamp, message in _sse_messages(response):
        data_line = next((line[5:].strip() for line in message.splitlines() if line.startswith("data:")), "")
        if not data_line or data_line == "[DONE]":
            continue
        data = json.loads(data_line)
        if "error" in data:
            out.error = json.dumps(data)
        if usage := data.get("usage"):
            out.completion_tokens, out.prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if data.get("object") != kind or not data.get("choices"):
            continue
        choice = data["choices"][0]
        out.generated += _count(choice)
        piece = choice.get("text") if key is None else (choice.get(key) or {}).get("content")
        if piece:
            out.add_text(stamp, start, piece)
    return out


def read_genai_perf(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """GenAI-Perf genai_perf/profile_data_parser/llm_profile_data_parser.py: perf_analyzer
    records each response; the parser drops ``data:``, skips ``[DONE]``, requires ``object`` and
    reads ``choices[0]`` text or delta content."""
    out = Outcome()
    for stamp, line in _timed_lines(response):
        text = line.decode().strip()
        if not text.startswith("data:"):
            continue
        payload = text.removeprefix("data:").strip()
        if payload == "[DONE]":
            continue
        data = json.loads(payload)
        if "error" in data:
            out.error = json.dumps(data)
            continue
        assert data["object"] in ("text_completion", "chat.completion.chunk"), data
        choice = data["choices"][0]
        out.generated += _count(choice)
        piece = choice.get("text", "") if endpoint == "completions" else choice["delta"].get("content") or ""
        if piece:
            out.add_text(stamp, start, piece)
    return out


def read_langchain(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """langchain_openai/chat_models/base.py, ``_convert_chunk_to_generation_chunk``: a chunk
    without choices is usage only; else ``delta.content or ""``, ``finish_reason``, ``model``;
    usage metadata from ``prompt_tokens``/``completion_tokens``/``total_tokens``."""
    out = Outcome()
    for stamp, message in _sse_messages(response):
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if "error" in data:
            out.error = json.dumps(data)
            continue
        assert data["model"] and data["id"], data
        if usage := data.get("usage"):
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            out.completion_tokens, out.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
        if not data["choices"]:
            continue
        choice = data["choices"][0]
        if choice["delta"] is None:
            continue
        out.generated += _count(choice)
        piece = choice["delta"].get("content") or ""
        if piece:
            out.add_text(stamp, start, piece)
    return out


def read_whole(response: httpx.Response, start: float, endpoint: str) -> Outcome:
    """A non-streamed answer (SGLang ``--disable-stream``, LangChain ``invoke``):
    ``choices[0].message.content`` (chat) or ``.text``, usage ``completion_tokens``."""
    response.read()
    data = response.json()
    choice = data["choices"][0]
    text = choice["text"] if endpoint == "completions" else (choice["message"].get("content") or "")
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return Outcome(text=text, ttft=time.perf_counter() - start, itl=[0.0], completion_tokens=usage["completion_tokens"],
                   prompt_tokens=usage["prompt_tokens"], generated=_count(choice))


# ------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Case:
    client: str
    endpoint: str
    body: Callable[[str], dict]  # the served model's name -> the request body
    read: Callable[[httpx.Response, float, str], Outcome]
    stream: bool = True
    headers: dict = field(default_factory=dict)  # besides Authorization (the server has a key)
    reads_usage: bool = True
    ignore_eos: bool = False

    def __str__(self) -> str:
        return self.client


def _parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


CASES = [
    # vllm/benchmarks/lib/endpoint_request_func.py (vllm bench serve --backend openai / vllm): the
    # sampling flags arrive through extra_body, temperature 0.0 when none is given (serve.py).
    Case("vllm bench openai", "completions", lambda m: {
        "model": m, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": MAX_TOKENS, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0},
        read_vllm, headers={"x-request-id": "benchmark-serving0"}, ignore_eos=True),
    Case("vllm bench openai, token ids", "completions", lambda m: {
        "model": m, "prompt": [1, 504, 3458, 282, 4649, 314], "repetition_penalty": 1.0, "max_tokens": MAX_TOKENS,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
        "ignore_eos": True}, read_vllm, ignore_eos=True),
    # the same file, async_request_openai_chat_completions (--backend openai-chat): text parts,
    # max_completion_tokens; --extra-body adds vLLM's sampling extensions.
    Case("vllm bench openai-chat", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": _parts(PROMPT)}], "max_completion_tokens": MAX_TOKENS,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True},
        read_vllm, headers={"x-request-id": "benchmark-serving1"}, ignore_eos=True),
    Case("vllm bench openai-chat, extra body", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": _parts(PROMPT)}], "max_completion_tokens": MAX_TOKENS,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, "top_k": -1, "top_p": 1.0,
        "min_p": 0.0, "min_tokens": MAX_TOKENS, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "chat_template_kwargs": {"enable_thinking": False}}, read_vllm, ignore_eos=True),
    # vLLM benchmarks/backend_request_func.py (older releases): best_of, no stream_options, and a
    # read of choices[0] on every chunk.
    Case("vllm legacy openai", "completions", lambda m: {
        "model": m, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": MAX_TOKENS, "logprobs": None,
        "stream": True}, read_legacy_vllm, reads_usage=False),
    Case("vllm legacy openai-chat", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": _parts(PROMPT)}], "temperature": 0.0,
        "max_tokens": MAX_TOKENS, "stream": True}, read_legacy_vllm, reads_usage=False),
    # python/sglang/bench_serving.py, async_request_openai_completions (--backend sglang-oai, vllm,
    # lmdeploy): ignore_eos unless --disable-ignore-eos.
    Case("sglang bench sglang-oai", "completions", lambda m: {
        "model": m, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": MAX_TOKENS, "stream": True,
        "ignore_eos": True}, read_legacy_vllm, reads_usage=False, ignore_eos=True),
    # the same file, async_request_openai_chat_completions (--backend sglang-oai-chat, vllm-chat).
    Case("sglang bench sglang-oai-chat", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0, "max_tokens": MAX_TOKENS,
        "stream": True}, read_legacy_vllm, reads_usage=False),
    Case("sglang bench sglang-oai-chat --disable-stream", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0, "max_tokens": MAX_TOKENS,
        "stream": False}, read_whole, stream=False),
    # AIPerf src/aiperf/endpoints/openai_chat.py: max_completion_tokens, include_usage on every
    # streamed request (continuous_usage_stats with --per-chunk-usage), --extra-inputs merged.
    Case("aiperf chat", "chat", lambda m: {
        "messages": [{"role": "user", "content": PROMPT}], "model": m, "stream": True,
        "max_completion_tokens": MAX_TOKENS, "ignore_eos": True, "min_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True}}, read_aiperf, ignore_eos=True),
    Case("aiperf chat --per-chunk-usage", "chat", lambda m: {
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}],
        "model": m, "stream": True, "max_completion_tokens": MAX_TOKENS, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, read_aiperf, ignore_eos=True),
    # AIPerf src/aiperf/endpoints/openai_completions.py: prompt as a list of texts.
    Case("aiperf completions", "completions", lambda m: {
        "prompt": [PROMPT], "model": m, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "stream_options": {"include_usage": True}}, read_aiperf, ignore_eos=True),
    # GenAI-Perf genai_perf/inputs/converters/openai_{chat_completions,completions}_converter.py:
    # --extra-inputs ignore_eos:true min_tokens:N, no stream_options.
    Case("genai-perf chat", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "min_tokens": MAX_TOKENS}, read_genai_perf, reads_usage=False, ignore_eos=True),
    Case("genai-perf completions", "completions", lambda m: {
        "model": m, "prompt": [PROMPT], "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        read_genai_perf, reads_usage=False, ignore_eos=True),
    # langchain_openai/chat_models/base.py: _default_params (n, temperature 0.7; older releases
    # send max_tokens, newer max_completion_tokens and stream_options when stream_usage).
    Case("langchain ChatOpenAI invoke", "chat", lambda m: {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}], "model": m,
        "stream": False, "n": 1, "temperature": 0.7, "max_tokens": MAX_TOKENS}, read_whole, stream=False),
    Case("langchain ChatOpenAI stream", "chat", lambda m: {
        "messages": [{"role": "user", "content": PROMPT}], "model": m, "stream": True, "temperature": 0.7,
        "max_completion_tokens": MAX_TOKENS, "stream_options": {"include_usage": True}}, read_langchain),
    # LiteLLM hosted_vllm / openai-compatible providers: max_completion_tokens mapped to
    # max_tokens, stream_options passed through, the OpenAI SDK's headers.
    Case("litellm hosted_vllm stream", "chat", lambda m: {
        "model": m, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True}}, read_langchain,
        headers={"User-Agent": "litellm", "X-Stainless-Lang": "python"}),
]


def _send(server, case: Case, http: httpx.Client) -> tuple[int, Outcome | str]:
    body = case.body(server.model)
    start = time.perf_counter()
    with http.stream("POST", PATHS[case.endpoint], json=body, headers=case.headers) as response:
        if response.status_code != 200:
            return response.status_code, response.read().decode()
        return 200, case.read(response, start, case.endpoint)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_client_gets_what_it_needs(tiny_chat_server, case: Case):
    with tiny_chat_server.http() as http:
        status, out = _send(tiny_chat_server, case, http)
    assert status == 200, out
    assert out.error is None, out.error
    assert out.text, "no text"
    assert out.ttft is not None and out.ttft > 0
    if case.stream:
        assert out.itl and all(gap >= 0 for gap in out.itl), out.itl
    assert 0 < out.generated <= MAX_TOKENS
    if case.ignore_eos:
        assert out.generated == MAX_TOKENS
    if case.reads_usage:
        assert out.completion_tokens == out.generated, (out.completion_tokens, out.generated)
        assert out.prompt_tokens and out.prompt_tokens > 0


# ------------------------------------------------------------------------------ the openai SDK
def test_openai_sdk(tiny_chat_server):
    """openai v1: ``models.list()``, ``chat.completions.create`` streamed with usage and vLLM's
    extensions through ``extra_body``, ``completions.create``, ``.with_raw_response``."""
    client = tiny_chat_server.client()
    models = client.models.list()
    assert [card.id for card in models.data] == [tiny_chat_server.model]
    model = models.data[0].id

    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, temperature=0.0,
        extra_body={"ignore_eos": True, "min_tokens": 1, "skip_special_tokens": True, "top_k": 1}))
    assert all(c.id == chunks[0].id and c.model == model and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS

    raw = client.completions.with_raw_response.create(model=model, prompt=[PROMPT], max_tokens=MAX_TOKENS,
                                                      extra_body={"ignore_eos": True})
    assert raw.http_request.headers["Authorization"] == f"Bearer {tiny_chat_server.api_key}"
    assert raw.headers["content-type"].startswith("application/json")
    completion = raw.parse()
    assert completion.choices[0].text and completion.usage.completion_tokens == MAX_TOKENS
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + MAX_TOKENS

    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    assert sum(len(c.choices[0].model_extra.get("token_ids") or ()) for c in streamed if c.choices) == MAX_TOKENS


# ------------------------------------------------------------------------------ what must still fail
@pytest.mark.parametrize(("endpoint", "extra", "status", "param"), [
    ("chat", {"model": "gpt-3.5-turbo"}, 404, "model"),  # LangChain's default model name
    ("chat", {"skip_special_tokens": False}, 400, "skip_special_tokens"),
    ("chat", {"chat_template_kwargs": "enable_thinking"}, 400, "chat_template_kwargs"),
    ("chat", {"messages": [{"role": "user", "content": [  # SGLang's image rows: no image input here
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "?"}]}]},
     400, "messages.0.content"),
    ("completions", {"prompt": [PROMPT] * 17}, 400, "prompt"),  # GenAI-Perf --batch-size-text 17: over the cap
    ("completions", {"prompt": [PROMPT, ""]}, 400, "prompt.1"),  # a batch with an empty prompt
    ("completions", {"max_token": 4}, 400, "max_token"),
    ("completions", {"ignore_eos": "yes"}, 400, "ignore_eos"),
])
def test_a_bad_field_fails_alone_naming_it(tiny_chat_server, endpoint, extra, status, param):
    base = {"model": tiny_chat_server.model, "max_tokens": 2, "stream": True,
            **({"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPT}]})}
    with tiny_chat_server.http() as http:
        response = http.post(PATHS[endpoint], json={**base, **extra})
        assert response.status_code == status and response.json()["error"]["param"] == param, response.text
        assert http.post(PATHS[endpoint], json=base).status_code == 200  # the same request, the field left out


def test_model_may_be_left_out(tiny_chat_server):
    """vLLM serves its model when a request names none (``model`` is optional there)."""
    with tiny_chat_server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                            "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == tiny_chat_server.model


# ------------------------------------------------------------------------------ TTFT is to the first token
@pytest.fixture(scope="module")
def slow_chat_server(smollm2_tokenizer_checkpoint):
    """The tiny chat model with every forward slowed by SLOW_S: the first token cannot be out before."""
    from tests.helpers.server_harness import RunningServer

    llm = LLM(str(smollm2_tokenizer_checkpoint), max_seq_len=512, max_num_tokens=256,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=64),
              fault_injection=FaultInjectionConfig(slow_forward_every=1, slow_forward_s=SLOW_S))
    server = RunningServer(llm)
    yield server
    server.stop()


SLOW_S = 0.3


def test_the_first_chat_chunk_comes_with_the_first_token(slow_chat_server):
    """vLLM's bench stamps TTFT at the first chunk that has choices: the role chunk. Sent before
    the prefill (as soon as the request is accepted), it would make every TTFT near zero; it comes
    with the first token, as vLLM and upstream send it."""
    case = next(c for c in CASES if c.client == "vllm bench openai-chat")
    with slow_chat_server.http() as http:
        status, out = _send(slow_chat_server, case, http)
    assert status == 200, out
    assert out.ttft >= SLOW_S, out.ttft


# ------------------------------------------------------------------------------ chat_template_kwargs reach the template
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking | default(true) %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer_checkpoint, tmp_path):
    """Qwen3-style ``{"enable_thinking": false}`` (sent through extra_body by benchmark users):
    the template writes an empty think block, so the prompt grows by exactly those tokens."""
    from tests.helpers.server_harness import RunningServer

    from tensorrt_llm.serve.server_config import ServerConfig

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    llm = LLM(str(smollm2_tokenizer_checkpoint), max_seq_len=256, max_num_tokens=128,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=32))
    server = RunningServer(llm, config=ServerConfig(chat_template=str(template)))
    try:
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
        with server.http() as http:
            plain = http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
            off = http.post("/v1/chat/completions", json={
                **body, "chat_template_kwargs": {"enable_thinking": False}}).json()["usage"]["prompt_tokens"]
        block = len(llm.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
        assert off == plain + block and block > 0
    finally:
        server.stop()
