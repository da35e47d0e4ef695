"""``trtllm-serve``: the YAML options file and the command itself (a real process on a free port)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tensorrt_llm._torch.pyexecutor.config import FaultInjectionConfig, KvCacheConfig, TokenBudgetPolicyName
from tensorrt_llm.serve.llm_options import LlmOptionsError, load_llm_options

FULL_OPTIONS = """\
kv_cache_config:
  tokens_per_block: 16
  max_tokens: 4096
  enable_block_reuse: true
  enable_partial_reuse: false
  host_cache_size: 0
enable_chunked_prefill: true
token_budget_policy: none
dtype: float64
health_check_timeout_s: 2.5
fault_injection:
  forward_error_every: 7
  nan_logits_every: 0
  slow_forward_every: 3
  slow_forward_s: 0.1
  seed: 1
"""


def test_options_file_builds_typed_llm_keywords(tmp_path):
    path = tmp_path / "options.yaml"
    path.write_text(FULL_OPTIONS)
    options = load_llm_options(path)
    assert options["kv_cache_config"] == KvCacheConfig(tokens_per_block=16, max_tokens=4096, enable_partial_reuse=False)
    assert options["fault_injection"] == FaultInjectionConfig(forward_error_every=7, slow_forward_every=3,
                                                              slow_forward_s=0.1, seed=1)
    assert options["token_budget_policy"] is TokenBudgetPolicyName.NONE and options["dtype"] == "float64"
    assert options["health_check_timeout_s"] == 2.5 and options["enable_chunked_prefill"] is True


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_num_tokenz: 4\n", "unknown key 'max_num_tokenz'"),
        ("kv_cache_config:\n  tokens_per_blok: 8\n", "unknown key 'kv_cache_config.tokens_per_blok'"),
        ("fault_injection:\n  nan_every: 3\n", "unknown key 'fault_injection.nan_every'"),
        ("model: tiny-random\n", "unknown key 'model'"),
        ("kv_cache_config:\n  tokens_per_block: 0\n", "tokens_per_block must be a positive integer"),
        ("token_budget_policy: sometimes\n", "token_budget_policy must be one of"),
        ("health_check_timeout_s: -1\n", "health_check_timeout_s must be a finite number of seconds > 0"),
        ("fault_injection: 3\n", "fault_injection must be a mapping"),
        ("- a\n- b\n", "expected a mapping of LLM options"),
        ("key: [unclosed\n", "not valid YAML"),
    ],
)
def test_options_file_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "options.yaml"
    path.write_text(text)
    with pytest.raises(LlmOptionsError, match=re.escape(message)) as error:
        load_llm_options(path)
    assert str(path) in str(error.value)


def test_command_refuses_an_unknown_option_at_start_up(tmp_path):
    path = tmp_path / "options.yaml"
    path.write_text("enable_chunked_prefil: true\n")
    done = subprocess.run([sys.executable, "-m", "tensorrt_llm.commands.serve", "tiny-random", "--extra_llm_api_options",
                           str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown key 'enable_chunked_prefil'" in done.stderr


def test_command_serves_and_stops_on_sigint(tmp_path):
    options = tmp_path / "options.yaml"
    options.write_text("token_budget_policy: recheck\nkv_cache_config:\n  tokens_per_block: 16\n  num_blocks: 64\n")
    env = {**os.environ, "TRTLLM_API_KEY": "secret"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorrt_llm.commands.serve", "tiny-random", "--port", "0", "--max_seq_len", "256",
         "--extra_llm_api_options", str(options)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                match = re.search(r"serving tiny-random at (http://127\.0\.0\.1:\d+)", lines.get(timeout=1))
            except queue.Empty:
                continue
            url = match and match.group(1)
        assert url, "the server did not report its address"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0, timeout=60)
        response = client.completions.create(model="tiny-random", prompt=[5, 6, 7], max_tokens=3, temperature=0)
        assert len(response.choices[0].token_ids) == 3
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from TRTLLM_API_KEY
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        process.send_signal(signal.SIGINT)
        # uvicorn shuts down gracefully (the app's shutdown stops the executor), then re-raises the signal
        assert process.wait(timeout=60) in (0, -signal.SIGINT)
        time.sleep(0.2)  # let the reader thread drain the pipe
        rest = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        assert "Application shutdown complete" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
