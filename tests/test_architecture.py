"""The import structure the design promises, read from the source (AST), without importing anything.

* Views never leak into the core: no module outside ``workbench/widgets/`` imports ``workbench.widgets``,
  not even lazily inside a function (the core reaches views only through ``workbench.display``).
* No import cycle among workbench modules at import time (module-level imports).
* The packages form a one-way stack: collapse every module into its subpackage (``workbench.plan``,
  ``workbench.checkpoint``, ...; top-level modules stay themselves) and count *every* import, lazy ones
  inside functions included. That graph must be acyclic: a lazy import hides a cycle from the
  interpreter, not from a reader (``checkpoint -> widgets -> checkpoint`` was one).

``if TYPE_CHECKING:`` blocks are not imports at run time and are left out. What each entry point
actually loads (no torch for ``import workbench``, the CLI's help, the server extension) is measured in
fresh interpreters by tests/test_imports.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "workbench"


def _modules() -> dict[str, tuple[Path, bool]]:
    """``dotted name -> (file, is_package)`` for every module of the workbench package."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module, module_level: bool) -> list[ast.stmt]:
    """Import statements; module level means run on import (top level, and inside top-level if/try)."""
    found: list[ast.stmt] = []

    def visit(body: list[ast.stmt], top: bool) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if _is_type_checking(node):
                    continue
                visit(node.body, top)
                visit(node.orelse, top)
            elif isinstance(node, ast.Try):
                visit(node.body, top)
                for h in node.handlers:
                    visit(h.body, top)
                visit(node.orelse, top)
                visit(node.finalbody, top)
            elif isinstance(node, (ast.With,)):
                visit(node.body, top)
            elif not module_level:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    child = getattr(node, field, None)
                    if isinstance(child, list):
                        visit([c for c in child if isinstance(c, ast.AST)], False)
                if isinstance(node, ast.ExceptHandler):
                    visit(node.body, False)

    visit(tree.body, True)
    return found


def _targets(node: ast.stmt, module: str, is_pkg: bool) -> set[str]:
    """The workbench modules an import statement loads (the longest known prefix of each name)."""
    def known(name: str) -> str | None:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        return name or None

    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module if is_pkg else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        # `from a.b import c` loads a.b.c when c is a module, else just a.b
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return {t for t in map(known, names) if t is not None and t != module}


def import_graph(module_level: bool) -> dict[str, set[str]]:
    graph = {}
    for name, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_targets(n, name, is_pkg) for n in _import_nodes(tree, module_level)))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


def package_of(module: str) -> str:
    """``workbench.plan.types`` -> ``workbench.plan``; a top-level module (``workbench.config``) is itself."""
    parts = module.split(".")
    head = ".".join(parts[:2])
    return head if len(parts) > 2 or (head in MODULES and MODULES[head][1] and len(parts) == 2) else module


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, targets in import_graph(module_level=False).items():
        pa = package_of(a)
        graph.setdefault(pa, set()).update(package_of(b) for b in targets if package_of(b) != pa)
    return graph


def test_the_scan_sees_the_package():
    # guards the test itself: a broken scan would find no imports and pass everything
    graph = import_graph(module_level=False)
    assert "workbench.plan.types" in graph and "workbench.config" in graph["workbench.plan.types"]
    assert "workbench.checkpoint.manifest" in graph["workbench.widgets.checkpoint_browser"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert package_of("workbench.plan.types") == "workbench.plan" and package_of("workbench.config") == "workbench.config"


def test_no_module_outside_widgets_imports_widgets():
    offenders = sorted(f"{a} imports {b}" for a, targets in import_graph(module_level=False).items()
                       if not a.startswith("workbench.widgets")
                       for b in targets if b == "workbench.widgets" or b.startswith("workbench.widgets."))
    assert not offenders, ("the core must not import the view layer; register a view with "
                           f"workbench.display.register_view instead: {offenders}")


def test_module_level_imports_have_no_cycle():
    cycle = find_cycle(import_graph(module_level=True))
    assert cycle is None, "import cycle at import time: " + " -> ".join(cycle or [])


def test_packages_import_one_way_even_lazily():
    cycle = find_cycle(package_graph())
    assert cycle is None, ("packages import each other in a cycle (lazy imports inside functions count): "
                           + " -> ".join(cycle or []) + "; move the shared piece down into a lower module")


@pytest.mark.parametrize("core", ["workbench.plan.types", "workbench.checkpoint.manifest", "workbench.train.launcher"])
def test_core_objects_reach_views_through_the_registry(core):
    graph = import_graph(module_level=False)
    assert "workbench.display" in graph[core], f"{core} should render through workbench.display"
