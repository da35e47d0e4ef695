"""Hugging Face checkpoints of 8B shape on a GPU: write them with transformers, serve them with
``trtllm-serve <dir>``, record load time and GPU memory, replay the default scenario at 1x.

    python -m benchmarks.gpu.hf_checkpoints --out DIR [--models llama-3.1-8b,qwen3-8b]
        [--checkpoints /tmp/hf_checkpoints] [--num-requests N] [--dry-run]

For each model (``MODELS``: Llama-3.1-8B's and Qwen3-8B's published config.json, random weights):

1. write the checkpoint in a child process with transformers (``from_config`` on the GPU, bf16,
   ``save_pretrained(max_shard_size="5GB")``), unless ``--checkpoints`` already holds it;
2. ``trtllm-serve <dir> --extra_llm_api_options DIR/serve.yaml`` (the replay's setting: a 4096-token
   budget, chunked prefill, block and partial reuse, a 2.5 GiB host tier, ``recheck``; the rest
   default: the config's bf16, CUDA graphs, overlap); the time to ``/health`` 200, the loader's own
   time (its log line), the start-up line (dtype, KV pool, max_seq_len) and the GPU's memory in use
   (``nvidia-smi``) once it serves;
3. ``python -m benchmarks.serving.replay --url ...`` on the default scenario at 1x (token-id prompts);
4. (server stopped) the engine's model and transformers' model of the same directory, both bf16 on
   the device, on the same 128 tokens: the largest logit difference and how often the argmax agrees.

``DIR/hf_checkpoints.json`` holds every number; ``DIR/<model>/`` the server log and the replay's
JSON. Preconditions are checked first and the run stops at the first that fails (no GPU, a module
missing, too little disk or GPU memory), as it stops when a server does not come up.
``--dry-run`` runs the same steps on the CPU with both configs scaled down (checks the script
where there is no GPU).

On the H200 (fastapi, uvicorn and openai as wheels, carried in ``.whl``), one model per device
call (each takes a few minutes)::

    bash benchmarks/gpu/h200_runs.sh hf-checkpoints OUT llama-3.1-8b
    bash benchmarks/gpu/h200_runs.sh hf-checkpoints OUT qwen3-8b
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: config.json of the published checkpoints (sizes, RoPE, tying), random weights here
MODELS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 36, "bos_token_id": 151643, "eos_token_id": 151645,
    },
}
#: --dry-run: the same configs scaled down (CPU, seconds)
DRY_RUN_SIZES = {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
SERVE_OPTIONS = {  # the replay's setting (benchmarks.replay.settings' defaults), as earlier serving runs
    "max_num_tokens": 4096, "max_batch_size": 64, "enable_chunked_prefill": True, "token_budget_policy": "recheck",
    "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True, "enable_partial_reuse": True,
                        "host_cache_size": 2684354560},
}
_LOADED = re.compile(r"loaded (\S+) \((\d+) tensors, ([\d.]+) GB on disk\) as (\S+) on (\S+) in ([\d.]+) s")
_START = re.compile(r"INFO tensorrt_llm\.llmapi\.llm: (model .*)")


def preconditions(args, models: list[str]) -> list[str]:
    """What stops the run before it starts (empty: go)."""
    problems = []
    needed = ["torch", "transformers", "safetensors", "huggingface_hub", "fastapi", "uvicorn", "openai", "httpx"]
    problems += [f"python module {name} is missing" for name in needed if importlib.util.find_spec(name) is None]
    if problems:
        return problems
    import torch

    if not args.dry_run:
        if not torch.cuda.is_available():
            return ["no CUDA GPU (use --dry-run to check the script on the CPU)"]
        free, _ = torch.cuda.mem_get_info()
        if free < 40e9:
            problems.append(f"only {free / 1e9:.1f} GB free on the GPU; an 8B model in bf16 needs 16 GB and its KV pool more")
    missing = [m for m in models if not (Path(args.checkpoints) / m / "config.json").is_file()]
    Path(args.checkpoints).mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(args.checkpoints).free
    if missing and not args.dry_run and disk < 20e9 * len(missing):
        problems.append(f"{disk / 1e9:.0f} GB free in {args.checkpoints}; {len(missing)} checkpoints of ~17 GB to write")
    return problems


def config_of(name: str, dry_run: bool) -> dict:
    config = dict(MODELS[name])
    if dry_run:
        config.update(DRY_RUN_SIZES, max_position_embeddings=min(config["max_position_embeddings"], 16384))
    return config


def write_checkpoint(name: str, directory: Path, dry_run: bool) -> None:
    """(In a child process) transformers writes ``name``'s config with random bf16 weights."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in config_of(name, dry_run).items()})
    device = "cpu" if dry_run else "cuda"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="5GB")


