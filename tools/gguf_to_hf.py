"""Write a GGUF checkpoint (llama architecture) out as a Hugging Face directory.

    python -m tools.gguf_to_hf --out DIR [--model smollm2-135m-instruct | PATH.gguf]
        [--dtype float32|bfloat16|float16] [--max-shard-size 2GB] [--tokenizer-only]

From the checkout. It writes::

    DIR/config.json              LlamaForCausalLM: sizes, RoPE base, norm epsilon, tying, dtype
    DIR/model.safetensors        the weights dequantised (q/k rows in transformers' rotate-half
                                 order), or shards + model.safetensors.index.json
    DIR/tokenizer.json           the byte-level BPE the server rebuilds from the GGUF metadata
    DIR/tokenizer_config.json    special tokens, the chat template (tokenizer_class
                                 PreTrainedTokenizerFast: transformers runs tokenizer.json as written)
    DIR/generation_config.json   bos, and every id the server stops at as eos

``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer`` load it; the
tokenizer encodes every text as the server's GGUF tokenizer does, and ``trtllm-serve DIR`` serves
the same logits as ``trtllm-serve smollm2-135m-instruct`` (float32, the default: dequantised values
are exact in it). ``--tokenizer-only`` writes the three tokenizer files alone: what a client needs
to count or render prompts for a model the server runs from a GGUF file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from tensorrt_llm._torch.models.checkpoints import (
    llama_config_from_gguf,
    llama_weights_from_gguf,
    open_gguf,
    packaged_checkpoint_path,
    PACKAGED_CHECKPOINTS,
)
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm.llmapi.tokenizer import Tokenizer

logger = logging.getLogger("gguf_to_hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def export(gguf: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "float32",
           max_shard_bytes: int | None = None, tokenizer_only: bool = False) -> Path:
    """Write ``gguf`` (a path or a packaged name) as a Hugging Face directory ``out``; returns it."""
    path = packaged_checkpoint_path(os.fspath(gguf)) if os.fspath(gguf) in PACKAGED_CHECKPOINTS else Path(gguf)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = open_gguf(path)
    config = llama_config_from_gguf(checkpoint, dtype="float32")
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    write_tokenizer(checkpoint.metadata, tokenizer, out, context_length=config.max_position_embeddings)
    if not tokenizer_only:
        write_json(out / "config.json", hf_config(config, tokenizer, dtype))
        write_json(out / "generation_config.json", {
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": list(_stop_ids(tokenizer)),
            "transformers_version": _transformers_version()})
        weights = llama_weights_from_gguf(checkpoint, config)
        write_safetensors({name: tensor.to(DTYPES[dtype]) for name, tensor in weights.items()}, out, max_shard_bytes)
    logger.info("wrote %s from %s", out, path.name)
    return out


def hf_config(config: LlamaConfig, tokenizer: Tokenizer, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": dtype,
        "transformers_version": _transformers_version(),
    }


def write_tokenizer(metadata, tokenizer: Tokenizer, out: Path, *, context_length: int) -> None:
    """tokenizer.json (the pipeline the server runs) and tokenizer_config.json (special tokens, template)."""
    tokenizer._tokenizer.save(str(out / "tokenizer.json"))
    added = tokenizer._tokenizer.get_added_tokens_decoder()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(added.items())},
    }
    for name, key in _GGUF_SPECIALS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and tokenizer.id_to_token(int(token_id)) is not None:
            config[name] = tokenizer.id_to_token(int(token_id))
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    write_json(out / "tokenizer_config.json", config)


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    """One ``model.safetensors``, or shards of at most ``max_shard_bytes`` and their index."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file({n: tensors[n].contiguous() for n in names}, out / "model.safetensors", metadata={"format": "pt"})
        return
    shards, current, size = [], [], 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The eos id first (what transformers stops at first), then every other id the server stops at."""
    first = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return first + tuple(i for i in tokenizer.stop_token_ids if i not in first)


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "4.45.0"
    return transformers.__version__


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a packaged GGUF name, or a path to a .gguf file")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default=None, help="e.g. 2GB: shards and an index (default: one file)")
    parser.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer files alone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    shard = _parse_size(args.max_shard_size) if args.max_shard_size else None
    out = export(args.model, args.out, dtype=args.dtype, max_shard_bytes=shard, tokenizer_only=args.tokenizer_only)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
