"""The one direction of distkv's imports (docs/architecture.md, "The plan").

Layers, lowest first: the foundation (`distkv.abstract`, `distkv.config`, `distkv.names`),
`observability`, `storage`, `directory`, `transfer`, `routing`, `replica`, then the adapters at the
top (`distkv.vllm`, `distkv.vllm_tier`, `distkv.serve_router`, `distkv.serve_llm`, `distkv.cli`,
`distkv.demo`). A module imports its own
layer and those below it, never one above. `ray_actors` is the one meeting point with Ray:
it imports the library, and the library imports it only where the cluster is wired
together. The old module paths kept for pickles import the library and nothing imports them.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ["foundation", "observability", "storage", "directory", "transfer", "routing", "replica", "adapters"]
FOUNDATION = {"distkv.abstract", "distkv.config", "distkv.names"}
ADAPTERS = {
    "distkv.vllm", "distkv.vllm_tier", "distkv.serve_router", "distkv.serve_llm", "distkv.cli", "distkv.__main__", "distkv.demo",
}
# the old paths of what crosses Ray pickled (docs/operations.md, "Rolling upgrades")
ALIASES = {"distkv.directory_state", "distkv.pool", "distkv.node_table", "distkv.segments", "distkv.stats"}
# where the cluster is wired together: they create the actors and hand them to the plain classes
WIRING = {"distkv/replica/join.py", "distkv/demo/runner.py", "distkv/serve_router.py"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (a name imported from a
    package counts as its submodule where there is one)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            for alias in node.names:
                sub = ROOT.joinpath(*node.module.split("."), alias.name)
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    names.add(f"{node.module}.{alias.name}")
    return names


def layer_of(module: str) -> str | None:
    """The layer of a distkv module; None for the package itself and the alias modules."""
    if module in FOUNDATION:
        return "foundation"
    top = ".".join(module.split(".")[:2])
    if top in ADAPTERS:
        return "adapters"
    sub = module.split(".")[1] if module.count(".") else ""
    return sub if sub in LAYERS else None


LIBRARY = sorted((ROOT / "distkv").rglob("*.py"))


def test_every_module_of_the_library_has_a_layer():
    unplaced = [module_name(p) for p in LIBRARY if layer_of(module_name(p)) is None]
    assert sorted(unplaced) == sorted(ALIASES | {"distkv"})


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_its_own_layer_and_those_below(path):
    module = module_name(path)
    layer = layer_of(module)
    if layer is None:  # an alias module: the library below the adapters
        layer = "replica"
    upward = {
        m for m in imported_modules(path)
        if m.startswith("distkv.") and layer_of(m) is not None and LAYERS.index(layer_of(m)) > LAYERS.index(layer)
    }
    assert not upward, f"{module} ({layer}) imports {sorted(upward)}"


def test_nothing_in_the_library_imports_the_old_paths():
    importers = {
        str(p.relative_to(ROOT)) for p in LIBRARY + sorted((ROOT / "ray_actors").rglob("*.py"))
        if imported_modules(p) & ALIASES
    }
    assert not importers


def test_only_the_wiring_imports_the_actors():
    importers = {
        str(path.relative_to(ROOT))
        for path in LIBRARY
        if any(m == "ray_actors" or m.startswith("ray_actors.") for m in imported_modules(path))
    }
    assert importers <= WIRING


@pytest.mark.parametrize("package", ["observability", "storage", "directory", "transfer", "routing", "replica"])
def test_a_subpackage_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "distkv" / package / "__init__.py").read_text()))
    assert doc and "May import" in doc


@pytest.mark.parametrize("package", ["directory", "storage", "transfer", "routing"])
def test_no_ray_in_the_directory_storage_transfer_and_routing(package):
    """Not even inside a function: what they need of Ray comes in as plain interfaces
    (a shard's client, a NodeAgent's fetch). Observability imports it only inside the
    functions that run where Ray does (the exporter, `distkv status`): the test below."""
    for path in (ROOT / "distkv" / package).rglob("*.py"):
        modules = imported_modules(path)
        assert not any(m == "ray" or m.startswith(("ray.", "ray_actors")) for m in modules), path


def test_importing_the_library_imports_neither_ray_nor_an_actor():
    """Every module of the six subpackages, imported: no Ray, no actor (the composition
    root imports them when it joins a cluster)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "for sub in ('observability', 'storage', 'directory', 'transfer', 'routing', 'replica'):\n"
        "    package = importlib.import_module('distkv.' + sub)\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'ray_actors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_small_modules_and_classes():
    """One concern each: no module of the library over 600 lines, no class over 300."""
    too_long = []
    for path in LIBRARY:
        text = path.read_text()
        if len(text.splitlines()) > 600:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not too_long
