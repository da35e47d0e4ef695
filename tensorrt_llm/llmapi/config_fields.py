"""Config dataclasses' fields as mapping keys and command-line flags: generated, never copied.

A setting is described once, by a field of a config dataclass (its name, type hint, default
and comment). Walked recursively, the fields give every other surface, as vLLM's
``EngineArgs`` does; a new field exists on all of them at once::

    @dataclass fields ──walk()──► one FieldSpec per key: dotted path, type, default, help
       │
       ├─ from_mapping(cls, {...})       a YAML file, LLM(...) keywords, replay options ──► cls
       ├─ parse_mapping(cls, {...})      ──► the keyword arguments given, converted (sparse)
       ├─ add_arguments(parser, cls)     ──► --flags;  overrides_from_args(args, cls) ──► {...}
       └─ to_mapping(obj)                ──► the mapping back (the settings a report records)

Types: ``int``, ``float`` (an int is accepted), ``bool``, ``str``, an ``Enum`` (by value),
``list[int]`` and a nested dataclass (a mapping of its keys), each optionally ``| None``
(``null`` is then a value). Nothing is coerced: YAML ``true`` or ``"8"`` for an int is refused
by key. Values are then checked by each dataclass's own ``__post_init__``.

Keys: a field's name; a nested dataclass's keys under it (``kv_cache_config.tokens_per_block``);
an *inlined* dataclass's keys (``nested(cls, inline=True)``) at its parent's level, as
``LLM(**executor_options)`` takes ``ExecutorConfig``'s fields. An unknown key, at any depth, is
refused by its dotted name. A nested field's default is a mapping of overrides of its class's
defaults (``nested(ExecutorConfig, max_num_tokens=4096)``); a mapping given for the field is
merged over it, so giving one key keeps the others.

Flags: ``--path`` (``--kv_cache_config.tokens_per_block``; with ``spell="-"``
``--kv-cache-config.tokens-per-block``), ``--flag/--no-flag`` for a bool, ``choices`` for an
enum, ``N [N ...]`` for a list, YAML text (a mapping, or ``null``) for a whole nested dataclass,
``none`` for an optional number. No flag has a default: only the flags given override anything.
Help is the field's ``metadata["help"]``, else its comment in the class source (the comment
lines just above the field and the one that ends its line).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import yaml

from tensorrt_llm._torch.pyexecutor.config import parse_enum

__all__ = [
    "FieldSpec", "add_arguments", "build_nested", "deep_merge", "from_mapping", "nested", "overrides_from_args",
    "parse_mapping", "to_mapping", "walk",
]

_SCALARS = (bool, int, float, str)
_MISSING = dataclasses.MISSING


# ---------------------------------------------------------------------------------------
# The description: one FieldSpec per key
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One key of a config dataclass, as every surface sees it."""

    path: str  # dotted key from the root: "kv_cache_config.tokens_per_block"
    kind: type  # bool, int, float, str, an Enum, list, or a (nested) dataclass
    optional: bool  # `X | None`: None is a value
    item: type | None  # a list's item type
    default: Any  # the effective default: a value, a mapping for a nested dataclass, or MISSING
    help: str
    choices: tuple[str, ...] | None  # an enum's values, or metadata["choices"] of a str field
    metavar: str | None  # metadata["metavar"]: how --help spells the value

    @property
    def is_nested(self) -> bool:
        return dataclasses.is_dataclass(self.kind)


def nested(cls: type, /, *, inline: bool = False, **defaults: Any) -> Any:
    """A dataclass field holding a ``cls``, by default ``cls`` built from ``defaults`` (keyword
    overrides of its class defaults; a nested mapping for a nested field). A mapping given for
    the field is merged over ``defaults``. With ``inline``, ``cls``'s keys are keys of the parent.
    """
    metadata = {"defaults": dict(defaults), "inline": inline}
    return dataclasses.field(default_factory=lambda: from_mapping(cls, defaults), metadata=metadata)


def walk(cls: type, *, defaults: Mapping[str, Any] | None = None, exclude: Iterable[str] = ()) -> Iterator[FieldSpec]:
    """Every key of ``cls``, depth first: a nested dataclass's own key, then its fields' keys.

    ``defaults`` (a nested mapping) overrides the effective defaults; ``exclude`` drops dotted
    keys (and whatever is under them).
    """
    yield from _walk(cls, defaults or {}, frozenset(exclude), "")


