"""Mermaid pictures of the import graph of a checkout: packages, and the modules of ``pyexecutor/``.

    python tools/import_graph.py [--root CHECKOUT] > graph.md

The graph is the import-graph test's own (``tests/unittest/_torch/pyexecutor/test_import_graph.py``
of that checkout, read with ``ast``: every import statement counts). Packages are grouped as the
test's ``LAYERS`` groups them; an edge is labelled with the number of module imports behind it.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

GROUPS = ("tensorrt_llm._torch.modules", "tensorrt_llm._torch.attention_backend", "tensorrt_llm._torch.models",
          "tensorrt_llm._torch.speculative",
          "tensorrt_llm._torch.pyexecutor", "tensorrt_llm._torch.distributed", "tensorrt_llm.llmapi",
          "tensorrt_llm.serve", "tensorrt_llm.commands", "tensorrt_llm.mapping", "benchmarks")
PYEXECUTOR = "tensorrt_llm._torch.pyexecutor."


def load_graph(root: Path) -> dict[str, set[str]]:
    path = root / "tests/unittest/_torch/pyexecutor/test_import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph_of_checkout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    modules = module.project_modules()
    return {name: module.imports_of(name, file, modules) for name, file in modules.items()}


def group(name: str) -> str:
    return next((g for g in GROUPS if name == g or name.startswith(g + ".")), "tensorrt_llm")


def short(name: str) -> str:
    return name.replace("tensorrt_llm._torch.", "_torch.").replace("tensorrt_llm.", "")


def packages(graph: dict[str, set[str]]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for name, targets in graph.items():
        for target in targets:
            if (a := group(name)) != (b := group(target)):
                counts[(a, b)] = counts.get((a, b), 0) + 1
    lines = ["graph BT"] + [f'    {short(a).replace(".", "_")}["{short(a)}"] -->|{n}| {short(b).replace(".", "_")}["{short(b)}"]'
                            for (a, b), n in sorted(counts.items())]
    return "\n".join(lines)


def pyexecutor_modules(graph: dict[str, set[str]]) -> str:
    lines = ["graph LR"]
    for name in sorted(graph):
        if name.startswith(PYEXECUTOR):
            for target in sorted(graph[name]):
                if target.startswith(PYEXECUTOR):
                    lines.append(f"    {name[len(PYEXECUTOR):]} --> {target[len(PYEXECUTOR):]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    graph = load_graph(args.root)
    print("```mermaid\n" + packages(graph) + "\n```\n")
    print("```mermaid\n" + pyexecutor_modules(graph) + "\n```")


if __name__ == "__main__":
    main()
