"""Structured output with SmolLM2 on the CPU: how often the output validates, and what the grammar costs.

    python -m benchmarks.serving.structured_output [--num-schemas 200] [--concurrency 8] [--seed 0] [--json OUT.json]

``--num-schemas`` random JSON schemas (``benchmarks.serving.json_schemas``, seeded) go to an ``LLM`` in
waves of ``--concurrency`` chat requests with ``guided_decoding``; each output is parsed and
validated (``jsonschema``). Validity rate = outputs that parse, validate and ended by the grammar's
end token / schemas.

Cost, two ways, both as ratios (the machine is shared: absolute CPU times are not comparable
from one run to the next, a ratio measured alternately in the same run is):

* ``end_to_end_ratio``: each guided wave is followed by an unguided wave of the same prompts,
  each forced (``ignore_eos``) to generate exactly as many tokens as its guided twin did, so the
  forwards are the same shapes; ratio = guided seconds per generated token / unguided seconds
  per generated token, over all waves. It includes everything a guided token costs: the logits
  row brought to the host in float64, the mask, the draw, and no overlap for that request.
* ``mask_ratio``: the grammar work alone, replayed over the guided outputs (a fresh matcher per
  output: mask, then accept, per token), in seconds per token, over the unguided seconds per
  generated token.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from jsonschema import ValidationError, validate

from benchmarks.serving.json_schemas import max_output_bytes, random_schema, schema_prompt
from tensorrt_llm.llmapi import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams

MODEL = "smollm2-135m-instruct"


def _valid(text: str, schema: dict, finish_reason: str) -> bool:
    try:
        validate(json.loads(text), schema)
    except (json.JSONDecodeError, ValidationError):
        return False
    return finish_reason == "stop"


def run(num_schemas: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(num_schemas)]
    llm = LLM(MODEL, max_seq_len=1024, max_num_tokens=2048, max_batch_size=concurrency,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=512, enable_block_reuse=False))
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(schema_prompt(s), add_generation_prompt=True))
               for s in schemas]
    valid, guided_s, unguided_s, tokens, outputs = 0, 0.0, 0.0, 0, []
    try:
        for start in range(0, num_schemas, concurrency):
            wave = range(start, min(start + concurrency, num_schemas))
            began = time.perf_counter()
            handles = [llm.generate_async(prompts[i], SamplingParams(
                max_tokens=max_output_bytes(schemas[i]) + 1, guided_decoding=GuidedDecodingParams(json=schemas[i])))
                for i in wave]
            results = [h.result().outputs[0] for h in handles]
            guided_s += time.perf_counter() - began
            valid += sum(_valid(r.text, schemas[i], r.finish_reason) for i, r in zip(wave, results))
            outputs += [(schemas[i], r.token_ids) for i, r in zip(wave, results)]
            began = time.perf_counter()
            twins = [llm.generate_async(prompts[i], SamplingParams(max_tokens=len(r.token_ids), ignore_eos=True))
                     for i, r in zip(wave, results)]
            for twin, result in zip(twins, results):
                assert len(twin.result().outputs[0].token_ids) == len(result.token_ids)
            unguided_s += time.perf_counter() - began
            tokens += sum(len(r.token_ids) for r in results)
            print(f"{wave.stop}/{num_schemas} schemas: {valid} valid; guided {guided_s / tokens * 1e3:.1f} ms/token,"
                  f" unguided {unguided_s / tokens * 1e3:.1f} ms/token", flush=True)
        mask_s = _replay_masks(llm, outputs)
    finally:
        llm.shutdown()
    per_token_unguided = unguided_s / tokens
    return {
        "schemas": num_schemas,
        "valid": valid,
        "validity_rate": valid / num_schemas,
        "generated_tokens": tokens,
        "guided_ms_per_token": guided_s / tokens * 1e3,
        "unguided_ms_per_token": per_token_unguided * 1e3,
        "end_to_end_ratio": guided_s / unguided_s,
        "mask_ms_per_token": mask_s / tokens * 1e3,
        "mask_ratio": mask_s / tokens / per_token_unguided,
    }


def _replay_masks(llm: LLM, outputs: list[tuple[dict, list[int]]]) -> float:
    """Seconds the matchers spend on ``outputs``' tokens (mask then accept, each token)."""
    logits = torch.zeros(llm.model_config.vocab_size, dtype=torch.float64)
    total = 0.0
    for schema, token_ids in outputs:
        matcher = llm.compile_grammar(GuidedDecodingParams(json=schema)).matcher()
        began = time.perf_counter()
        for token in token_ids:
            matcher.fill_mask(logits)
            matcher.accept(token)
        total += time.perf_counter() - began
        logits.zero_()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-schemas", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {"model": MODEL, "num_schemas": args.num_schemas, "concurrency": args.concurrency, "seed": args.seed,
              "device": "cpu", "torch_threads": 1, "grammar_library": "llguidance"}
    result = run(args.num_schemas, args.concurrency, args.seed)
    print(json.dumps(result, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump({"config": config, "result": result}, out, indent=2)


if __name__ == "__main__":
    main()
