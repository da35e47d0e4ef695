"""Peak host memory while loading a Hugging Face checkpoint, against its bytes on disk.

    python -m benchmarks.model.hf_load_memory [--dir DIR] [--dtypes bfloat16,float32] [--shard-size 0]
        [--json OUT.json]

Writes (once; kept in ``--dir``) a random checkpoint of Llama-3.2-1B's shape (1.24B parameters,
bf16, tied embeddings: 2.47 GB) with a streaming safetensors writer of its own (one tensor in
memory at a time; one file by default, ``--shard-size`` bytes per shard otherwise), then loads it
in a fresh process with ``load_llama_from_hf`` on the CPU and reports::

    ratio = (peak RSS during the load - RSS before it) / tensor bytes on disk

Peak RSS is the kernel's high-water mark (``VmHWM``), reset just before the load
(``/proc/self/clear_refs``), so start-up does not count. Loaded in the file's own dtype (bfloat16)
the model itself is 1.0; the loader's extra is what the ratio adds: one tensor's mapped pages
at most (the largest, the embedding, is 21% of this checkpoint), released as soon as it is copied.
Loaded into another dtype (float32: the model is twice the file) the figure to read is the peak
over the model's own bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint, transformers' names and shapes."""
    hidden, inner, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inner, hidden), p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        })
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def write_checkpoint(directory: Path, config: dict, shard_size: int = 0) -> int:
    """Random bf16 weights, written tensor by tensor; returns the tensor bytes."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    names = sorted(shapes)
    nbytes = {n: 2 * _numel(shapes[n]) for n in names}
    shards, current, size = [], [], 0
    for name in names:
        if current and shard_size and size + nbytes[name] > shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes[name]
    shards.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in shard:
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes[name]]}
            offset += nbytes[name]
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned
        with open(directory / file, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for name in shard:  # one tensor in memory at a time
                shape = shapes[name]
                if len(shape) == 1:
                    tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
                else:
                    tensor = torch.randn(shape, generator=gen) * shape[1] ** -0.5
                out.write(tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
                weight_map[name] = file
    if len(shards) > 1:
        total = sum(nbytes.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sum(nbytes.values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _status(field: str) -> int:
    """A /proc/self/status value in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _warm_up(torch) -> None:
    """What any process pays once, before its first load: torch's copy kernels, the threads of a
    parallel copy, the model's modules' first use (about 15 MB here), so that the figure is the load's own."""
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM

    source = torch.frombuffer(bytearray(32 << 20), dtype=torch.bfloat16)
    torch.empty_like(source, dtype=torch.float32).copy_(source)
    torch.empty_like(source).copy_(source)
    LlamaForCausalLM(LlamaConfig(dtype="bfloat16"))  # a tiny model: the modules' first use


def measure(directory: str, dtype: str) -> dict:
    """In this (fresh) process: load ``directory`` and return the RSS figures."""
    import torch

    from tensorrt_llm._torch.models.checkpoints import load_llama_from_hf, read_hf_config
    from tensorrt_llm._torch.models.checkpoints.safetensors_reader import SafetensorsCheckpoint

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    config = read_hf_config(Path(directory), dtype=dtype).config
    disk = SafetensorsCheckpoint.from_directory(Path(directory)).nbytes
    _warm_up(torch)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark: start-up does not count
    before = _status("VmRSS")
    start = time.perf_counter()
    model = load_llama_from_hf(directory, config)
    seconds = time.perf_counter() - start
    peak, after = _status("VmHWM"), _status("VmRSS")
    # the parameters, and what the CPU's linear methods hold in place of the weights they replaced
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    model_bytes += model.linear_formats.held_bytes
    return {"dtype": dtype, "disk_bytes": disk, "model_bytes": model_bytes, "rss_before": before,
            "rss_peak": peak, "rss_after": after, "load_s": seconds,
            "peak_over_disk": (peak - before) / disk, "peak_over_model": (peak - before) / model_bytes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (kept); default: a temporary directory")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="the engine's dtypes (bfloat16: the file's own)")
    parser.add_argument("--shard-size", type=int, default=0, help="bytes per shard (0: one file)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # the child process
        print(json.dumps(measure(*args.measure)))
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(args.dir or scratch) / "llama-3.2-1b-random"
        if not (directory / "config.json").is_file():
            start = time.perf_counter()
            written = write_checkpoint(directory, LLAMA_3_2_1B, args.shard_size)
            print(f"wrote {written / 1e9:.2f} GB to {directory} in {time.perf_counter() - start:.0f} s", flush=True)
        runs = []
        for dtype in args.dtypes.split(","):
            out = subprocess.run([sys.executable, "-m", "benchmarks.model.hf_load_memory", "--measure", str(directory),
                                  dtype], capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(result)
            print(f"load as {dtype}: peak RSS +{(result['rss_peak'] - result['rss_before']) / 1e9:.2f} GB for "
                  f"{result['disk_bytes'] / 1e9:.2f} GB on disk = {result['peak_over_disk']:.3f}x "
                  f"({result['peak_over_model']:.3f}x the model's bytes), loaded in {result['load_s']:.1f} s", flush=True)
    report = {"config": {"model": "Llama-3.2-1B shape, random, bf16", "dtypes": args.dtypes, "shard_size": args.shard_size,
                         "parameters": sum(_numel(s) for s in tensor_shapes(LLAMA_3_2_1B).values())}, "results": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
