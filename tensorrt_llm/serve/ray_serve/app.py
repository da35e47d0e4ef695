"""``build_app``: N replicas of ``trtllm-serve``'s OpenAI server under Ray Serve.

From the command line (Ray Serve's ``serve run`` passes ``key=value`` arguments; each value is
read as YAML)::

    serve run tensorrt_llm.serve.ray_serve:build_app model=smollm2-135m-instruct num_replicas=2 \\
        router=prefix_aware extra_llm_api_options=llm.yaml 'server={max_queue_size: 64}'

From Python::

    from ray import serve
    from tensorrt_llm.serve.ray_serve import build_app
    serve.run(build_app(model="tiny-random", num_replicas=2, llm={"kv_cache_config": {"num_blocks": 512}}))

Arguments: ``model`` (as ``trtllm-serve MODEL``), ``llm`` (a mapping of ``LLM(...)`` keywords,
the keys of ``--extra_llm_api_options``) and ``extra_llm_api_options`` (a YAML file of them;
``llm`` applies over it), ``server`` (a mapping of ``ServerConfig`` fields: API key, queue and
body limits, tool parser, chat template; host and port are Ray Serve's), and every
:class:`RayServeConfig` field. An unknown key, at any depth, is refused by name before anything
starts. The prefix-aware router needs KV cache events: unless
``kv_cache_config.event_buffer_max_size`` is given, it is set to :data:`EVENT_BUFFER_SIZE`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import yaml
from ray import serve
from ray.serve.config import RequestRouterConfig

from tensorrt_llm._torch.pyexecutor.config import KvCacheConfig
from tensorrt_llm.llmapi.config_fields import deep_merge, from_mapping
from tensorrt_llm.serve.llm_options import llm_options, read_llm_options
from tensorrt_llm.serve.ray_serve.config import RayServeConfig
from tensorrt_llm.serve.ray_serve.deployments import LLMReplica, OpenAIIngress
from tensorrt_llm.serve.ray_serve.prompt_ids import prompt_renderer
from tensorrt_llm.serve.ray_serve.routers import PrefixAwareRequestRouter, RoundRobinRequestRouter
from tensorrt_llm.serve.server_config import ServerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"  # trtllm-serve's (commands sit above serve: not imported)
#: Events the prefix-aware router's replicas buffer between two pushes (one push every few ms).
EVENT_BUFFER_SIZE = 8192
INGRESS_MAX_ONGOING_REQUESTS = 10_000  # the ingress only relays: Ray Serve's default of 5 would queue


def build_app(args: Mapping[str, Any] | None = None, /, **kwargs: Any) -> serve.Application:
    """The application (see the module docstring); ``args`` as ``serve run`` passes them (strings
    read as YAML) and/or keywords. Raises ValueError naming a bad key or value."""
    options = {key: _cli_value(key, value) for key, value in {**(args or {}), **kwargs}.items()}
    model = str(options.pop("model", DEFAULT_MODEL))
    llm_data = options.pop("llm", None) or {}
    if path := options.pop("extra_llm_api_options", None):
        llm_data = deep_merge(read_llm_options(path), llm_data)
    server = from_mapping(ServerConfig, options.pop("server", None) or {}, path="server")
    settings = from_mapping(RayServeConfig, options)
    llm_kwargs = _with_events(llm_options(llm_data), llm_data, settings)
    tokens_per_block = llm_kwargs.get("kv_cache_config", KvCacheConfig()).tokens_per_block
    replicas = serve.deployment(
        LLMReplica, name="LLMReplica", num_replicas=settings.num_replicas,
        ray_actor_options={"num_cpus": settings.replica_num_cpus},
        max_ongoing_requests=settings.max_ongoing_requests,
        health_check_period_s=settings.health_check_period_s, health_check_timeout_s=settings.health_check_timeout_s,
        **_router(settings, tokens_per_block),
    ).bind(model, llm_kwargs, server, settings)
    ingress = serve.deployment(
        OpenAIIngress, name="OpenAIIngress", num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": settings.ingress_num_cpus}, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    )
    return ingress.bind(replicas, prompt_renderer(model, server, llm_kwargs.get("dtype")), server, settings)


def _router(settings: RayServeConfig, tokens_per_block: int) -> dict:
    """The LLM deployment's ``request_router_config`` (none: Ray Serve's power of two choices)."""
    if settings.router == "prefix_aware":
        bound = settings.load_bound
        return {"request_router_config": RequestRouterConfig(
            request_router_class=PrefixAwareRequestRouter,
            request_router_kwargs={"tokens_per_block": tokens_per_block, "max_load_gap": bound.max_load_gap,
                                   "max_in_flight": bound.max_in_flight,
                                   "min_match_blocks": bound.min_match_blocks,
                                   "match_timeout_s": settings.match_timeout_s})}
    if settings.router == "round_robin":
        return {"request_router_config": RequestRouterConfig(request_router_class=RoundRobinRequestRouter)}
    return {}


def _with_events(llm_kwargs: dict, llm_data: Mapping, settings: RayServeConfig) -> dict:
    """The prefix-aware router reads the replicas' KV cache events: turned on unless the options
    (``llm_data``, as given) set ``kv_cache_config.event_buffer_max_size`` (0 is refused)."""
    if settings.router != "prefix_aware":
        return llm_kwargs
    kv = llm_kwargs.get("kv_cache_config", KvCacheConfig())
    if "event_buffer_max_size" in (llm_data.get("kv_cache_config") or {}):
        if kv.event_buffer_max_size == 0:
            raise ValueError("router prefix_aware reads the replicas' KV cache events:"
                             " kv_cache_config.event_buffer_max_size must be > 0")
        return llm_kwargs
    return {**llm_kwargs, "kv_cache_config": dataclasses.replace(kv, event_buffer_max_size=EVENT_BUFFER_SIZE)}


def _cli_value(key: str, value: Any) -> Any:
    """``serve run``'s ``key=value`` strings read as YAML (``2``, ``true``, ``{a: 1}``); the model
    name and the options file's path stay strings."""
    if not isinstance(value, str) or key in ("model", "extra_llm_api_options"):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise ValueError(f"{key}: not a YAML value: {error}") from None