def _walk(cls: type, defaults: Mapping[str, Any], exclude: frozenset[str], prefix: str) -> Iterator[FieldSpec]:
    defaults = deep_merge(_inline_defaults(cls), defaults)
    for key, (field, hint) in _keys(cls).items():
        path = prefix + key
        if path in exclude:
            continue
        kind, optional, item = _analyse(hint, f"{cls.__name__}.{key}")
        default = _field_default(field, kind)
        if key in defaults:
            given = defaults[key]
            both = isinstance(default, Mapping) and isinstance(given, Mapping)
            default = deep_merge(default, given) if both else given
        yield FieldSpec(path, kind, optional, item, default, _help(field, _owner(cls, key)),
                        _choices(kind, field), field.metadata.get("metavar"))
        if dataclasses.is_dataclass(kind):
            sub = default if isinstance(default, Mapping) else {}
            yield from _walk(kind, sub, exclude, path + ".")


@functools.cache
def _keys(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """``cls``'s keys at its own level: its fields, an inlined field replaced by its dataclass's keys."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, tuple[dataclasses.Field, Any]] = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("inline"):
            inner = _keys(hints[field.name])
        else:
            inner = {field.name: (field, hints[field.name])}
        for key, value in inner.items():
            if key in keys:
                raise TypeError(f"{cls.__name__}: key {key!r} is defined twice (an inlined dataclass repeats it)")
            keys[key] = value
    return keys


@functools.cache
def _owner(cls: type, key: str) -> type:
    """The dataclass that declares ``key`` (``cls`` itself, an inlined one, or a base class)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.metadata.get("inline") and key in _keys(hints[field.name]):
            return _owner(hints[field.name], key)
    return next(k for k in cls.__mro__ if key in k.__dict__.get("__annotations__", {}))


def _inline_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls``'s inlined fields, as keys of ``cls`` (they are merged under a mapping)."""
    hints = typing.get_type_hints(cls)
    merged: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("inline"):
            merged |= deep_merge(_inline_defaults(hints[field.name]), field.metadata.get("defaults", {}))
    return merged


def _analyse(hint: Any, where: str) -> tuple[type, bool, type | None]:
    """``(kind, optional, item)`` of a type hint; a hint this module does not understand is a bug."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            kind, _, item = _analyse(args[0], where)
            return kind, True, item
    elif typing.get_origin(hint) is list and typing.get_args(hint)[0] in (int, float, str):
        return list, False, typing.get_args(hint)[0]
    elif hint in _SCALARS or dataclasses.is_dataclass(hint) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint, False, None
    raise TypeError(f"{where}: type {hint!r} cannot be set from a mapping or a flag")


def _field_default(field: dataclasses.Field, kind: type) -> Any:
    if "defaults" in field.metadata:
        return field.metadata["defaults"]
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return {} if dataclasses.is_dataclass(kind) else field.default_factory()
    return _MISSING


def _choices(kind: type, field: dataclasses.Field) -> tuple[str, ...] | None:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return tuple(str(member.value) for member in kind)
    choices = field.metadata.get("choices")
    return tuple(choices) if choices is not None else None


def _help(field: dataclasses.Field, owner: type) -> str:
    return field.metadata.get("help") or _comments(owner).get(field.name, "")


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the comment lines right above it, then the one
    ending its line. Empty when the source cannot be read (the help is then empty too)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[node.end_lineno]] if node.end_lineno in comments else []
            found[node.target.id] = " ".join(above + trailing)
    return found


# ---------------------------------------------------------------------------------------
# Mappings: YAML, keyword arguments, reports
# ---------------------------------------------------------------------------------------


def parse_mapping(cls: type, data: Any, *, path: str = "", exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The keyword arguments ``data`` gives for ``cls``: only its keys, each converted to its
    field's type (an enum value to its member; a nested mapping merged over the field's default
    and built into its dataclass). Keys of an inlined dataclass stay at this level. Raises
    ValueError naming the first unknown key or wrong value by its dotted path."""
    exclude = frozenset(exclude)
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or cls.__name__} must be a mapping, got {type(data).__name__}")
    keys = _keys(cls)
    accepted = [key for key in keys if _join(path, key) not in exclude]
    converted = {}
    for key, value in data.items():
        dotted = _join(path, key)
        if key not in accepted:
            raise ValueError(f"unknown key {dotted!r} (accepted: {', '.join(sorted(accepted))})")
        field, hint = keys[key]
        converted[key] = _convert(field, hint, value, dotted, exclude)
    return converted


