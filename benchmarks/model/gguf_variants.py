"""The packaged SmolLM2-135M-Instruct GGUF file (Q4_1 linear layers, a Q8_0 embedding) rewritten with
its linear layers in another block format, for the CPU formats' benchmark and tests.

Every matrix of a linear layer is the packaged file's, dequantised and quantised again with
``gguf.quants.quantize`` in the stored layout (q/k rows stay in llama.cpp's order); the embedding,
the norms and every metadata key (tokenizer, chat template) are copied as they are. A variant is a
slightly different model from the packaged one (its values rounded again), so each is judged
against its own dequantised weights, never against the packaged file's::

    python -m benchmarks.model.gguf_variants --kinds Q8_0,Q4_0 --out DIR   # writes DIR/smollm2-135m-instruct.Q8_0.gguf, ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from tensorrt_llm._torch.models.checkpoints import packaged_checkpoint_path

MODEL = "smollm2-135m-instruct"
KINDS = ("Q8_0", "Q4_0", "Q4_1")
_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / "trtllm-gguf-variants"


def variant_path(kind: str, directory: Path | None = None) -> Path:
    """The file of ``kind`` (written on first use); Q4_1 is the packaged file itself."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    source = packaged_checkpoint_path(MODEL)
    if kind == "Q4_1":
        return source
    path = (directory or default_dir()) / f"{MODEL}.{kind}.gguf"
    if not path.is_file() or path.stat().st_mtime < source.stat().st_mtime:
        write_variant(source, path, kind)
    return path


def write_variant(source: Path, path: Path, kind: str) -> None:
    """``source`` with its linear layers' matrices re-quantised to ``kind`` (module docstring)."""
    qtype = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        linear = tensor.name.split(".")[-2] in _LINEAR and tensor.name.endswith(".weight")
        if linear and len(tensor.shape) == 2:
            shape = tuple(int(n) for n in reversed(tensor.shape))
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)
        else:  # as stored (the Q8_0 embedding, the F32 norms)
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="Q8_0,Q4_0")
    parser.add_argument("--out", type=Path, default=default_dir())
    args = parser.parse_args(argv)
    for kind in args.kinds.split(","):
        print(variant_path(kind, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
