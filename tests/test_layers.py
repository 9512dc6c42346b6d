"""The ortq package's modules import each other without circles.

Every ``import``/``from ... import`` of an ortq module counts, at module level and inside functions
alike: an import moved into a function still ties the two modules together, it only hides the
circle until run time. Only blocks under ``if TYPE_CHECKING:`` are left out (they never run).

A package's ``__init__`` that runs because one of its submodules is imported is not an edge
(``from ortq import keys`` is an import of ``ortq.keys``, not of ``ortq``): were it one, every
module would be in a circle with ``ortq/__init__.py``, which imports the producer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "ortq"

#: A module's name mapped to the names of the package's modules it imports.
ImportGraph = dict[str, set[str]]


def module_files(package_root: Path) -> dict[str, Path]:
    """Every module of the package under ``package_root``, by dotted name (a package by its own)."""
    modules = {}
    for path in sorted(package_root.rglob("*.py")):
        parts = [package_root.name, *path.relative_to(package_root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` tests ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except those under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]))  # the else branch runs
        else:
            yield from _import_nodes(child)


def _absolute_base(statement: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module name that ``from <base> import ...`` names, relative levels resolved."""
    if statement.level == 0:
        return statement.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    anchor = package[: len(package) - (statement.level - 1)]
    return ".".join([*anchor, statement.module] if statement.module else anchor)


def _known_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (``import a.b.c`` imports a.b.c)."""
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        candidate = ".".join(parts[:length])
        if candidate in modules:
            return candidate
    return None


def imported_modules(importer: str, modules: Mapping[str, Path]) -> set[str]:
    """The package's modules that module ``importer`` imports, anywhere in it."""
    path = modules[importer]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    imported: set[str] = set()
    for statement in _import_nodes(tree):
        if isinstance(statement, ast.Import):
            names = [alias.name for alias in statement.names]
        else:
            base = _absolute_base(statement, importer, is_package)
            # ``from a import b`` imports module a.b where b is one, else takes name b from module a.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in statement.names]
        imported.update(found for name in names if (found := _known_module(name, modules)) is not None)
    imported.discard(importer)
    return imported


def import_graph(package_root: Path) -> ImportGraph:
    """Which of the package's modules each of its modules imports."""
    modules = module_files(package_root)
    return {name: imported_modules(name, modules) for name in modules}


def _reachable(start: str, graph: ImportGraph) -> set[str]:
    """Every module that importing ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for successor in graph[todo.pop()] - seen:
            seen.add(successor)
            todo.append(successor)
    return seen


def _cycle_through(start: str, group: set[str], graph: ImportGraph) -> list[str]:
    """A shortest circle of imports from ``start`` back to it inside ``group``, ``start`` at both ends."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & group):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in no circle of {sorted(group)}")


def import_cycles(graph: ImportGraph) -> list[list[str]]:
    """One circle of imports for each group of modules that import each other, shortest first."""
    reach = {module: _reachable(module, graph) for module in graph}
    cycles, covered = [], set()
    for module in sorted(graph):
        if module in reach[module] and module not in covered:  # on a circle, of a group not seen yet
            group = {other for other in reach[module] if module in reach[other]}
            covered |= group
            cycles.append(_cycle_through(module, group, graph))
    return sorted(cycles, key=lambda cycle: (len(cycle), cycle))


def test_the_ortq_package_has_no_import_circles() -> None:
    graph = import_graph(PACKAGE_ROOT)
    cycles = import_cycles(graph)
    assert not cycles, "import circles in ortq (break each by moving what both sides need to its owner):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_the_graph_sees_the_imports_that_make_circles() -> None:
    """What the circle test relies on, seen in ortq itself: every module is read, subpackages'
    too; ``from pkg import sub`` is an import of the submodule; an import inside a function counts."""
    graph = import_graph(PACKAGE_ROOT)
    assert {"ortq", "ortq.rqcompat", "ortq.worker.loop", "ortq.devices.adapters"} <= graph.keys()
    assert "ortq.keys" in graph["ortq.shards"]  # from ortq import keys
    assert "ortq.rqcompat.layout" in graph["ortq.rqcompat.book"]  # from ortq.rqcompat import layout
    assert "ortq.devices.dxgi" in graph["ortq.devices.adapters"]  # inside a function


def test_a_circle_made_inside_functions_and_relative_imports_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from .. import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nelse:\n    import pkg.c\n"
    )

    graph = import_graph(package)

    assert graph["pkg.d"] == {"pkg.c"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
