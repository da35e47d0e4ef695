"""Submission-time validation is bookkeeping: it depends on no engine (STYLE.md's layering rule).

``RequestLimits.of`` takes the three numbers it needs of an engine through the ``EngineLimits``
protocol, so any object answering them will do, and neither it nor the scheduler imports an
engine or sampler module, directly or through what they import (``TYPE_CHECKING`` and
function-local imports counted: the graph is read from the source).
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from tensorrt_llm._torch.pyexecutor.errors import InvalidRequestError
from tensorrt_llm._torch.pyexecutor.executor.validation import RequestLimits, validate_request
from tests.helpers.factories import make_config, make_kv_cache_manager, make_request

ROOT = Path(__file__).resolve().parents[5]
PYEXECUTOR = "tensorrt_llm._torch.pyexecutor"
BOOKKEEPING = [f"{PYEXECUTOR}.executor.validation", f"{PYEXECUTOR}.scheduler"]
FORBIDDEN = (f"{PYEXECUTOR}.engine", f"{PYEXECUTOR}.sampling")


def _forbidden(module: str) -> bool:
    return any(module == package or module.startswith(package + ".") for package in FORBIDDEN)


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports(module: str, path: Path) -> set[str]:
    """The project modules ``module`` names in any import statement (package-relative resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name.startswith("tensorrt_llm") and _path(name) is not None)
    return found


def _reached(start: str) -> dict[str, str]:
    """Every project module ``start`` imports, directly or not: module -> the module that imports it."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in _imports(module, _path(module)):
            if target not in via and target != start:
                via[target] = module
                todo.append(target)
    return via


def test_the_walk_sees_an_engine_import():
    reached = _reached(f"{PYEXECUTOR}.py_executor")
    assert any(map(_forbidden, reached)), "the walk must be able to find what it forbids"


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_bookkeeping_imports_no_engine_or_sampler(module):
    via = _reached(module)
    bad = sorted(filter(_forbidden, via))

    def chain(target: str) -> str:
        path = [target]
        while path[-1] in via:
            path.append(via[path[-1]])
        return " <- ".join(path)

    assert not bad, f"{module} reaches engine/sampler code: " + "; ".join(chain(m) for m in bad)


def test_limits_take_any_object_that_answers_the_engine_questions():
    config = make_config(max_seq_len=64, num_blocks=16, tokens_per_block=4)
    kv = make_kv_cache_manager(config)
    engine = types.SimpleNamespace(vocab_size=50, max_beam_width=2, supports_draft_tokens=False)
    limits = RequestLimits.of(config, kv, engine)
    assert (limits.vocab_size, limits.max_beam_width, limits.supports_draft_tokens) == (50, 2, False)
    validate_request(make_request([1, 2, 49], max_new_tokens=4), limits, kv)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        validate_request(make_request([1, 2, 50], max_new_tokens=4), limits, kv)
    with pytest.raises(InvalidRequestError, match="beam width 3"):
        validate_request(make_request([1, 2, 3], max_new_tokens=4, beam_width=3), limits, kv)
