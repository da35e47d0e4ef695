"""Does a ``pip install --target`` site built here for the GPU machine (Python 3.12, x86-64 Linux)
have everything its packages require, but what the machine's image provides?

    python -m benchmarks.gpu.site_check SITE [--python-version 3.12]

Reads every ``*.dist-info`` in SITE, evaluates each requirement's markers for the target
interpreter (the extras other packages ask for included, e.g. ``httpx[http2]``), and lists the
requirements that nothing in SITE satisfies and that are not the image's (:data:`IMAGE`: torch
and transformers with what they bring). Exit status 1 when any is missing: ``h200_runs.sh
fetch`` runs it on the site it packs, so a missing wheel is found here, not on the GPU machine.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: what the GPU image has (torch 2.11 + CUDA, Triton 3.6, transformers) and what those require
IMAGE = frozenset(canonicalize_name(name) for name in (
    "torch", "triton", "transformers", "huggingface-hub", "hf-xet", "tokenizers", "safetensors", "numpy",
    "packaging", "pyyaml", "regex", "tqdm", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "mpmath",
    "networkx", "setuptools", "typer", "typer-slim", "shellingham", "requests", "urllib3", "charset-normalizer",
))


def _environment(python_version: str, extra: str = "") -> dict[str, str]:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "implementation_name": "cpython",
            "platform_release": "", "platform_version": "", "implementation_version": f"{python_version}.0",
            "extra": extra}


def _requirements(dist: Distribution, python_version: str, extra: str = "") -> list[Requirement]:
    out = []
    for text in dist.requires or ():
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(_environment(python_version, extra)):
            if extra and (requirement.marker is None or "extra" not in str(requirement.marker)):
                continue  # asked for the extra's own requirements only
            out.append(requirement)
    return out


def unmet(site: Path, python_version: str = "3.12") -> list[str]:
    """``"package: requirement"`` for each requirement of SITE's packages left unmet (module docstring)."""
    present = {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=[str(site)])}
    problems = []
    pending = [(name, dist, "") for name, dist in present.items()]
    seen_extras: set[tuple[str, str]] = set()
    while pending:
        name, dist, extra = pending.pop()
        for requirement in _requirements(dist, python_version, extra):
            wanted = canonicalize_name(requirement.name)
            target = present.get(wanted)
            extras = ",".join(sorted(requirement.extras))
            asked = f"{requirement.name}{f'[{extras}]' if extras else ''}{requirement.specifier}"  # no marker
            if target is None:
                if wanted not in IMAGE:
                    problems.append(f"{name}{f'[{extra}]' if extra else ''}: {asked}")
                continue
            if requirement.specifier and not requirement.specifier.contains(target.version, prereleases=True):
                problems.append(f"{name}: {asked} (SITE has {target.version})")
            for asked in requirement.extras:
                if (wanted, asked) not in seen_extras:
                    seen_extras.add((wanted, asked))
                    pending.append((wanted, target, asked))
    return sorted(set(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path)
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args(argv)
    count = sum(1 for _ in distributions(path=[str(args.site)]))
    problems = unmet(args.site, args.python_version)
    for problem in problems:
        print(f"unmet: {problem}")
    print(f"{count} packages in {args.site}: " + (f"{len(problems)} requirements unmet" if problems
                                                   else "every requirement met (or the image's)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
