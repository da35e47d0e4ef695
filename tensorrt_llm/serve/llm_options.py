"""``--extra_llm_api_options FILE.yaml``: a mapping of ``LLM(...)`` keyword arguments.

Keys are the LLM's keywords (every ``ExecutorConfig`` field, ``dtype``, ``seed``,
``tensor_parallel_size``, ``enable_attention_dp``);
``kv_cache_config`` and ``fault_injection`` are nested mappings of their dataclasses' fields.
A key that is not one of them is an error naming it (``kv_cache_config.foo`` for a nested
one), as is a value its dataclass refuses — at start-up, before the model loads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from tensorrt_llm._torch.pyexecutor.config import ExecutorConfig, FaultInjectionConfig, KvCacheConfig

_NESTED = {"kv_cache_config": KvCacheConfig, "fault_injection": FaultInjectionConfig}
_MODEL_KEYS = ("dtype", "seed", "tensor_parallel_size", "enable_attention_dp")
ACCEPTED_KEYS = tuple(sorted({f.name for f in dataclasses.fields(ExecutorConfig)} | set(_MODEL_KEYS)))


class LlmOptionsError(ValueError):
    """The options file cannot be used; the message names the file and the key."""


def load_llm_options(path: str | Path) -> dict[str, Any]:
    """Read ``path`` and return ``LLM`` keyword arguments (nested mappings built into their dataclasses)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise LlmOptionsError(f"{path}: cannot read it: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise LlmOptionsError(f"{path}: not valid YAML: {error}") from None
    try:
        return llm_options(data if data is not None else {})
    except (TypeError, ValueError) as error:
        raise LlmOptionsError(f"{path}: {error}") from None


def llm_options(data: Any) -> dict[str, Any]:
    """Validate a mapping of LLM options; raises ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of LLM options, got {type(data).__name__}")
    options = {}
    for key, value in data.items():
        if key not in ACCEPTED_KEYS:
            raise ValueError(f"unknown key {key!r} (accepted: {', '.join(ACCEPTED_KEYS)})")
        kind = _NESTED.get(key)
        options[key] = value if kind is None else _build(key, kind, value)
    ExecutorConfig(**{k: v for k, v in options.items() if k not in _MODEL_KEYS})  # refuse bad values now
    return options


def _build(name: str, kind: type, value: Any):
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(kind)}
    for key in value:
        if key not in fields:
            raise ValueError(f"unknown key '{name}.{key}' (accepted: {', '.join(sorted(fields))})")
    return kind(**value)