def from_mapping(cls: type, data: Any, *, path: str = "", exclude: Iterable[str] = ()) -> Any:
    """``cls`` built from ``data`` (a mapping of its keys) over its defaults; see ``parse_mapping``.
    The dataclass's own validation runs; its ValueError or TypeError comes out as a ValueError."""
    data = deep_merge(_inline_defaults(cls), data) if isinstance(data, Mapping) else data
    return _construct(cls, parse_mapping(cls, data, path=path, exclude=exclude))


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    """``cls`` from converted keyword arguments at its level (an inlined field takes its keys)."""
    hints = typing.get_type_hints(cls)
    own = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("inline"):
            inner = {key: kwargs[key] for key in _keys(hints[field.name]) if key in kwargs}
            if inner:
                own[field.name] = _construct(hints[field.name], inner)
        elif field.name in kwargs:
            own[field.name] = kwargs[field.name]
    try:
        return cls(**own)
    except TypeError as error:
        raise ValueError(str(error)) from None


def build_nested(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each mapping given for a nested dataclass field of ``cls`` built into that
    dataclass, as the YAML's is (``speculative_config={"decoding_type": "NGram", ...}``: keys
    checked by name, merged over the field's defaults). Everything else is left as given, for
    ``cls`` to check: ``LLM(...)`` takes its config objects and their dict forms alike."""
    keys = _keys(cls)
    built = dict(kwargs)
    for key, value in kwargs.items():
        if key in keys and isinstance(value, Mapping):
            field, hint = keys[key]
            if dataclasses.is_dataclass(_analyse(hint, key)[0]):
                built[key] = _convert(field, hint, value, key, frozenset())
    return built


def to_mapping(obj: Any, *, exclude: Iterable[str] = (), path: str = "") -> dict[str, Any]:
    """The mapping ``from_mapping`` takes back to ``obj`` (but the dotted keys in ``exclude``):
    enums by value, nested dataclasses as mappings, an inlined one's keys at its parent's level.
    Plain data, ready for JSON."""
    exclude = frozenset(exclude)
    out: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.metadata.get("inline"):
            out |= to_mapping(value, exclude=exclude, path=path)
        elif _join(path, field.name) not in exclude:
            out[field.name] = _plain(value, exclude, _join(path, field.name))
    return out


def _plain(value: Any, exclude: frozenset[str], path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_mapping(value, exclude=exclude, path=path)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v, exclude, path) for v in value]
    return value


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s keys on top; where both hold a mapping, merged key by key."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            value = deep_merge(merged[key], value)
        merged[key] = value
    return merged


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _convert(field: dataclasses.Field, hint: Any, value: Any, path: str, exclude: frozenset[str]) -> Any:
    kind, optional, item = _analyse(hint, path)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{path} must not be null")
    if dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{path} must be a mapping, got {type(value).__name__}")
        merged = deep_merge(field.metadata.get("defaults", {}), value)
        return from_mapping(kind, merged, path=path, exclude=exclude)
    if kind is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path} must be a list, got {value!r}")
        return [_scalar(item, v, f"{path}[]") for v in value]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return parse_enum(kind, value, path)
    return _scalar(kind, value, path)


def _scalar(kind: type, value: Any, path: str) -> Any:
    """``value`` if it is a ``kind`` (bool is no int; an int is a float), else ValueError."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
        return value
    raise ValueError(f"{path} must be {_KIND_NAMES[kind]}, got {value!r}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------------------------------
# Command-line flags
# ---------------------------------------------------------------------------------------


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    spell: str = "_",
    aliases: Mapping[str, Iterable[str]] | None = None,
    names: Mapping[str, Iterable[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    derived: Mapping[str, str] | None = None,
    exclude: Iterable[str] = (),
) -> list[argparse.Action]:
    """A flag for every key of ``cls`` (``walk``), none with a default: a flag not given is not
    in the namespace, so that ``overrides_from_args`` returns only what was given.

    ``spell`` joins words in flag names (``"_"``: upstream's ``--max_num_tokens``; ``"-"``:
    ``--max-num-tokens``). By dotted key, ``aliases`` adds option strings
    (``{"tensor_parallel_size": ["--tp_size"]}``) and ``names`` replaces the generated one.
    ``defaults`` changes the defaults the help shows (the caller applies them); ``derived`` gives,
    by dotted key, the words the help shows for a default the caller derives when the flag is not
    given (``{"max_seq_len": "the model's max_position_embeddings ..."}``) instead of the field's.
    """
    aliases, names = aliases or {}, names or {}
    specs = list(walk(cls, defaults=defaults, exclude=exclude))
    derived = derived or {}
    unknown = (set(aliases) | set(names) | set(derived)) - {spec.path for spec in specs}
    if unknown:
        raise ValueError(f"flag names for keys {cls.__name__} does not have: {sorted(unknown)}")
    actions = []
    for spec in specs:
        option_strings = [*names.get(spec.path, ["--" + spec.path.replace("_", spell)]), *aliases.get(spec.path, ())]
        actions.append(parser.add_argument(*option_strings, dest=spec.path, default=argparse.SUPPRESS,
                                           help=_flag_help(spec, derived.get(spec.path)), **_flag_kind(spec)))
    return actions


def overrides_from_args(args: argparse.Namespace, cls: type, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The flags of ``add_arguments(parser, cls)`` given on the command line, as a nested mapping
    of ``cls``'s keys (a whole nested mapping first, its keys' own flags merged over it)."""
    overrides: dict[str, Any] = {}
    for spec in walk(cls, exclude=exclude):
        if hasattr(args, spec.path):
            *parents, key = spec.path.split(".")
            level = overrides
            for parent in parents:
                if not isinstance(level.get(parent), dict):
                    level[parent] = {}
                level = level[parent]
            level[key] = getattr(args, spec.path)
    return overrides


def _flag_kind(spec: FieldSpec) -> dict[str, Any]:
    """add_argument's keywords for how ``spec``'s value is spelled on the command line."""
    if spec.is_nested:
        return {"type": _yaml_value(spec), "metavar": spec.metavar or "YAML"}
    if spec.kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if spec.kind is list:
        return {"type": spec.item, "nargs": "+", "metavar": spec.metavar or "N"}
    if spec.choices is not None:
        return {"choices": spec.choices, "type": str, "metavar": spec.metavar}
    convert = {int: int, float: float, str: str}[spec.kind]
    metavar = spec.metavar or {int: "N", float: "X", str: "TEXT"}[spec.kind]
    if spec.optional and spec.kind is not str:
        convert = _or_none(convert)
    return {"type": convert, "metavar": metavar}


def _or_none(convert):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in "invalid int value"
    return parse


def _yaml_value(spec: FieldSpec):
    def parse(text: str):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise argparse.ArgumentTypeError(f"not valid YAML: {error}") from None
        if not isinstance(value, dict) and not (value is None and spec.optional):
            raise argparse.ArgumentTypeError(f"expected a YAML mapping{' or null' if spec.optional else ''}, got {text!r}")
        return value

    parse.__name__ = "YAML mapping"
    return parse


def _flag_help(spec: FieldSpec, derived: str | None = None) -> str:
    text = spec.help.rstrip(".")
    if spec.is_nested:
        what = f"{spec.kind.__name__}'s keys as a YAML mapping" + (" (null: none)" if spec.optional else "")
        text = f"{text}; {what}" if text else what
    shown = derived if derived is not None else _shown_default(spec)
    text = f"{text} (default: {shown})" if shown is not None else text
    return text.replace("%", "%%")  # argparse formats help with %


def _shown_default(spec: FieldSpec) -> str | None:
    default = spec.default
    if default is _MISSING or spec.is_nested:
        return None if default is not None else "null"
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, bool):
        return "true" if default else "false"
    return "none" if default is None else str(default)
