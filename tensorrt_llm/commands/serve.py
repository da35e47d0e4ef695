"""``trtllm-serve``: an OpenAI-compatible server for one model (DESIGN.md §6).

    trtllm-serve [MODEL] [--host 127.0.0.1] [--port 8000] [--max_batch_size N] [--max_num_tokens N]
                 [--max_seq_len N] [--tp_size N] [--extra_llm_api_options FILE.yaml] [--api_key KEY]
                 [--log_level info]

``--tp_size N`` (or ``tensor_parallel_size: N`` in the YAML file; ``enable_attention_dp: true``
there too) serves over N rank processes on the CPU (``MultiRankExecutor``); a model whose
heads do not split over N ranks is refused at start-up. Options from the YAML file are ``LLM(...)`` keywords and override the flags. Statistics are
kept for the last ``DEFAULT_ITER_STATS`` iterations (``/metrics``).
``--port 0`` takes a free port; the log line "serving ... at http://HOST:PORT" gives it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from typing import Sequence

import prometheus_client
import uvicorn

from tensorrt_llm.serve.llm_options import LlmOptionsError, load_llm_options

logger = logging.getLogger("trtllm-serve")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ITER_STATS = 1000
API_KEY_ENV = "TRTLLM_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-serve", description="OpenAI-compatible server for one model.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="smollm2-135m-instruct, a llama-architecture .gguf file, tiny-random or small-random")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 takes a free port")
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=None)
    p.add_argument("--tp_size", type=int, default=None,
                   help="tensor parallelism over N rank processes (CPU, gloo on loopback)")
    p.add_argument("--extra_llm_api_options", metavar="FILE.yaml", default=None,
                   help="YAML mapping of LLM(...) keywords; overrides the flags")
    p.add_argument("--api_key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/* (or ${API_KEY_ENV})")
    p.add_argument("--log_level", default="info", choices=LOG_LEVELS)
    return p


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The LLM's keywords: the flags given, then the YAML file's options over them."""
    kwargs = {name: getattr(args, name) for name in ("max_batch_size", "max_num_tokens", "max_seq_len")
              if getattr(args, name) is not None}
    if args.tp_size is not None:
        kwargs["tensor_parallel_size"] = args.tp_size
    kwargs["iter_stats_max_iterations"] = DEFAULT_ITER_STATS
    if args.extra_llm_api_options:
        kwargs.update(load_llm_options(args.extra_llm_api_options))
    return kwargs


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper() if args.log_level != "trace" else logging.DEBUG,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        kwargs = llm_kwargs(args)
    except LlmOptionsError as error:
        parser.error(str(error))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not api_key and not _is_loopback(args.host):
        logger.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)

    prometheus_client.disable_created_metrics()  # no *_created series: this process serves one app
    from tensorrt_llm.llmapi import LLM  # torch and the model load only once the arguments are good
    from tensorrt_llm.serve.openai_server import OpenAIServer

    try:
        llm = LLM(args.model, **kwargs)
    except (TypeError, ValueError, FileNotFoundError) as error:
        parser.error(f"cannot load model {args.model!r}: {error}")
    server = OpenAIServer(llm, api_key=api_key)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as error:
        llm.shutdown()
        parser.error(f"cannot listen on {args.host}:{args.port}: {error.strerror}")
    host, port = sock.getsockname()[:2]
    ranks = kwargs.get("tensor_parallel_size", 1)
    logger.info("serving %s at http://%s:%d (token budget policy %s%s)", llm.model_id,
                f"[{host}]" if family == socket.AF_INET6 else host, port, llm.config.token_budget_policy.value,
                f", {ranks} ranks" if ranks > 1 else "")
    config = uvicorn.Config(server.app, log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
