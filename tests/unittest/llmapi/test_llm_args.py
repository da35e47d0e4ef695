"""One configuration description: every field of the config dataclasses, walked recursively, can
be set from a mapping (the YAML options file, ``ReplaySettings.from_options``) and from the
command line (``trtllm-serve``, the replay); unknown keys and wrong types are refused by name.

The walk is the module's own (``config_fields.walk``), so a field added to any of these
dataclasses is covered here without touching this file; the oracle reads the built object by
attribute, not through the module's ``to_mapping``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import subprocess
import sys
import typing
from typing import Any, Callable, NamedTuple

import pytest
import yaml

from benchmarks import replay
from benchmarks.replay.settings import SET_BY_THE_REPLAY, ReplaySettings
from tensorrt_llm._torch.pyexecutor.config import CudaGraphConfig, ExecutorConfig, FaultInjectionConfig, TokenBudgetPolicyName
from tensorrt_llm.commands import serve
from tensorrt_llm.llmapi.config_fields import FieldSpec, deep_merge, from_mapping, overrides_from_args, to_mapping, walk
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.serve.llm_options import LlmOptionsError, llm_options, load_llm_options, read_llm_options
from tensorrt_llm.serve.server_config import ServerConfig


class Surface(NamedTuple):
    """A dataclass and the command line that sets it."""

    cls: type
    parser: Callable[[], argparse.ArgumentParser]
    build: Callable[[argparse.Namespace], Any]  # the parsed flags -> the object the command uses
    exclude: frozenset[str] = frozenset()


SURFACES = {
    "trtllm-serve LLM keywords": Surface(LlmArgs, serve.build_parser,
                                         lambda args: from_mapping(LlmArgs, serve.llm_kwargs(args))),
    "trtllm-serve HTTP server": Surface(ServerConfig, serve.build_parser, serve.server_config),
    "replay settings": Surface(ReplaySettings, replay.build_parser, lambda args: replay.settings_from_args(args)[1],
                               SET_BY_THE_REPLAY),
    "replay trace": Surface(replay.TraceSpec, replay.build_parser, lambda args: replay.settings_from_args(args)[0]),
}

# A value for string fields whose values are constrained (the others take any non-empty string).
_STRINGS = {"dtype": "float16", "device": "cpu", "host": "0.0.0.0", "path": "trace.jsonl", "cost_model": "model.json",
            "endpoint": "tcp://127.0.0.1:5600", "replay_endpoint": "tcp://*:5601"}
# Settings a field's value is valid only beside (a dataclass's own checks across fields).
_PRIORITY = {"scheduler_config": {"waiting_queue_policy": "priority"}}  # preemption is among priorities
_BESIDE = {(ReplaySettings, "device"): {"engine": "torch"},
           (ReplaySettings, "scheduler_config.enable_preemption"): _PRIORITY,
           (LlmArgs, "scheduler_config.enable_preemption"): _PRIORITY}


def _nested(path: str, value: Any) -> dict:
    """``{"a": {"b": value}}`` for the dotted key ``a.b``."""
    *parents, key = path.split(".")
    mapping = {key: value}
    for parent in reversed(parents):
        mapping = {parent: mapping}
    return mapping


def _flat(mapping: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of a nested mapping's leaves: the flags that set them."""
    pairs = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            pairs += _flat(value, f"{prefix}{key}.")
        else:
            pairs.append((prefix + key, value))
    return pairs


def _mapping(surface: Surface, spec: FieldSpec, value: Any) -> dict:
    return deep_merge(_BESIDE.get((surface.cls, spec.path), {}), _nested(spec.path, value))


def _get(obj: Any, path: str) -> Any:
    """The value at a dotted key, by attribute (None under a nested None); an ExecutorConfig key
    of ``LlmArgs`` or ``ReplaySettings`` is read from their ``executor``."""
    for key in path.split("."):
        if obj is None:
            return None
        names = {f.name for f in dataclasses.fields(obj)}
        obj = getattr(obj if key in names else obj.executor, key)
    return obj


def _candidates(spec: FieldSpec) -> list[Any]:
    """Values unlike the field's default, in the order tried (the first its dataclass accepts wins)."""
    default = spec.default
    if spec.kind is bool:
        return [not default] if default is not None else [True, False]
    if spec.choices is not None:
        return [c for c in spec.choices if c != getattr(default, "value", default)]
    if spec.is_nested:
        return [None] if spec.optional and default is not None else ([{}] if default is None else [])
    if spec.kind is list:
        return [[1, 2, 4]]
    if spec.kind is int:
        base = default if isinstance(default, int) else 0
        return [v for v in (base + 1, base * 2, 1, 2, 64, 100) if v != default]
    if spec.kind is float:
        return [v for v in (default / 2, default * 2, 0.5, 2.0) if v != default] if default else [0.5, 2.0]
    return [_STRINGS.get(spec.path.rpartition(".")[2], "x")]


