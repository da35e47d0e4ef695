"""``trtllm-serve``: an OpenAI-compatible server for one model (DESIGN.md §6).

    trtllm-serve [MODEL] [--host 127.0.0.1] [--port 8000] [--device auto|cuda|cpu] [--max_batch_size N]
                 [--max_num_tokens N] [--max_seq_len N] [--tp_size N] [--extra_llm_api_options FILE.yaml]
                 [--api_key KEY] [--log_level info] ...

The flags are generated (``config_fields``): one per ``LLM(...)`` keyword (``LlmArgs``: the
LLM's own and every ``ExecutorConfig`` field; nested ones dotted, e.g.
``--kv_cache_config.tokens_per_block 64``; ``--tp_size`` is ``--tensor_parallel_size``) and one
per ``ServerConfig`` field (the HTTP front: ``--host``, ``--port``, ``--api_key``, timeouts and
limits). ``--extra_llm_api_options`` is a YAML mapping of the same ``LLM(...)`` keywords; its
values override the flags', key by key (nested mappings merged). A flag or key that is unknown,
of the wrong type or refused by its dataclass stops start-up with its name, before the model
loads.

``--device auto`` (the default) serves on the GPU when torch sees one, else on the CPU.
``--tp_size N`` (or ``tensor_parallel_size: N`` in the YAML file; ``enable_attention_dp: true``
there too) serves over N rank processes on the CPU (``MultiRankExecutor``); a model whose
heads do not split over N ranks is refused at start-up. Statistics are kept for the last
``DEFAULT_ITER_STATS`` iterations (``/metrics``) unless ``iter_stats_max_iterations`` says
otherwise. ``--port 0`` takes a free port; the log line "serving ... at http://HOST:PORT"
gives it.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import socket
import sys
from typing import Sequence

import prometheus_client
import uvicorn

from tensorrt_llm.llmapi.config_fields import add_arguments, deep_merge, from_mapping, overrides_from_args
from tensorrt_llm.llmapi.llm_args import DERIVED_DEFAULTS, LlmArgs
from tensorrt_llm.serve.llm_options import llm_options, read_llm_options
from tensorrt_llm.serve.server_config import ServerConfig

logger = logging.getLogger("trtllm-serve")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ITER_STATS = 1000
API_KEY_ENV = "TRTLLM_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# trtllm-serve's own defaults for LLM keywords, under the flags and the options file.
LLM_DEFAULTS = {"iter_stats_max_iterations": DEFAULT_ITER_STATS}
FLAG_ALIASES = {"tensor_parallel_size": ["--tp_size"]}  # upstream's spelling


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-serve", description="OpenAI-compatible server for one model.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a Hugging Face checkpoint directory or hub id (Llama, Mistral, Qwen2, Qwen3; docs/models.md),"
                        " smollm2-135m-instruct, a llama-architecture .gguf file, tiny-random or small-random")
    p.add_argument("--extra_llm_api_options", metavar="FILE.yaml", default=None,
                   help="YAML mapping of LLM(...) keywords (the flags below); overrides the flags")
    p.add_argument("--log_level", default="info", choices=LOG_LEVELS)
    server = p.add_argument_group("HTTP server (ServerConfig)")
    for action in add_arguments(server, ServerConfig):
        if action.dest == "api_key":
            action.help += f"; or ${API_KEY_ENV}"
    llm = p.add_argument_group("LLM(...) keywords", "also the keys of --extra_llm_api_options, which override these")
    add_arguments(llm, LlmArgs, aliases=FLAG_ALIASES, defaults=LLM_DEFAULTS, derived=DERIVED_DEFAULTS)
    return p


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The LLM's keywords: trtllm-serve's defaults, the flags given over them, then the YAML
    file's options over those. Raises ValueError (``LlmOptionsError`` for the file) naming what
    is wrong."""
    options = deep_merge(LLM_DEFAULTS, overrides_from_args(args, LlmArgs))
    if args.extra_llm_api_options:
        options = deep_merge(options, read_llm_options(args.extra_llm_api_options))
    return llm_options(options)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP front's settings from the flags given (the API key also from ``$TRTLLM_API_KEY``)."""
    overrides = overrides_from_args(args, ServerConfig)
    if "api_key" not in overrides and os.environ.get(API_KEY_ENV):
        overrides["api_key"] = os.environ[API_KEY_ENV]
    return from_mapping(ServerConfig, overrides)


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
        config = server_config(args)
    except ValueError as error:  # LlmOptionsError names the file too
        parser.error(str(error))
    if not config.api_key and not _is_loopback(config.host):
        logger.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)

    from tensorrt_llm._torch.distributed.torchrun import TorchrunEnv  # torch loads once the arguments are good

    launch = TorchrunEnv.from_environ()
    if launch is not None and launch.world_size > 1:  # started by torchrun: one process per rank
        kwargs.setdefault("tensor_parallel_size", launch.world_size)
        if launch.rank != 0:
            return _follow(args, kwargs, launch, parser)

    prometheus_client.disable_created_metrics()  # no *_created series: this process serves one app
    from tensorrt_llm.llmapi import LLM  # torch and the model load only once the arguments are good
    from tensorrt_llm.serve.http_server import uvicorn_config
    from tensorrt_llm.serve.openai_server import OpenAIServer

    try:
        llm = LLM(args.model, **kwargs)
    except (TypeError, ValueError, FileNotFoundError) as error:
        parser.error(f"cannot load model {args.model!r}: {error}")
    server = OpenAIServer(llm, config)
    if config.freeze_gc_heap:  # see ServerConfig: no full collection walks the model and the app again
        gc.collect()
        gc.freeze()
    sock = _listen(config, parser, llm)
    host, port = sock.getsockname()[:2]
    ranks = kwargs.get("tensor_parallel_size", 1)
    logger.info("serving %s at http://%s:%d (token budget policy %s%s)", llm.model_id,
                f"[{host}]" if sock.family == socket.AF_INET6 else host, port, llm.config.token_budget_policy.value,
                f", {ranks} ranks" if ranks > 1 else "")
    try:
        uvicorn.Server(uvicorn_config(server.app, config, log_level=args.log_level, timeout_graceful_shutdown=5)).run(
            sockets=[sock])
    except KeyboardInterrupt:
        # Under uvloop (installed beside uvicorn on the GPU image) the SIGINT that asked for the
        # stop comes back out of run() once the graceful shutdown has finished: a requested stop,
        # not a crash, so the command exits 0 as it does under the plain asyncio loop.
        logger.info("stopped by SIGINT")
    return 0


