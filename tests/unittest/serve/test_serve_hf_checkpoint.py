"""``trtllm-serve DIR``: a Hugging Face checkpoint directory served by the real command.

A tiny random Llama with SmolLM2's tokenizer files (``tools/gguf_to_hf --tokenizer-only``): the
served id is the directory's name, text prompts are encoded with ``tokenizer.json`` and chats
rendered with the directory's template.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer_checkpoint):
    """The shared tiny SmolLM2-tokenizer checkpoint, copied under a name of its own, with a
    generation_config.json whose eos ids and temperature the server must apply."""
    directory = tmp_path_factory.mktemp("serve") / "tiny-chat-llama"
    shutil.copytree(smollm2_tokenizer_checkpoint, directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "temperature": 0.7}))
    return directory


def test_the_command_serves_a_checkpoint_directory(checkpoint):
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorrt_llm.commands.serve", str(checkpoint), "--port", "0", "--device", "cpu",
         "--max_seq_len", "256", "--kv_cache_config.num_blocks", "64"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    seen = []
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            match = re.search(r"serving tiny-chat-llama at (http://127\.0\.0\.1:\d+)", seen[-1])
            url = match and match.group(1)
        assert url, "the server did not report its address:\n" + "".join(seen[-20:])
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-chat-llama"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny-chat-llama", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
        # SmolLM2's template adds its default system turn: the prompt is longer than the question
        assert chat.usage.prompt_tokens > 20
        text = client.completions.create(model="tiny-chat-llama", prompt="Once upon a time", max_tokens=3, temperature=0)
        assert text.usage.prompt_tokens == 4 and isinstance(text.choices[0].text, str)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) in (0, -signal.SIGINT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def greedy_bos_checkpoint(checkpoint, tmp_path_factory):
    """The same checkpoint whose tokenizer adds a BOS (``add_bos_token``), whose template writes
    one itself, and whose ``generation_config.json`` asks for greedy decoding."""
    import shutil

    directory = tmp_path_factory.mktemp("greedy") / "greedy-llama"
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, bos_token="<|endoftext|>",
                  chat_template="{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0}))
    return directory


def test_a_chat_gets_one_bos_and_unset_fields_take_the_generation_config(greedy_bos_checkpoint):
    from tensorrt_llm.llmapi import LLM

    from tests.helpers.server_harness import RunningServer

    llm = LLM(str(greedy_bos_checkpoint), device="cpu", max_seq_len=256,
              kv_cache_config={"num_blocks": 64, "tokens_per_block": 16})
    server = RunningServer(llm)
    try:
        tokenizer = llm.tokenizer
        assert tokenizer.add_bos_token and tokenizer.encode("Hi")[0] == tokenizer.bos_token_id
        messages = [{"role": "user", "content": "Hi"}]
        rendered = tokenizer.apply_chat_template(messages)
        client = server.client()
        chat = client.chat.completions.create(model=server.model, max_tokens=2, messages=messages)
        # the template's own BOS only: the text encoded without special tokens on top
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        # no temperature in the request: generation_config.json's 0.0, so any seed gives the greedy text
        unset = {client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8,
                                           seed=seed).choices[0].text for seed in range(3)}
        sampled = {client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8,
                                             seed=seed, temperature=1.0).choices[0].text for seed in range(3)}
        assert len(unset) == 1 and len(sampled) > 1
    finally:
        server.stop()
