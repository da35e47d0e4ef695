"""SmolLM2 on the GPU, as a user meets it: perplexity in each dtype, then chat through `trtllm-serve`.

    python -m benchmarks.gpu.smollm2 --out DIR [--model smollm2-135m-instruct | PATH.gguf]

1. Perplexity on ``benchmarks.model.perplexity``'s paragraphs (the model's no-cache forward, log-softmax
   in float64): float32 on the CPU (the reference), then float32 and bfloat16 on the GPU. The
   bfloat16 model is the one ``trtllm-serve`` serves there by default; it must stay within 2% of
   the float32 reference.
2. ``trtllm-serve MODEL`` with its defaults (``--device auto``: the GPU, bfloat16), driven by the
   ``openai`` client: a chat completion, a streamed chat completion and a text completion.

``DIR/smollm2.json`` holds the numbers and the answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import openai
import torch

from benchmarks.model.perplexity import paragraph_ids, perplexity
from benchmarks.serving.soak import ServerProcess
from tensorrt_llm.llmapi.llm_utils import load_model

QUESTION = "What is the capital of France? Answer in one sentence."


def perplexities(model_name: str) -> dict:
    results = {}
    for label, device, dtype in (("cpu float32", "cpu", "float32"), ("cuda float32", "cuda", "float32"),
                                 ("cuda bfloat16", "cuda", "bfloat16")):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        loaded = load_model(model_name, dtype=dtype, device=device)
        began = time.perf_counter()
        results[label] = perplexity(loaded.model, paragraph_ids(loaded.tokenizer))
        print(f"perplexity {label}: {results[label]:.4f} ({time.perf_counter() - began:.1f} s)", flush=True)
        del loaded
    reference = results["cpu float32"]
    return {"perplexity": results,
            "relative_to_cpu_float32": {k: v / reference - 1 for k, v in results.items()}}


def chat(model_name: str, out: Path) -> dict:
    server = ServerProcess([model_name], out / "smollm2_server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=32, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0, stream=True)
            if chunk.choices)
        completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0)
        start_line = next((line.strip() for line in server.log_path.read_text().splitlines() if " on cuda" in line), None)
        result = {"model": model, "start_up": start_line, "chat": answer.choices[0].message.content,
                  "chat_streamed": streamed, "streamed_equals_whole": streamed == answer.choices[0].message.content,
                  "completion": completion.choices[0].text, "usage": answer.usage.model_dump()}
        print(json.dumps(result, indent=2), flush=True)
        return result
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the packaged name, or a path to the .gguf file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {"model": args.model, **perplexities(args.model)}
    document["within_2_percent"] = abs(document["relative_to_cpu_float32"].get("cuda bfloat16", 0.0)) <= 0.02
    document["serving"] = chat(args.model, out)
    (out / "smollm2.json").write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
