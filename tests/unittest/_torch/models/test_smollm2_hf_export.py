"""Real weights through the Hugging Face path: SmolLM2-135M-Instruct from the packaged GGUF file,
written out by ``tools/gguf_to_hf`` (float32, sharded), then

* served from the directory, it is the GGUF model: the same logits bit for bit, the same
  tokenizer, stop ids and chat template, the same greedy text;
* transformers, running the same directory, scores the same perplexity on
  ``benchmarks.model.perplexity``'s paragraphs (within 0.5%; in practice ~1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.model.perplexity import PARAGRAPHS, paragraph_ids, perplexity
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_utils import load_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tools.gguf_to_hf import export

    return export(MODEL, tmp_path_factory.mktemp("export") / "SmolLM2-135M-Instruct", max_shard_bytes=200 * 10**6)


@pytest.fixture(scope="module")
def both(exported):
    return load_model(exported, dtype="float32"), load_model(MODEL, dtype="float32")


def test_the_directory_is_a_sharded_hugging_face_checkpoint(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and "lm_head.weight" not in index["weight_map"]
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_served_from_the_directory_it_is_the_gguf_model(both, exported):
    hf, gguf = both
    assert hf.model_id == "SmolLM2-135M-Instruct"
    assert hf.model.config == gguf.model.config
    assert hf.tokenizer.stop_token_ids == gguf.tokenizer.stop_token_ids == (0, 2)
    assert hf.tokenizer.chat_template == gguf.tokenizer.chat_template
    for paragraph in PARAGRAPHS:
        ids = torch.tensor(gguf.tokenizer.encode(paragraph))
        assert hf.tokenizer.encode(paragraph) == ids.tolist()
        with torch.no_grad():
            assert torch.equal(hf.model.forward_full(ids), gguf.model.forward_full(ids))


def test_served_text_is_the_gguf_models_text(exported):
    """Through LLM in the CPU default (float16-weights): greedy answers equal, word for word."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    options = dict(kv_cache_config=KvCacheConfig(num_blocks=64), max_num_tokens=256)
    answers = []
    for model in (MODEL, str(exported)):
        with LLM(model, **options) as llm:
            prompt = llm.tokenizer.apply_chat_template(question)
            answers.append(llm.generate(prompt, SamplingParams(max_tokens=24)).text)
    assert answers[0] == answers[1] and "Paris" in answers[0]


def test_transformers_scores_the_engines_perplexity(both, exported):
    transformers = pytest.importorskip("transformers")
    hf, _ = both
    ours = perplexity(hf.model, paragraph_ids(hf.tokenizer))
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for paragraph in PARAGRAPHS:
            ids = tokenizer(paragraph, return_tensors="pt")["input_ids"]  # (1, L)
            log_probs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)  # (L-1, vocab)
            nll -= float(log_probs.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    theirs = torch.tensor(nll / count).exp().item()
    print(f"perplexity on {count} tokens: engine {ours:.4f}, transformers {theirs:.4f} "
          f"(relative difference {abs(ours / theirs - 1):.2e})")
    assert abs(ours / theirs - 1) < 0.005