def _set_value(surface: Surface, spec: FieldSpec) -> Any:
    """A value of ``spec`` unlike its default (and unlike the value a default object resolves it
    to: an alias whose None means another field's) that ``surface.cls`` accepts on its own."""
    resolved = _get(surface.cls(), spec.path)
    for value in _candidates(spec):
        if resolved is not None and not spec.is_nested and _expected(value, spec) == resolved:
            continue
        try:
            from_mapping(surface.cls, _mapping(surface, spec, value), exclude=surface.exclude)
        except ValueError:
            continue
        return value
    raise AssertionError(f"{surface.cls.__name__}.{spec.path}: no value unlike the default ({spec.default!r}) is accepted")


def _expected(value: Any, spec: FieldSpec) -> Any:
    if spec.is_nested and value == {}:
        return spec.kind()
    if isinstance(spec.kind, type) and issubclass(spec.kind, enum.Enum):
        return spec.kind(value)
    return value


def _argv(parser: argparse.ArgumentParser, spec: FieldSpec, value: Any) -> list[str]:
    """The command line that sets ``spec`` to ``value``."""
    action = next(a for a in parser._actions if a.dest == spec.path)
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    if value is None:
        return [flag, "null" if spec.is_nested else "none"]
    if isinstance(value, dict):
        return [flag, yaml.safe_dump(value, default_flow_style=True)]
    return [flag, str(value)]


def _cases():
    for name, surface in SURFACES.items():
        for spec in walk(surface.cls, exclude=surface.exclude):
            if not (spec.is_nested and not spec.optional):  # a mapping field: its keys are cases of their own
                yield pytest.param(surface, spec, id=f"{name}: {spec.path}")


@pytest.mark.parametrize("surface, spec", list(_cases()))
def test_every_field_can_be_set_from_a_mapping_and_from_the_command_line(surface, spec, monkeypatch, tmp_path):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    if spec.choices is not None and len(spec.choices) == 1:  # no other value to set: another is refused by name
        with pytest.raises(ValueError, match=spec.path.rpartition(".")[2]):
            from_mapping(surface.cls, _mapping(surface, spec, "not-" + spec.choices[0]), exclude=surface.exclude)
        return
    value = _set_value(surface, spec)
    expected = _expected(value, spec)
    assert _get(surface.cls(), spec.path) != expected

    mapping = yaml.safe_load(yaml.safe_dump(_mapping(surface, spec, value)))  # what a YAML file holds
    assert _get(from_mapping(surface.cls, mapping, exclude=surface.exclude), spec.path) == expected
    if surface.cls is LlmArgs:  # the real options file, read as trtllm-serve reads it
        path = tmp_path / "options.yaml"
        path.write_text(yaml.safe_dump(mapping))
        assert _get(from_mapping(LlmArgs, read_llm_options(path)), spec.path) == expected

    parser = surface.parser()
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    beside = [arg for key, other in _flat(_BESIDE.get((surface.cls, spec.path), {})) for arg in (flags[key], other)]
    args = parser.parse_args(beside + _argv(parser, spec, value))
    assert _get(surface.build(args), spec.path) == expected


def test_the_walk_reaches_every_field_of_every_dataclass():
    """Recursion: a nested dataclass's fields are keys under its name; ExecutorConfig's are
    LlmArgs's own keys (inlined), and each has its flag."""
    expected = set()
    for cls in (LlmArgs, ExecutorConfig):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name == "executor":
                continue
            expected.add(field.name)
            nested = [k for k in typing.get_args(hints[field.name]) or (hints[field.name],) if dataclasses.is_dataclass(k)]
            expected |= {f"{field.name}.{inner.name}" for kind in nested for inner in dataclasses.fields(kind)}
    assert {spec.path for spec in walk(LlmArgs)} == expected
    flags = {s for a in serve.build_parser()._actions for s in a.option_strings}
    assert {f"--{path}" for path in expected} <= flags


def test_every_config_field_has_help():
    """The flags' help is the fields' comments: none of the config dataclasses' fields lacks one."""
    for cls in (LlmArgs, ReplaySettings, replay.TraceSpec):
        missing = [spec.path for spec in walk(cls) if not spec.help]
        assert not missing, f"{cls.__name__}: fields without a comment: {missing}"


# ---- the options file --------------------------------------------------------------------