def _follow(args: argparse.Namespace, kwargs: dict, launch, parser: argparse.ArgumentParser) -> int:
    """A torchrun rank other than 0: no HTTP; it builds its shard from the same arguments and
    steps with the group until rank 0 stops it (exit 0) or the group fails (exit 1, with why)."""
    from tensorrt_llm._torch.distributed.errors import DistributedError
    from tensorrt_llm.llmapi.llm import follow_rank0

    logger.info("rank %d of %d follows rank 0 (rendezvous %s:%d)", launch.rank, launch.world_size,
                launch.master_addr, launch.master_port)
    try:
        iterations = follow_rank0(args.model, **kwargs)
    except (TypeError, ValueError, FileNotFoundError) as error:
        parser.error(f"cannot load model {args.model!r}: {error}")
    except DistributedError as error:
        logger.error("rank %d: the group failed: %s", launch.rank, error)
        return 1
    logger.info("rank %d stopped after %d group iterations", launch.rank, iterations)
    return 0


def _listen(config: ServerConfig, parser: argparse.ArgumentParser, llm) -> socket.socket:
    """A socket listening on ``config.host:config.port`` (port 0: a free one), so that a client
    told the address connects even before uvicorn accepts; on failure the LLM is shut down and
    the command exits with the reason."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
        sock.listen(config.backlog)
    except OSError as error:
        llm.shutdown()
        parser.error(f"cannot listen on {config.host}:{config.port}: {error.strerror}")
    return sock


if __name__ == "__main__":
    sys.exit(main())
