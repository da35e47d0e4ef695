"""Probe of the Triton context kernel on the H200: the attention-layer sweep,
then whole forwards of the roofline's two context cases with flash and with Triton tiles.

    PYTHONPATH=. python benchmarks/gpu/context_probe.py OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu.forward import build_engine, time_forward
from benchmarks.gpu.kernels import attention_benchmarks
from benchmarks.replay.cost_model import ForwardShape
from benchmarks.gpu.common import BlockAllocator, model_shape, roofline
from tensorrt_llm._torch.attention_backend import kernels, paged
from tensorrt_llm._torch.attention_backend.triton_context import ContextConfig, context_attention_triton
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
device = torch.device("cuda")
t0 = time.perf_counter()
att = attention_benchmarks(device)
(out / "attention.json").write_text(json.dumps(att, indent=1))
for name, case in att.items():
    if isinstance(case, dict) and "triton_sweep" in case and "flops" in case:
        print(name, "flash", round(case["flash_varlen"]["tflops"]), "engine", round(case["engine_layer"]["tflops"]),
              "cudnn", round(case.get("cudnn_split", {}).get("tflops", 0)))
        for s in case["triton_sweep"]:
            print("  ", s["config"], round(s.get("tflops", 0)), s.get("rel_err_vs_flash"), s.get("error", ""))
print(f"attention done at {time.perf_counter() - t0:.0f} s", flush=True)

def flash(q, k, v, cu_q, cu_k, q_lens, k_lens, scale):
    return kernels.flash_varlen(q, k, v, cu_q, cu_k, q_lens, k_lens, scale)


def triton(config):
    return lambda q, k, v, cu_q, cu_k, q_lens, k_lens, scale: context_attention_triton(
        q, k, v, cu_q, cu_k, max(q_lens), scale, config=config)


# The context kernel of every layer's call (paged.py binds it by name), per variant.
variants = {"flash": flash}
for case_name in ("chunk_after_prefix", "prefill"):
    best = att[case_name].get("triton_best")
    if best:
        variants["triton_" + "_".join(map(str, best["config"]))] = triton(ContextConfig(*best["config"]))
default_kernel = paged.context_attention
model = LlamaForCausalLM(MODEL_PRESETS["mistral-nemo-12b-random"], device=device)
engine = build_engine(model, max_batch_size=8, max_num_tokens=8192, max_seq_len=32768, num_blocks=4096)
allocator = BlockAllocator(4096)
shapes = {"prefill_4096": ForwardShape(contexts=((4096, 0),)),
          "chunk_4096_after_16k": ForwardShape(contexts=((4096, 16384),)),
          "mixed_4_chunks": ForwardShape(contexts=((2048, 0), (512, 6000), (256, 300), (1024, 12000)))}
forwards = {}
for label, kernel in variants.items():
    paged.context_attention = kernel
    for name, shape in shapes.items():
        t = time_forward(engine, shape, allocator, graphs=False)
        floor = roofline(shape, model_shape(model.config))
        forwards[f"{label}/{name}"] = {**floor.report(t["device_ms"]), "timings": t}
        print(label, name, f"{t['device_ms']:.1f} ms", f"{100 * floor.ms / t['device_ms']:.1f}% of roofline", flush=True)
paged.context_attention = default_kernel
(out / "forwards.json").write_text(json.dumps(forwards, indent=1))
print(f"total {time.perf_counter() - t0:.0f} s")
