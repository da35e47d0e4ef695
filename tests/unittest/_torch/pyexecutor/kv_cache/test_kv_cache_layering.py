"""The KV cache is bookkeeping: it imports no engine, sampler, budget, scheduler, executor or
iteration module, and its modules import each other in one order, lowest first (the order
``kv_cache/__init__.py`` lists). Read from the source with ``ast``: imports under
``TYPE_CHECKING`` and inside functions count as much as any other."""

import ast
from pathlib import Path

import tensorrt_llm._torch.pyexecutor.kv_cache as kv_cache

PACKAGE = "tensorrt_llm._torch.pyexecutor"
FORBIDDEN = ("engine", "sampling", "budget", "scheduler", "executor", "iteration")
ORDER = ["events", "block", "lru", "prefix_tree", "host_tier", "values", "block_pool", "beam_tables", "sequence_blocks",
         "prefix_reuse", "copy_batch", "storage", "manager"]  # the manager names the storage's type only


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = f"{PACKAGE}.kv_cache" if node.level == 1 else node.module  # ``from .x import y``: a sibling
            if node.level == 1 and node.module:
                base = f"{base}.{node.module}"
            assert node.level <= 1, "an import from above kv_cache/: name it in full"
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict[str, Path]:
    return {path.stem: path for path in Path(kv_cache.__file__).parent.glob("*.py") if path.stem != "__init__"}


def test_every_module_is_in_the_order():
    assert sorted(modules()) == sorted(ORDER)


def test_no_engine_module_is_imported():
    for name, path in modules().items():
        bad = sorted(i for i in imports(path) for p in FORBIDDEN if i.startswith(f"{PACKAGE}.{p}"))
        assert not bad, f"kv_cache.{name} imports {bad}"


def test_modules_import_only_those_below_them():
    for name, path in modules().items():
        below = set(ORDER[: ORDER.index(name)])
        siblings = {i.split(".")[4] for i in imports(path) if i.startswith(f"{PACKAGE}.kv_cache.")}
        assert siblings <= below, f"kv_cache.{name} imports {sorted(siblings - below)}, not below it"
