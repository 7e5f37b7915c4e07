"""The package layout (issue 35): every module imports on its own, none is longer than
MAX_LINES, and sbnet_cupy's modules import each other without a circle."""

import ast
import importlib
import pathlib
import sys

import pytest

pytestmark = pytest.mark.version_free

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
MAX_LINES = 500
# Modules allowed past MAX_LINES, each with its reason.
LONG = {
}


def _modules(package):
    """Dotted names of a package's modules (its __init__ as the package's name), by path."""
    names = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


SBNET = _modules("sbnet_cupy")
TORCH = _modules("torch_bridge")


@pytest.mark.parametrize("name", sorted(SBNET))
def test_module_imports_on_its_own(name):
    """Each module of sbnet_cupy imports with no module of the package loaded before it (the
    package's modules are set aside and put back afterwards, so the other tests keep theirs)."""
    kept = {k: m for k, m in sys.modules.items() if k == "sbnet_cupy" or
            k.startswith("sbnet_cupy.")}
    try:
        for key in kept:
            del sys.modules[key]
        importlib.import_module(name)
    finally:
        for key in [k for k in sys.modules if k == "sbnet_cupy" or k.startswith("sbnet_cupy.")]:
            del sys.modules[key]
        sys.modules.update(kept)


@pytest.mark.parametrize("name", sorted(TORCH))
def test_torch_bridge_module_imports(name):
    # Its ops register with torch once a process: imported in place, not afresh.
    pytest.importorskip("torch")
    importlib.import_module(name)


@pytest.mark.parametrize("path", sorted({**SBNET, **TORCH}.values()),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_is_short(path):
    key = path.relative_to(ROOT).as_posix()
    lines = len(path.read_text().splitlines())
    if key in LONG:
        pytest.skip(f"{lines} lines: {LONG[key]}")
    assert lines <= MAX_LINES, f"{key} has {lines} lines (at most {MAX_LINES})"


def test_long_modules_listed_are_long():
    for key in LONG:
        path = ROOT / key
        assert path.exists() and len(path.read_text().splitlines()) > MAX_LINES, (
            f"{key} need no longer be listed in LONG")


def _imports(name, path):
    """The sbnet_cupy modules that module `name` imports when it is imported (its statements
    outside functions and classes). A package's __init__, which Python imports before any of
    its modules, counts only where a name is taken from it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                # `from package import module` needs the module (the package is its parent,
                # imported first in any case); `from module import name` needs the module.
                found.update(f"{source}.{a.name}" if f"{source}.{a.name}" in SBNET else source
                             for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in SBNET and m != name}


def test_no_import_circle():
    graph = {name: _imports(name, path) for name, path in SBNET.items()}
    state, path, circles = {}, [], []

    def walk(node):  # depth first; a module met again while on the path closes a circle
        state[node] = "open"
        path.append(node)
        for after in sorted(graph[node]):
            if state.get(after) == "open":
                circles.append(path[path.index(after):] + [after])
            elif after not in state:
                walk(after)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
