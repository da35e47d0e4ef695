"""``trtllm-serve DIR``: a Hugging Face checkpoint directory served by the real command.

A tiny random Llama with SmolLM2's tokenizer files (``tools/gguf_to_hf --tokenizer-only``): the
served id is the directory's name, text prompts are encoded with ``tokenizer.json`` and chats
rendered with the directory's template.
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

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tools.gguf_to_hf import export

    directory = tmp_path_factory.mktemp("serve") / "tiny-chat-llama"
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    export("smollm2-135m-instruct", directory, tokenizer_only=True)
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
