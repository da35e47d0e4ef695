"""A standard benchmark client against a real ``trtllm-serve``: GuideLLM, end to end, on the CPU.

GuideLLM (the vLLM project's serving benchmark) streams every request with
``stream_options: {include_usage, continuous_usage_stats}`` and counts tokens from the server's
usage. It is installed from the package registry into its own virtual environment, kept under
``.venv/`` and reused (its dependency tree, pandas, pyarrow, datasets, uvloop ..., stays out of
the project's; a ``.pth`` file lets it see the project's packages, so only what they lack is
installed). SmolLM2 serves, tiny loads: streaming chat, then completions. The test fails when
GuideLLM reports any failed or incomplete request, or no TTFT or ITL figures (it exits 0 even
when every request failed, so its JSON report is what is read).
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.helpers.guidellm_runs import run_guidellm
from tests.helpers.tool_venvs import tool_venv

GUIDELLM = "guidellm==0.8.1"
REQUESTS = 6
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8
ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guidellm() -> Path:
    """The ``guidellm`` command of its own venv (created on first use, then reused; it sees the
    project's packages, so torch and transformers are not downloaded again)."""
    return tool_venv(GUIDELLM, see_project_packages=True) / "bin" / "guidellm"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files, as the benchmark client loads them (AutoTokenizer)."""
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    subprocess.run([sys.executable, "-m", "tools.gguf_to_hf", "--out", str(out), "--tokenizer-only"], cwd=ROOT,
                   check=True, timeout=300, capture_output=True)
    return out


@pytest.fixture(scope="module")
def served():
    """``trtllm-serve smollm2-135m-instruct`` on a free port; its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorrt_llm.commands.serve", "smollm2-135m-instruct", "--port", "0",
         "--max_seq_len", "1024", "--kv_cache_config.num_blocks", "256"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 180
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                match = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", lines.get(timeout=1))
            except queue.Empty:
                continue
            url = match and match.group(1)
        assert url, "the server did not report its address"
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_guidellm_streams_without_a_failed_request(guidellm, tokenizer_dir, served, route, tmp_path):
    report = tmp_path / "report.json"
    command = [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={served},model=smollm2-135m-instruct,request_format={route}",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={report}", "--output", "kind=console",
        "--disable-progress",
    ]
    done = run_guidellm(command)
    tables = done.stdout[done.stdout.find("Request Latency Statistics") - 2:]
    print(f"\nGuideLLM {route}:\n{tables[:3000]}")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    # a TTFT per request, an ITL per pair of consecutive tokens
    for name, count in (("time_to_first_token_ms", REQUESTS), ("inter_token_latency_ms", REQUESTS * (OUTPUT_TOKENS - 1))):
        figures = metrics[name]["successful"]
        assert figures["count"] == count and figures["median"] > 0 and figures["percentiles"]["p95"] > 0, (name, figures)
    # the output tokens it counted are the server's usage: max_tokens each
    assert metrics["output_token_count"]["successful"]["mean"] == OUTPUT_TOKENS
