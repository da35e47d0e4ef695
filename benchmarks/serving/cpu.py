"""``trtllm-serve`` with its defaults (SmolLM2 on the CPU) under chat traffic at 1, 4 and 16 users.

    python -m benchmarks.serving.cpu [--users 1,4,16] [--conversations 16] [--turns 3]
        [--output-len 48] [--json OUT.json] [-- extra trtllm-serve flags]

The traffic is chat-like: ``--conversations`` conversations, all under one system prompt, each of
``--turns`` turns; the prompt of turn k is the chat template over the system prompt, the first
k user messages and k - 1 answers (canned text: the trace cannot know what the model will say),
so the system prompt and every conversation's history reach the server as shared prefixes. The
requests are written as a ``trtllm``-format trace (token ids), turn by turn, and replayed by
``benchmarks.serving.replay --concurrency N``: N users in a closed loop.

The server is ``python -m tensorrt_llm.commands.serve smollm2-135m-instruct --port 0`` plus
whatever follows ``--``, started through this module's probe (``--probe FILE``), which times the
executor's iterations that ran a forward and the engine's forwards inside them (class-level
wrappers installed before the server starts; nothing else changes) and writes the running totals
to FILE. The share of a step outside the forward is ``1 - forward / step`` over each run:
scheduling, KV preparation, sampling, detokenising and answering, and the Python between them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are a helpful assistant for a small public library. Answer questions about opening hours, "
          "borrowing rules, events and local history clearly and briefly, in plain English. If you do not "
          "know the answer, say so and suggest asking a librarian at the front desk.")
ANSWER = ("Thank you for asking. The library can help with that: most services are free for members, and the "
          "staff at the front desk will gladly explain the details and show you where to find what you need.")


# --------------------------------------------------------------------------- the probe (server side)


def run_probe(path: str, serve_argv: list[str]) -> int:
    """Start trtllm-serve with its executor's forward-running iterations and its engine's forwards timed."""
    from tensorrt_llm._torch.pyexecutor.engine.torch_engine import TorchModelEngine
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
    from tensorrt_llm.commands import serve

    totals = {"forward_s": 0.0, "step_s": 0.0, "steps": 0, "forwards": 0}
    run, step = TorchModelEngine._run, PyExecutor.step

    def timed_run(self, inputs):
        start = time.perf_counter()
        try:
            return run(self, inputs)
        finally:
            totals["forward_s"] += time.perf_counter() - start
            totals["forwards"] += 1

    def timed_step(self):
        start = time.perf_counter()
        iteration = step(self)
        if iteration is not None and iteration.launch.forward_tokens > 0:
            totals["step_s"] += time.perf_counter() - start
            totals["steps"] += 1
            Path(path).write_text(json.dumps(totals))
        return iteration

    TorchModelEngine._run, PyExecutor.step = timed_run, timed_step
    return serve.main(serve_argv)


# --------------------------------------------------------------------------- the client side


def chat_trace(path: Path, conversations: int, turns: int, output_len: int, run: int = 0) -> dict:
    """Write the chat trace (trtllm format, turn by turn); returns its shape. ``run`` names the
    visitors, so that each run's conversations are new to the server (its system prompt is not)."""
    from benchmarks.model.perplexity import PARAGRAPHS
    from tensorrt_llm._torch.models.checkpoints import packaged_checkpoint_path
    from tensorrt_llm.llmapi.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(packaged_checkpoint_path(MODEL))
    sentences = [s.strip() + "." for p in PARAGRAPHS for s in p.split(".") if s.strip()]
    rows, lengths = [], []
    for turn in range(turns):
        for c in range(conversations):
            messages = [{"role": "system", "content": SYSTEM}]
            for t in range(turn + 1):
                first = (7 * c + 3 * t) % len(sentences)
                question = f"Question {t + 1} from visitor {run}-{c}: " + " ".join(sentences[first : first + 2])
                messages.append({"role": "user", "content": question})
                if t < turn:
                    messages.append({"role": "assistant", "content": ANSWER})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            rows.append({"task_id": f"c{c}t{turn}", "input_ids": ids, "output_tokens": output_len})
            lengths.append(len(ids))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    system_len = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])))
    return {"requests": len(rows), "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
            "prompt_tokens_mean": sum(lengths) / len(lengths), "system_prompt_tokens": system_len}


def start_server(probe: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "benchmarks.serving.cpu", "--probe", str(probe), "--", MODEL, "--port", "0", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        match = re.search(r"serving \S+ at (http://\S+)", line)
        if match:
            # Keep reading its log, or a full pipe would stop the server.
            threading.Thread(target=lambda: collections.deque(proc.stdout, maxlen=0), daemon=True).start()
            return proc, match.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("trtllm-serve did not start")


def _totals(probe: Path) -> dict:
    return json.loads(probe.read_text()) if probe.exists() else {"forward_s": 0.0, "step_s": 0.0, "steps": 0, "forwards": 0}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", default="1,4,16", help="concurrent users per run, comma-separated")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # server side: run trtllm-serve with the timers
    args = parser.parse_args(argv)
    if args.probe:
        return run_probe(args.probe, extra)

    from benchmarks.serving import replay

    work = Path(tempfile.mkdtemp(prefix="cpu_serving_"))
    users_list = [int(u) for u in args.users.split(",")]
    traces = {users: work / f"chat_{users}.jsonl" for users in users_list}
    for users, trace in traces.items():
        shape = chat_trace(trace, args.conversations, args.turns, args.output_len, run=users)
    print(f"chat trace: {shape['requests']} requests ({args.conversations} conversations x {args.turns} turns), prompts"
          f" {shape['prompt_tokens_min']}-{shape['prompt_tokens_max']} tokens (system prompt {shape['system_prompt_tokens']}),"
          f" {args.output_len} generated each", flush=True)
    probe = work / "probe.json"
    proc, url = start_server(probe, extra)
    runs = []
    try:
        for users in users_list:
            before = _totals(probe)
            out = work / f"replay_{users}.json"
            replay.main(["--url", url, "--trace", str(traces[users]), "--concurrency", str(users), "--json", str(out)])
            after = _totals(probe)
            result = json.loads(out.read_text())["result"]
            forward, step = after["forward_s"] - before["forward_s"], after["step_s"] - before["step_s"]
            runs.append({
                "users": users, "completed": result["completed"], "errored": result["errored"],
                "ttft_ms": result["ttft_ms"], "itl_ms": result["itl_ms"],
                "output_tokens_per_s": result["output_tokens_per_s"], "wall_s": result["wall_s"],
                "steps": after["steps"] - before["steps"], "step_ms_mean": 1e3 * step / max(1, after["steps"] - before["steps"]),
                "share_outside_forward": 1 - forward / step if step else None, "server": result["server"],
            })
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"\n{'users':>5} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'out tok/s':>9} {'step ms':>8} {'!forward':>8}"
          f" {'prefix hit':>10}")
    for run in runs:
        server = run["server"] or {}
        hit = server.get("prefix_cache_hit_tokens", 0) / max(1, server.get("prefix_cache_query_tokens", 0))
        print(f"{run['users']:>5} {run['ttft_ms']['p50']:>8.0f}/{run['ttft_ms']['p99']:<8.0f}"
              f" {run['itl_ms']['p50']:>7.1f}/{run['itl_ms']['p99']:<8.1f} {run['output_tokens_per_s']:>9.1f}"
              f" {run['step_ms_mean']:>8.1f} {100 * run['share_outside_forward']:>7.1f}% {100 * hit:>9.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {**vars(args), "server_flags": extra, "trace": shape},
                                               "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
