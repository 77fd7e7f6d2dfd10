"""Packaging tells the truth: every third-party module that distkv, its actors, its
benchmarks, scripts and tests import is a dependency of ray-distkv or in one of its extras
(pyproject.toml), so that `pip install 'ray-distkv[test]'` (and [bench], [vllm], [gpu],
[rdma]) is all a checkout needs."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("distkv", "ray_actors", "bench", "scripts", "tests")
# import names whose distribution is not installed here to say so (CUDA's), or differs
NOT_INSTALLED = {"cupy": "cupy-cuda12x"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {normalized(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in requirements}


def local_modules(path: pathlib.Path) -> set[str]:
    """What a script or test imports from beside it: its own folder's modules, and the
    test suite's shared helpers (conftest puts tests/ on the path)."""
    folders = {path.parent, ROOT / "tests"}
    return {p.stem for folder in folders for p in folder.glob("*.py")} | {
        d.name for folder in folders for d in folder.iterdir() if (d / "__init__.py").exists()
    }


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the files that import it."""
    found: dict[str, set[str]] = {}
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py"):
            local = local_modules(path) | {"distkv", "ray_actors"}
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    module = name.split(".")[0]
                    if module not in sys.stdlib_module_names and module not in local:
                        found.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    distributions = importlib.metadata.packages_distributions()
    wanted = declared()
    undeclared = {}
    for module, files in third_party_imports().items():
        names = distributions.get(module) or [NOT_INSTALLED.get(module, module)]
        if not any(normalized(name) in wanted for name in names):
            undeclared[module] = sorted(files)[:3]
    assert not undeclared, f"imported, and in no dependency or extra of pyproject.toml: {undeclared}"


def test_the_scan_sees_the_imports():
    """The scan finds what the suite is known to import (a scan that found nothing would
    declare everything fine)."""
    found = third_party_imports()
    assert {"numpy", "ray", "psutil", "pytest", "grpc"} <= set(found)
    assert "cluster_fakes" not in found and "distkv" not in found
