"""Where the host's time goes when it launches an eager mixed forward on the H200 (Nemo preset):
small mixed forwards ran at ~4x their roofline in the replay with the Triton context kernel (44 ms against
12 ms; ``benchmarks/results/h200/serving/README.md``).

    PYTHONPATH=. python benchmarks/gpu/eager_host_probe.py OUT_DIR

For a few mixed shapes, eager and replayed piecewise (``piecewise_cuda_graph``): the host's time
to launch the forward (call to return of ``launch``) and its device time, then a torch.profiler
trace of one eager launch: the ops by host time.
"""

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu.forward import build_engine
from benchmarks.replay.cost_model import ForwardShape
from benchmarks.gpu.common import BlockAllocator, synthetic_inputs
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS, LlamaForCausalLM

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
model = LlamaForCausalLM(MODEL_PRESETS["mistral-nemo-12b-random"], device=torch.device("cuda"))
engine = build_engine(model, max_batch_size=64, max_num_tokens=8192, max_seq_len=32768, num_blocks=4096)
allocator = BlockAllocator(4096)
tpb = engine.kv_cache_manager.tokens_per_block
shapes = {"chunk 90 + 10 decodes": ForwardShape(contexts=((90, 300),), decodes=((1, 2047),) * 10),
          "chunk 500 + 10 decodes": ForwardShape(contexts=((500, 1000),), decodes=((1, 2047),) * 10),
          "10 decodes, eager": ForwardShape(decodes=((1, 2047),) * 10)}
result = {}
piecewise = engine.piecewise_runner
engine.graph_runner = None  # the decode-only shape must not take the decode graphs
for mode in ("eager", "piecewise"):
    engine.piecewise_runner = piecewise if mode == "piecewise" else None
    for name, shape in shapes.items():
        inputs = synthetic_inputs(shape, allocator, tpb, engine.vocab_size)
        host, device = [], []
        for i in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = engine.launch(inputs)
            host.append((time.perf_counter() - t0) * 1e3)
            pending.result()
            device.append(pending.device_time_ms())
        result[f"{mode}: {name}"] = {"launch_host_ms": sorted(host)[4], "device_ms": sorted(device)[4]}
        print(mode, name, result[f"{mode}: {name}"], flush=True)
        if mode == "eager" and name.startswith("chunk 90"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.launch(inputs).result()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (out / "profile.txt").write_text(table)
(out / "eager_host.json").write_text(json.dumps(result, indent=1))
