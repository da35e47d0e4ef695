"""The peer benchmark's checkpoint: Llama-3.1-8B's published ``config.json`` with random bf16
weights, written by transformers on the machine, served with SmolLM2's tokenizer.

    python -m benchmarks.gpu.peer_checkpoint --write DIR --tokenizer TOKDIR [--vocab model|tokenizer] [--dry-run]

Vocabulary (``--vocab``):

* ``model`` (the default): the published 128,256 rows. SmolLM2's tokenizer covers 49,152 of them;
  the other 79,104 ids decode to ``''`` (a padded vocabulary, ``docs/models.md``), so the LM head
  and the sampler do the real model's work.
* ``tokenizer``: 49,152 rows, the tokenizer's; :func:`vocab_statement` says how many bytes that
  takes off the LM head (read whole at every decode step) and off the step's weight bytes.

The LM head is shaped as a trained model's is, so that a client sees what it would see with the
real checkpoint (every client stamps TTFT and ITL at chunks that carry text, and a padded id
carries none): the rows past the tokenizer are zero (untrained padding), the others are drawn
with standard deviation ``REAL_LOGIT_STD / sqrt(hidden)``. After the final RMSNorm (weight 1) the
hidden state has norm ``sqrt(hidden)``, so a real token's logit is about ``N(0, REAL_LOGIT_STD^2)``
and a padded one's is 0: greedy decoding never picks a padded id and sampling at temperature 1
picks one with probability about :func:`padded_probability` (0.05% at 128,256 rows). The
benchmark measures the rate it actually sees (``peer_serving``). The arithmetic per step is the
same whatever the values: every row is multiplied and every row is sampled over.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from benchmarks.gpu.hf_checkpoints import MODELS, config_of

MODEL = "llama-3.1-8b"
#: the logits' spread a trained model's head gives real tokens (nats), see the module docstring
REAL_LOGIT_STD = 4.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BF16_BYTES = 2


def tokenizer_ids(tokenizer_dir: str | Path) -> int:
    """Ids the tokenizer has (its highest id + 1), read as the server reads it."""
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    return Tokenizer.from_hf_directory(tokenizer_dir).vocab_size


def checkpoint_config(vocab: str, tokenizer_size: int, dry_run: bool) -> dict:
    """Llama-3.1-8B's config.json (its layers scaled down on ``dry_run``, its vocabulary kept:
    the dry run checks the padded vocabulary too) with ``vocab_size`` for ``vocab``."""
    config = {**config_of(MODEL, dry_run), "vocab_size": MODELS[MODEL]["vocab_size"]}
    if vocab == "tokenizer":
        config["vocab_size"] = tokenizer_size
    elif vocab != "model":
        raise ValueError(f"vocab must be 'model' or 'tokenizer', got {vocab!r}")
    return config


def checkpoint_dir(base: str | Path, vocab: str, dry_run: bool) -> Path:
    return Path(base) / f"{MODEL}-peer-{vocab}-vocab{'-dry-run' if dry_run else ''}"


def decode_step_weight_bytes(config: dict) -> int:
    """bf16 bytes of the weights a decode step reads: every matrix but the embedding table (only
    the gathered rows of it), the LM head whole."""
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden  # + gate/up/down, two norms
    return BF16_BYTES * (layers * per_layer + hidden + config["vocab_size"] * hidden)


def vocab_statement(config: dict, tokenizer_size: int) -> dict:
    """What the vocabulary costs: LM-head rows and bytes, the ids that decode to '', and what
    serving the tokenizer's vocabulary instead takes off the LM head and off a decode step."""
    hidden, rows = config["hidden_size"], config["vocab_size"]
    full = {**config, "vocab_size": max(rows, tokenizer_size)}
    trimmed = {**config, "vocab_size": tokenizer_size}
    removed = BF16_BYTES * (full["vocab_size"] - tokenizer_size) * hidden
    return {
        "vocab_size": rows, "tokenizer_ids": tokenizer_size, "ids_decoding_to_empty": max(0, rows - tokenizer_size),
        "lm_head_bytes": BF16_BYTES * rows * hidden,
        "tokenizer_vocab_removes_lm_head_bytes": removed,
        "decode_step_weight_bytes": {"model_vocab": decode_step_weight_bytes(full),
                                     "tokenizer_vocab": decode_step_weight_bytes(trimmed)},
        "tokenizer_vocab_removes_share_of_decode_step_bytes": removed / decode_step_weight_bytes(full),
    }


def padded_probability(vocab_size: int, tokenizer_size: int, logit_std: float = REAL_LOGIT_STD) -> float:
    """Expected probability of sampling a padded id at temperature 1: padded logits are 0, real
    ones ``N(0, logit_std^2)``, whose exp has mean ``exp(logit_std^2 / 2)``."""
    padded = vocab_size - tokenizer_size
    return padded / (padded + tokenizer_size * math.exp(logit_std ** 2 / 2)) if padded > 0 else 0.0


def shape_lm_head_(weight, tokenizer_size: int, seed: int = 0) -> None:
    """In place, on ``weight`` (vocab, hidden): real rows ~ N(0, (REAL_LOGIT_STD/sqrt(hidden))^2),
    padded rows zero (module docstring)."""
    import torch

    hidden = weight.shape[1]
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    with torch.no_grad():
        real = torch.randn(weight[:tokenizer_size].shape, generator=generator, device=weight.device,
                           dtype=torch.float32)
        weight[:tokenizer_size].copy_(real * (REAL_LOGIT_STD / math.sqrt(hidden)))
        weight[tokenizer_size:].zero_()


def write_checkpoint(directory: Path, *, vocab: str, tokenizer_dir: Path, dry_run: bool) -> dict:
    """transformers writes the model (bf16, 5 GB shards; on the GPU unless ``dry_run``), its LM
    head shaped (:func:`shape_lm_head_`), the tokenizer's files beside it. Returns the config."""
    import torch
    import transformers

    size = tokenizer_ids(tokenizer_dir)
    config = checkpoint_config(vocab, size, dry_run)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("cpu" if dry_run else "cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    shape_lm_head_(model.lm_head.weight, min(size, config["vocab_size"]))
    model.save_pretrained(directory, max_shard_size="5GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, directory / name)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, required=True, metavar="DIR")
    parser.add_argument("--tokenizer", type=Path, required=True, metavar="TOKDIR")
    parser.add_argument("--vocab", choices=("model", "tokenizer"), default="model")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    config = write_checkpoint(args.write, vocab=args.vocab, tokenizer_dir=args.tokenizer, dry_run=args.dry_run)
    print(json.dumps({"vocab_size": config["vocab_size"], "directory": str(args.write)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