def gpu_memory_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True)
        return float(out.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_against_transformers(directory: str, dry_run: bool) -> dict:
    """(In a child process) both models of ``directory`` in bf16 on the device, one forward each."""
    import torch
    import transformers

    from tensorrt_llm._torch.models.checkpoints import load_llama_from_hf, read_hf_config

    device = "cpu" if dry_run else "cuda"
    config = read_hf_config(Path(directory), dtype="bfloat16").config
    ids = torch.randint(0, config.vocab_size, (128,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_llama_from_hf(directory, config, device=device).forward_full(ids.to(device)).float().cpu()
        torch.cuda.empty_cache() if device == "cuda" else None
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device)
        theirs = reference(ids[None].to(device)).logits[0].float().cpu()
    return {"tokens": 128, "max_abs_logit_diff": (ours - theirs).abs().max().item(),
            "mean_abs_logit_diff": (ours - theirs).abs().mean().item(), "max_abs_logit": theirs.abs().max().item(),
            "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


def run_model(name: str, args, out: Path) -> dict:
    from benchmarks.serving.soak import ServerProcess

    directory = Path(args.checkpoints) / (name + ("-dry-run" if args.dry_run else ""))
    record: dict = {"model": name, "checkpoint": str(directory), "config": config_of(name, args.dry_run)}
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    if not (directory / "config.json").is_file():
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.gpu.hf_checkpoints", "--write", name, str(directory),
                        *(["--dry-run"] if args.dry_run else [])], check=True)
        record["write_s"] = time.perf_counter() - began
        print(f"{name}: wrote {directory} in {record['write_s']:.0f} s", flush=True)
    record["disk_gb"] = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 1e9
    options = work / "serve.yaml"
    options.write_text(json.dumps(SERVE_OPTIONS))  # JSON is YAML
    serve = [str(directory), "--extra_llm_api_options", str(options), "--max_queue_size", "128",
             "--device", "cpu" if args.dry_run else "cuda"]
    before = gpu_memory_used_mib()
    began = time.perf_counter()
    try:
        server = ServerProcess(serve, work / "server.log", start_timeout_s=900)
    except RuntimeError as error:
        record["error"] = f"the server did not come up: {error}"
        return record
    record["start_to_health_s"] = time.perf_counter() - began
    try:
        log = (work / "server.log").read_text()
        loaded = _LOADED.search(log)
        if loaded:
            record["loader"] = {"tensors": int(loaded.group(2)), "gb_on_disk": float(loaded.group(3)),
                                "dtype": loaded.group(4), "device": loaded.group(5), "load_s": float(loaded.group(6))}
        start = _START.search(log)
        record["start_up_line"] = start and start.group(1)
        after = gpu_memory_used_mib()
        record["gpu_memory_used_mib"] = {"before": before, "serving": after}
        replay = [sys.executable, "-m", "benchmarks.serving.replay", "--url", server.url, "--json",
                  str(work / "serve_replay_1x.json"), "--time-scale", "1"]
        if args.num_requests:
            replay += ["--num-requests", str(args.num_requests)]
        if args.dry_run:
            replay += ["--max-output-tokens", "4"]
        began = time.perf_counter()
        done = subprocess.run(replay, capture_output=True, text=True)
        (work / "serve_replay.log").write_text(done.stdout + done.stderr)
        record["replay_wall_s"] = time.perf_counter() - began
        if done.returncode != 0:
            record["error"] = f"serve_replay exited {done.returncode}; see {work / 'serve_replay.log'}"
        else:
            record["replay_1x"] = json.loads((work / "serve_replay_1x.json").read_text())["result"]
    finally:
        record["server_exit"] = server.stop()
    check = subprocess.run([sys.executable, "-m", "benchmarks.gpu.hf_checkpoints", "--check", str(directory),
                            *(["--dry-run"] if args.dry_run else [])], capture_output=True, text=True)
    if check.returncode == 0:
        record["transformers_check"] = json.loads(check.stdout.strip().splitlines()[-1])
    else:
        record["transformers_check"] = {"error": check.stderr[-2000:]}
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results directory")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--checkpoints", default="/tmp/hf_checkpoints", help="where the checkpoints are written (kept)")
    parser.add_argument("--num-requests", type=int, default=None, help="replay only the scenario's first N requests")
    parser.add_argument("--dry-run", action="store_true", help="scaled-down configs on the CPU")
    parser.add_argument("--write", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--check", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write:
        write_checkpoint(args.write[0], Path(args.write[1]), args.dry_run)
        return 0
    if args.check:
        print(json.dumps(check_against_transformers(args.check, args.dry_run)))
        return 0
    if not args.out:
        parser.error("--out is required")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = preconditions(args, models)
    report = {"argv": sys.argv[1:], "dry_run": args.dry_run, "preconditions": problems or "ok", "models": {}}
    path = out / "hf_checkpoints.json"
    if problems:
        path.write_text(json.dumps(report, indent=2))
        print("stopping: " + "; ".join(problems), file=sys.stderr)
        return 2
    import torch

    report["torch"] = torch.__version__
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu"
    for name in models:
        record = run_model(name, args, out)
        report["models"][name] = record
        path.write_text(json.dumps(report, indent=2))
        if "error" in record:
            print(f"{name}: {record['error']}; stopping", file=sys.stderr)
            return 1
        result = record["replay_1x"]
        print(f"{name}: health in {record['start_to_health_s']:.0f} s (loader {record.get('loader', {}).get('load_s')} s),"
              f" GPU {record['gpu_memory_used_mib']['serving']} MiB; replay 1x: {result['completed']}/{result['requests']}"
              f" completed, TTFT p50 {result['ttft_ms']['p50']:.0f} ms, ITL p50 {result['itl_ms']['p50']:.1f} ms,"
              f" {result['output_tokens_per_s']:.0f} out tok/s; against transformers: {record['transformers_check']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
