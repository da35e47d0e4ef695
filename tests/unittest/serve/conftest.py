"""Fixtures: one real server per configuration and module (see ``server_harness``)."""

from __future__ import annotations

import pytest
from tests.helpers.server_harness import RunningServer

from tensorrt_llm.llmapi import LLM, KvCacheConfig


@pytest.fixture(scope="module")
def tiny_server(one_torch_thread):
    """tiny-random, float64 (greedy outputs do not depend on the batch), chunked prefill, block reuse."""
    llm = LLM("tiny-random", dtype="float64", max_seq_len=256, max_num_tokens=128, max_batch_size=16,
              enable_chunked_prefill=True, iter_stats_max_iterations=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=256))
    server = RunningServer(llm)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server():
    """SmolLM2-135M-Instruct, dequantized (``float16-weights``: float32 activations, which the
    logprob tests' float64 tolerance is set for; the CPU default keeps the file's blocks with
    bfloat16 activations: docs/cpu-decode.md), with its tokenizer and chat template. Block reuse is
    off and the tests send one request at a time, so equal requests run the same arithmetic (a
    reused prefix would change the shapes, and float32 rounding with them)."""
    llm = LLM("smollm2-135m-instruct", quantization="none", max_seq_len=1024, max_num_tokens=512,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128, enable_block_reuse=False))
    server = RunningServer(llm)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_tokenizer_checkpoint(tmp_path_factory):
    """A Hugging Face checkpoint directory with SmolLM2's tokenizer files (written from the packaged
    GGUF by ``tools.gguf_to_hf``) and a tiny random Llama of its vocabulary, written by transformers.

    For tests where the text a model writes is scripted (``tests.helpers.scripted``) and the model
    only has to be fast: the tokenizer, the chat template path, the server and the grammar are
    SmolLM2's own, the forward costs a few milliseconds instead of SmolLM2's."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tools.gguf_to_hf import export

    directory = export("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2-tokenizer-tiny"), tokenizer_only=True)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_chat_server(smollm2_tokenizer_checkpoint):
    """SmolLM2's tokenizer and chat template over a tiny random model (``smollm2_tokenizer_checkpoint``):
    the whole request path of a chat model, text in and out, at a few milliseconds a forward. For
    tests of the protocol, not of what a model writes. Batch-invariant: its float32 logits are
    near-uniform (all near ln(1/49152)), so tests that compare a prompt alone with the same prompt
    in a batch need the same bits, which only the mode guarantees on every CPU."""
    llm = LLM(str(smollm2_tokenizer_checkpoint), max_seq_len=1024, max_num_tokens=512, batch_invariant=True,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=128))
    server = RunningServer(llm)
    yield server
    server.stop()