def _options(tmp_path, text: str) -> dict:
    path = tmp_path / "options.yaml"
    path.write_text(text)
    return load_llm_options(path)


def test_device_and_cuda_graph_config_are_options(tmp_path):
    assert _options(tmp_path, "device: cuda\n") == {"device": "cuda"}  # the LLM refuses it on a CPU machine
    assert _options(tmp_path, "device: cuda:1\n") == {"device": "cuda:1"}
    assert LlmArgs().device == "auto"
    graphs = _options(tmp_path, "cuda_graph_config:\n  batch_sizes: [4, 1, 2]\n")["cuda_graph_config"]
    assert graphs == CudaGraphConfig(batch_sizes=[1, 2, 4])
    assert _options(tmp_path, "cuda_graph_config: null\n") == {"cuda_graph_config": None}
    assert _options(tmp_path, "fault_injection: {}\n") == {"fault_injection": FaultInjectionConfig()}
    assert _options(tmp_path, "token_budget_policy: fit\n") == {"token_budget_policy": TokenBudgetPolicyName.FIT}


@pytest.mark.parametrize(
    "text, message",
    [
        ("devise: cuda\n", "unknown key 'devise'"),
        ("executor: {}\n", "unknown key 'executor'"),  # inlined: its keys are top-level keys
        ("kv_cache_config:\n  tokens_per_blok: 8\n", "unknown key 'kv_cache_config.tokens_per_blok'"),
        ("cuda_graph_config:\n  sizes: [1]\n", "unknown key 'cuda_graph_config.sizes'"),
        ("fault_injection:\n  nan_every: 3\n", "unknown key 'fault_injection.nan_every'"),
        ("device: tpu\n", "device must be one of 'auto', 'cuda', 'cpu' (or 'cuda:N'), got 'tpu'"),
        ("max_num_tokens: true\n", "max_num_tokens must be an integer, got True"),
        ("max_num_tokens: '8'\n", "max_num_tokens must be an integer, got '8'"),
        ("max_num_tokens: null\n", "max_num_tokens must not be null"),
        ("enable_chunked_prefill: 1\n", "enable_chunked_prefill must be true or false, got 1"),
        ("kv_cache_config:\n  tokens_per_block: 1.5\n", "kv_cache_config.tokens_per_block must be an integer, got 1.5"),
        ("kv_cache_config: null\n", "kv_cache_config must not be null"),
        ("cuda_graph_config:\n  batch_sizes: [1, true]\n", "cuda_graph_config.batch_sizes[] must be an integer, got True"),
        ("cuda_graph_config:\n  batch_sizes: 4\n", "cuda_graph_config.batch_sizes must be a list, got 4"),
        ("cuda_graph_config: 3\n", "cuda_graph_config must be a mapping, got int"),
        ("cuda_graph_config:\n  batch_sizes: []\n", "CudaGraphConfig.batch_sizes must not be empty"),
        ("dtype: 16\n", "dtype must be a string, got 16"),
        ("tensor_parallel_size: 0\n", "tensor_parallel_size must be a positive integer"),
        ("capacity_scheduler_policy: greedy\n", "capacity_scheduler_policy must be one of"),
        ("kv_cache_config:\n  max_tokens: 64\n  num_blocks: 4\n", "give max_tokens or num_blocks, not both"),
    ],
)
def test_options_file_refuses_unknown_keys_and_wrong_values_by_name(tmp_path, text, message):
    with pytest.raises(LlmOptionsError, match=re.escape(message)):
        _options(tmp_path, text)


def test_an_int_is_a_float_and_nothing_else_is_coerced(tmp_path):
    options = _options(tmp_path, "health_check_timeout_s: 2\nfault_injection:\n  slow_forward_s: 1\n")
    assert options["health_check_timeout_s"] == 2.0 and isinstance(options["health_check_timeout_s"], float)
    assert options["fault_injection"].slow_forward_s == 1.0


def test_options_carry_only_the_keys_given():
    """LLM(...) learns which keywords were given (max_seq_len given is a request, not a default)."""
    assert llm_options({"kv_cache_config": {"num_blocks": 8}}).keys() == {"kv_cache_config"}
    assert llm_options({}) == {}


# ---- trtllm-serve --------------------------------------------------------------------------


