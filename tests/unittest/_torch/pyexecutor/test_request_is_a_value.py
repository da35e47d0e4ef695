"""A request is a value (STYLE.md): ``llm_request`` imports no engine, sampler or grammar module,
only value modules, which in turn import only value modules; outside the project, the standard
library and numpy. Read from the source with ``ast`` as ``test_import_graph`` reads it (nothing is
imported), so an import under ``if TYPE_CHECKING:`` or inside a function counts too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
PYEXECUTOR = "tensorrt_llm._torch.pyexecutor"

#: The modules a request may import: values and their checks, nothing that runs a step.
VALUE_MODULES = {
    f"{PYEXECUTOR}.llm_request",
    f"{PYEXECUTOR}.errors",  # typed errors
    f"{PYEXECUTOR}.config",  # configuration dataclasses
    f"{PYEXECUTOR}.sampling_config",  # SamplingConfig, its limits, TokenLogprob, CompiledGrammar
    f"{PYEXECUTOR}.beam_state",  # BeamConfig, BeamState
}
#: Outside the project: the standard library and numpy (the packed token array's checks).
THIRD_PARTY = {"numpy"}


def source_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` names in an import statement, anywhere in the file (absolute names;
    ``from pkg import name`` gives ``pkg.name`` when that is a module of the project, else ``pkg``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import ({node.module}); the project imports absolutely"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if source_of(name).exists() else node.module)
    return found


def outside_the_values(start: str, sources: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Per module reached from ``start`` through value modules: what it imports that is neither a
    value module, the standard library nor an allowed third-party package. ``sources``: a file
    to read for a module in place of the project's."""
    sources = sources or {}
    bad: dict[str, set[str]] = {}
    todo, seen = [start], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for target in imports_of(sources.get(module) or source_of(module)):
            top = target.partition(".")[0]
            if target in VALUE_MODULES:
                todo.append(target)
            elif top == "tensorrt_llm" or top not in sys.stdlib_module_names | THIRD_PARTY:
                bad.setdefault(module, set()).add(target)
    return bad


def test_llm_request_imports_value_modules_only():
    bad = outside_the_values(f"{PYEXECUTOR}.llm_request")
    assert not bad, "a request imports more than values:\n" + "\n".join(
        f"{module} -> {', '.join(sorted(targets))}" for module, targets in sorted(bad.items())
    )


def test_the_check_sees_a_sampler_import_under_type_checking(tmp_path):
    """The check can fail: a value module that names a sampler only for its annotations is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        f"from {PYEXECUTOR}.errors import InvalidRequestError\n"
        f"if TYPE_CHECKING:\n    from {PYEXECUTOR}.sampling.guided_decoder import Grammar\n"
        "def f():\n    import torch\n"
    )
    assert outside_the_values("probe", {"probe": probe}) == {
        "probe": {f"{PYEXECUTOR}.sampling.guided_decoder", "torch"},
    }
