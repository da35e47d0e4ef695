"""No import cycles in ``tensorrt_llm/`` or ``benchmarks/``, counting every import statement:
module level, inside functions, and under ``if TYPE_CHECKING:``; and packages in layers.

Packages point one way too (STYLE.md): a building block never imports the layer that uses
it. :data:`LAYERS` ranks the packages, lowest first; every import between two packages
goes down, never level or up, which also rules out cycles
between packages::

    benchmarks                    (runs from the checkout; not in the wheel)
    tensorrt_llm (root), commands
    serve
    llmapi
    _torch.distributed            several ranks: rank executor, launcher, MultiRankExecutor
    _torch.pyexecutor             the executor layer
    _torch.models                 the torch models
    _torch.modules                their layers (attention calls the backends)
    _torch.attention_backend, mapping    building blocks

Inside ``_torch.pyexecutor`` the same rule ranks its sub-packages and modules
(:data:`PYEXECUTOR_LAYERS`): values < kv_cache < budget < scheduler < resource_manager < engine
< sampling < iteration < executor < py_executor < the creator and the shims.

A dependency points one way (STYLE.md): the KV manager answers questions, the budget
policy decides, the executor and ``ResourceManager`` sequence them. The graph is read from
the source with ``ast`` (nothing is imported), so a cycle hidden behind ``TYPE_CHECKING``
or a function-local import counts as much as any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
PACKAGES = ("tensorrt_llm", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_type_checking_and_local_imports(tmp_path):
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "tensorrt_llm._torch.pyexecutor.kv_cache.manager" in graph["tensorrt_llm._torch.pyexecutor.scheduler.capacity"]
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tensorrt_llm._torch.pyexecutor import scheduler\n"
        "def f():\n    import benchmarks.replay\n"
    )
    assert imports_of("probe", source, modules) == {"tensorrt_llm._torch.pyexecutor.scheduler", "benchmarks.replay"}


# Rank of each package: an import may only go to a package of lower rank (or its own).
LAYERS = {
    "tensorrt_llm.mapping": 0,
    "tensorrt_llm._torch.modules": 0.5,  # modules.attention calls attention_backend, as upstream's does
    "tensorrt_llm._torch.attention_backend": 0,
    "tensorrt_llm._torch.models": 1,
    "tensorrt_llm._torch.speculative": 1,
    "tensorrt_llm._torch.pyexecutor": 2,
    "tensorrt_llm._torch.distributed": 3,
    "tensorrt_llm.llmapi": 4,
    "tensorrt_llm.serve": 5,
    "tensorrt_llm.commands": 6,
    "tensorrt_llm": 6,
    "benchmarks": 7,
}


def package_of(module: str) -> str:
    """The entry of :data:`LAYERS` that holds ``module`` (the longest matching prefix)."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        if ".".join(parts[:length]) in LAYERS:
            return ".".join(parts[:length])
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def package_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Package -> package edges, each with the module imports that make it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in graph.items():
        for target in targets:
            if (a := package_of(name)) != (b := package_of(target)):
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return edges


def test_the_package_rule_sees_an_upward_import():
    edges = package_graph({"tensorrt_llm._torch.modules.linear": {"tensorrt_llm._torch.distributed.ops"},
                           "tensorrt_llm._torch.distributed.ops": set()})
    assert [(a, b) for a, b in edges if LAYERS[b] >= LAYERS[a]] == [
        ("tensorrt_llm._torch.modules", "tensorrt_llm._torch.distributed")
    ]


def test_packages_import_downward_only():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    upward = [f"{a} -> {b}: {', '.join(why[:3])}" for (a, b), why in sorted(package_graph(graph).items())
              if LAYERS[b] >= LAYERS[a]]
    assert not upward, "imports that point up (or sideways) between packages:\n" + "\n".join(upward)
    assert find_cycle({p: {b for a, b in package_graph(graph) if a == p} for p in LAYERS}) is None


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_wheel_ships_tensorrt_llm_only():
    """``benchmarks`` runs from the checkout: a top-level package of that name is not installed."""
    import tomllib

    import setuptools

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = setuptools.find_packages(str(ROOT), include=find["include"])
    assert "tensorrt_llm._torch.pyexecutor" in shipped
    assert {name.split(".")[0] for name in shipped} == {"tensorrt_llm"}


# Inside the executor layer: its sub-packages and top-level modules, lowest first. An import
# between two of them goes to a lower rank; the values at rank 0 may import one another (the
# module-level cycle test above keeps them honest).
PYEXECUTOR = "tensorrt_llm._torch.pyexecutor"
PYEXECUTOR_LAYERS = {
    # values: the request, its config pieces, the forward-pass cost, a batch, a response
    **dict.fromkeys(("errors", "config", "beam_state", "sampling_config", "llm_request", "forward_cost",
                     "scheduled_requests", "priority", "response"), 0),
    "kv_cache": 1,          # answers questions about blocks; decides nothing
    "budget": 2,            # the policies and the re-check: decisions as values
    "scheduler": 3,         # capacity and micro-batch scheduling, preemption
    "resource_manager": 4,  # prepare_resources: the re-check before any allocation
    "engine": 5,            # forward inputs, the engines
    "sampling": 6,          # samplers, drafter, guided decoding
    "iteration": 7,         # the parts of one iteration
    "executor": 8,          # loop, client interface, validation
    "py_executor": 9,       # the iteration itself
    **dict.fromkeys(("py_executor_creator", "kv_cache_manager", "model_engine", "sampler"), 10),  # wiring, shims
}


def pyexecutor_unit(module: str) -> str | None:
    """The entry of :data:`PYEXECUTOR_LAYERS` that holds ``module`` (None for the package itself)."""
    if not module.startswith(PYEXECUTOR + "."):
        return None
    unit = module[len(PYEXECUTOR) + 1 :].split(".")[0]
    assert unit in PYEXECUTOR_LAYERS, f"{module}: add {unit!r} to PYEXECUTOR_LAYERS"
    return unit


def pyexecutor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between two units of the executor layer that do not go down."""
    found = []
    for name, targets in sorted(graph.items()):
        if (a := pyexecutor_unit(name)) is None:
            continue
        for target in sorted(targets):
            b = pyexecutor_unit(target)
            if b is None or b == a:
                continue
            if PYEXECUTOR_LAYERS[b] > PYEXECUTOR_LAYERS[a] or (PYEXECUTOR_LAYERS[b] == PYEXECUTOR_LAYERS[a] > 0):
                found.append(f"{a} -> {b} ({name} -> {target})")
    return found


def test_the_executor_layer_rule_sees_an_upward_import():
    graph = {f"{PYEXECUTOR}.engine.simulated": {f"{PYEXECUTOR}.sampling.synthetic_sampler"},
             f"{PYEXECUTOR}.llm_request": {f"{PYEXECUTOR}.errors"}}
    assert pyexecutor_violations(graph) == [
        f"engine -> sampling ({PYEXECUTOR}.engine.simulated -> {PYEXECUTOR}.sampling.synthetic_sampler)"
    ]


def test_the_executor_layer_imports_downward_only():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    violations = pyexecutor_violations(graph)
    assert not violations, "imports inside pyexecutor/ that do not go down:\n" + "\n".join(violations)