def test_serve_keeps_upstream_flag_names_and_device_defaults_to_auto():
    parser = serve.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--host", "--port", "--device", "--max_batch_size", "--max_num_tokens", "--max_seq_len", "--tp_size",
            "--extra_llm_api_options", "--api_key", "--log_level"} <= flags
    args = parser.parse_args(["tiny-random"])
    assert serve.llm_kwargs(args) == {"iter_stats_max_iterations": serve.DEFAULT_ITER_STATS}  # only what was given
    assert serve.server_config(args) == ServerConfig()
    assert serve.llm_kwargs(parser.parse_args(["--device", "cpu", "--tp_size", "2"])) == {
        "device": "cpu", "tensor_parallel_size": 2, "iter_stats_max_iterations": serve.DEFAULT_ITER_STATS}
    assert "{auto,cuda,cpu}" in parser.format_help()


def test_options_file_overrides_flags_key_by_key(tmp_path):
    path = tmp_path / "options.yaml"
    path.write_text("max_num_tokens: 200\nkv_cache_config:\n  num_blocks: 64\niter_stats_max_iterations: null\n")
    args = serve.build_parser().parse_args(["--max_num_tokens", "100", "--kv_cache_config.tokens_per_block", "16",
                                            "--max_batch_size", "3", "--extra_llm_api_options", str(path)])
    kwargs = serve.llm_kwargs(args)
    assert kwargs["max_num_tokens"] == 200 and kwargs["max_batch_size"] == 3
    assert (kwargs["kv_cache_config"].tokens_per_block, kwargs["kv_cache_config"].num_blocks) == (16, 64)
    assert kwargs["iter_stats_max_iterations"] is None


def test_a_whole_nested_mapping_on_the_command_line_then_its_keys_over_it():
    args = serve.build_parser().parse_args(["--kv_cache_config", "{tokens_per_block: 16, num_blocks: 8}",
                                            "--kv_cache_config.num_blocks", "32"])
    kv = serve.llm_kwargs(args)["kv_cache_config"]
    assert (kv.tokens_per_block, kv.num_blocks) == (16, 32)
    for bad in (["--kv_cache_config", "null"], ["--kv_cache_config", "[1]"], ["--max_num_tokens", "many"],
                ["--no-such-flag", "1"], ["--device"]):
        with pytest.raises(SystemExit):
            serve.build_parser().parse_args(bad)


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    parser = serve.build_parser()
    assert serve.server_config(parser.parse_args([])).api_key == "from-env"
    assert serve.server_config(parser.parse_args(["--api_key", "flag"])).api_key == "flag"
    with pytest.raises(ValueError, match="timeout_keep_alive_s"):
        serve.server_config(parser.parse_args(["--timeout_keep_alive_s", "0"]))


