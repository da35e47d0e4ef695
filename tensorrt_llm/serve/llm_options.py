"""``--extra_llm_api_options FILE.yaml``: a mapping of ``LLM(...)`` keyword arguments.

The keys are ``LlmArgs``'s (``tensorrt_llm.llmapi.llm_args``), generated from the config
dataclasses' fields: every ``ExecutorConfig`` field, ``dtype``, ``seed``, ``device``,
``tensor_parallel_size``, ``enable_attention_dp``; ``kv_cache_config``, ``cuda_graph_config``
and ``fault_injection`` are nested mappings of their dataclasses' fields (``null`` where the
field may be None). A key that is not one of them is an error naming it
(``kv_cache_config.foo`` for a nested one), as is a value of the wrong type or one its
dataclass refuses — at start-up, before the model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from tensorrt_llm.llmapi.config_fields import from_mapping, parse_mapping
from tensorrt_llm.llmapi.llm_args import LlmArgs


class LlmOptionsError(ValueError):
    """The options file cannot be used; the message names the file and the key."""


def load_llm_options(path: str | Path) -> dict[str, Any]:
    """Read ``path`` and return ``LLM`` keyword arguments (nested mappings built into their dataclasses)."""
    return llm_options(read_llm_options(path))


def read_llm_options(path: str | Path) -> dict[str, Any]:
    """The mapping in ``path``, checked as ``llm_options`` checks it but left as plain data, so
    that it can be merged over other options (flags) before it is built."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise LlmOptionsError(f"{path}: cannot read it: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise LlmOptionsError(f"{path}: not valid YAML: {error}") from None
    data = data if data is not None else {}
    try:
        llm_options(data)
    except ValueError as error:
        raise LlmOptionsError(f"{path}: {error}") from None
    return data


def llm_options(data: Any) -> dict[str, Any]:
    """``LLM`` keyword arguments from a mapping of them: only the keys given, each converted to
    its field's type. The whole set is checked now (an ``LlmArgs`` is built from it), so a bad
    value or combination fails before the model loads; raises ValueError naming the key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"expected a mapping of LLM options, got {type(data).__name__}")
    kwargs = parse_mapping(LlmArgs, data)
    from_mapping(LlmArgs, data)  # refuse bad values and combinations now
    return kwargs
