"""Which layer may import which: the library (`distkv`) never imports the actors around it
(`ray_actors`), except where the cluster is wired together."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the places that create the actors and hand them to the library's classes
WIRING = {"distkv/spec.py", "distkv/status.py", "distkv/demo/runner.py", "distkv/serve_router.py"}


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_importing_the_library_imports_no_actor():
    code = (
        "import sys, distkv.directory, distkv.cluster, distkv.promotion, distkv.pool\n"
        "print(sorted(m for m in sys.modules if m == 'ray_actors' or m.startswith('ray_actors.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_the_wiring_imports_the_actors():
    importers = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "distkv").rglob("*.py")
        if any(m == "ray_actors" or m.startswith("ray_actors.") for m in imported_modules(path))
    }
    assert importers <= WIRING


def test_the_directory_client_has_no_ray_inside():
    for name in ("directory.py", "directory_state.py"):
        modules = imported_modules(ROOT / "distkv" / name)
        assert not any(m == "ray" or m.startswith(("ray.", "ray_actors")) for m in modules), name