def test_the_description_and_the_parser_load_without_torch():
    code = ("import sys; from tensorrt_llm.commands import serve; serve.build_parser().parse_args([]); "
            "from tensorrt_llm.serve.llm_options import llm_options; llm_options({'device': 'cuda'}); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ---- the replay --------------------------------------------------------------------------


def test_replay_refuses_what_it_sets_itself():
    for key in sorted(SET_BY_THE_REPLAY):
        with pytest.raises(ValueError, match=re.escape(f"unknown key '{key}'")):
            ReplaySettings.from_options(**_nested(key, 1))
    with pytest.raises(ValueError, match=re.escape("unknown key 'kv_cache_config.foo'")):
        ReplaySettings.from_options(kv_cache_config={"foo": 1})
    flags = {s for a in replay.build_parser()._actions for s in a.option_strings}
    assert not {"--max-seq-len", "--token-budget-policy", "--kv-cache-config.host-cache-size"} & flags


def test_replay_options_round_trip():
    settings = ReplaySettings.from_options(max_num_tokens=2048, capacity_scheduler_policy="MAX_UTILIZATION",
                                           kv_cache_config={"tokens_per_block": 16}, cuda_graph_config=None,
                                           engine="torch", host_cache_blocks=0)
    assert settings.executor.kv_cache_config.num_blocks == 1280  # the default scenario's, merged under the mapping
    assert ReplaySettings.from_options(**settings.options()) == settings
    assert yaml.safe_load(yaml.safe_dump(settings.options())) == settings.options()  # plain data


def test_llm_args_round_trip():
    args = from_mapping(LlmArgs, {"device": "cpu", "seed": 3, "token_budget_policy": "claim",
                                  "kv_cache_config": {"num_blocks": 9}, "fault_injection": {"seed": 2}})
    assert from_mapping(LlmArgs, to_mapping(args)) == args


# ---- the public config classes, their dict forms, and --help's defaults -------------------


def _llm_argument_types() -> dict[str, type]:
    """Each LLM(...) keyword whose value is a config object or an enum: keyword -> its class."""
    kinds = {}
    for spec in walk(LlmArgs):
        if "." not in spec.path and (spec.is_nested or (isinstance(spec.kind, type) and issubclass(spec.kind, enum.Enum))):
            kinds[spec.path] = spec.kind
    return kinds


def test_every_config_an_llm_argument_takes_is_importable_from_llmapi():
    import tensorrt_llm.llmapi as llmapi

    exported = {name: getattr(llmapi, name) for name in llmapi.__all__}
    kinds = _llm_argument_types()
    assert {"kv_cache_config", "cuda_graph_config", "scheduler_config", "speculative_config"} <= set(kinds)
    for keyword, kind in kinds.items():
        assert kind in exported.values(), f"{keyword}: {kind.__name__} is not exported by tensorrt_llm.llmapi"
    # upstream's names, the project's kept beside them
    assert llmapi.NGramDecodingConfig is llmapi.SpeculativeConfig is kinds["speculative_config"]
    assert llmapi.TorchLlmArgs is llmapi.LlmArgs is LlmArgs
    for name in ("KvCacheConfig", "CudaGraphConfig", "SchedulerConfig", "CapacitySchedulerPolicy", "ContextChunkingPolicy"):
        assert getattr(llmapi, name).__name__ == name
    with pytest.raises(AttributeError):
        llmapi.NoSuchConfig  # noqa: B018


def test_every_config_argument_takes_the_dict_form_the_yaml_uses(one_torch_thread):
    """Each nested config keyword given as a mapping (its defaults, one field changed where it can
    be) builds the same object as the class would; a bad key is refused by its dotted name."""
    from tensorrt_llm.llmapi import LLM, NGramDecodingConfig

    # the executor's configs; simulated_engine changes the engine (test_simulated_engine gives it as a mapping)
    nested = {k: v for k, v in _llm_argument_types().items() if dataclasses.is_dataclass(v) and k != "simulated_engine"}
    given = {keyword: to_mapping(kind()) for keyword, kind in nested.items()}
    given["speculative_config"] = {"decoding_type": "NGram", "max_draft_len": 2, "max_matching_ngram_size": 2}
    given["kv_cache_config"] |= {"tokens_per_block": 16, "num_blocks": 64}
    with LLM("tiny-random", max_seq_len=128, **given) as llm:
        for keyword, kind in nested.items():  # an executor's config, or the LLM's own (kv_events_config)
            built = getattr(llm.config, keyword) if hasattr(llm.config, keyword) else getattr(llm, keyword)
            assert isinstance(built, kind), keyword
        assert llm.config.speculative_config == NGramDecodingConfig(max_draft_len=2, max_matching_ngram_size=2)
        assert llm.config.kv_cache_config.tokens_per_block == 16
        assert len(llm.generate([1, 2, 3, 1, 2, 3], None).outputs[0].token_ids) > 0
    with pytest.raises(ValueError, match="unknown key 'speculative_config.max_draft'"):
        LLM("tiny-random", speculative_config={"decoding_type": "NGram", "max_draft": 2})
    with pytest.raises(ValueError, match="speculative_config.decoding_type must be one of 'NGram'"):
        LLM("tiny-random", speculative_config={"decoding_type": "Eagle"})


def test_help_shows_the_defaults_an_llm_uses(one_torch_thread):
    """Every LLM flag's shown default is the value an LLM built without it uses (the same
    description gives both); a default derived from the model says so instead of a number."""
    from tensorrt_llm.llmapi import LLM
    from tensorrt_llm.llmapi.llm_args import DERIVED_DEFAULTS

    helps = {a.dest: " ".join(a.help.split()) for a in serve.build_parser()._actions if a.help}
    shown_values = to_mapping(from_mapping(LlmArgs, serve.LLM_DEFAULTS))
    with LLM("tiny-random", **serve.LLM_DEFAULTS) as llm:
        used = to_mapping(llm.config)
        model_positions = llm.model_config.max_position_embeddings
    checked = 0
    for spec in walk(LlmArgs, defaults=serve.LLM_DEFAULTS):
        if spec.is_nested or spec.path in DERIVED_DEFAULTS:
            continue
        value, where = used, spec.path.split(".")
        for part in where:
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        if value is KeyError:
            continue  # the LLM's own keywords (device, seed, ...): not part of the executor's config
        expected = shown_values
        for part in where:
            expected = expected[part]
        assert value == expected, f"--{spec.path}: shown {expected!r}, used {value!r}"
        checked += 1
    assert checked > 20
    for path, words in DERIVED_DEFAULTS.items():
        assert f"(default: {words})" in helps[path], path
    assert "4096" not in helps["max_seq_len"]
    with LLM("tiny-random") as llm:
        assert llm.config.max_seq_len <= model_positions and llm.config.max_seq_len != ExecutorConfig().max_seq_len
