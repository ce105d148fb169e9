"""No import circle among the package's modules, found statically (``ast``): every import statement counts, at
module level, inside a function, and under ``if TYPE_CHECKING:``. A circle dodged by moving an import into a
function is still two modules that each need the other, and the one that loads second sees the first
half-initialised; a circle dodged by ``TYPE_CHECKING`` is still two modules that cannot be read, typed or moved
apart one without the other.

An edge is what an ``import`` statement names: ``import a.b`` and ``from a import b`` lead to ``a.b`` when that is
a module of the package, ``from a import name`` to ``a`` (the package ``__init__``). The parents an import
initialises on the way are left out (a package's ``__init__`` importing its own modules, which import their
siblings by full name, is how packages are built).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from fixtures.source_trees import write_package

import pgregistry

PACKAGE = Path(pgregistry.__file__).resolve().parent


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth (functions and ``if TYPE_CHECKING:`` bodies too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level, inside functions, for type checking)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:  # import a.b.name_of_an_attribute: a.b
                        target = target.rpartition(".")[0]
                    if target:
                        graph[name].add(target)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    graph[name].add(submodule)
                elif base in modules:
                    graph[name].add(base)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle per strongly connected set of modules (first module repeated at the end), sorted."""
    cycles = []
    for start in sorted(graph):
        previous: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in previous:
            module = queue.popleft()
            for target in sorted(graph[module]):
                if target not in previous:
                    previous[target] = module
                    queue.append(target)
        if start in previous:
            path = [start]
            while len(path) == 1 or path[-1] != start:
                path.append(previous[path[-1]])
            cycle = path[::-1]
            if not any(set(cycle) <= set(seen) for seen in cycles):  # one report per circle, from its first module
                cycles.append(cycle)
    return cycles


def _describe(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_package_has_no_import_cycle() -> None:
    cycles = import_cycles(import_graph(PACKAGE))
    assert not cycles, f"import cycles: {_describe(cycles)}"


def test_a_circle_through_a_function_level_import_is_found_and_named(tmp_path: Path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "",
        "cli/__init__.py": "",
        "cli/layout.py": "def run():\n    from pkg.cli import views\n",
        "cli/views.py": "from pkg.cli.layout import run\n",
    })
    assert _describe(import_cycles(import_graph(root))) == "pkg.cli.layout -> pkg.cli.views -> pkg.cli.layout"


def test_relative_plain_and_type_checking_imports_make_edges(tmp_path: Path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "from pkg.a import name\n",
        "a.py": "from . import b\nimport pkg.c.d\nimport os\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\nelse:\n    import pkg.c\n",
        "c/__init__.py": "",
        "c/d.py": "from ..b import thing\nfrom .. import a\n",
        "e.py": "",
    })
    assert import_graph(root) == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.c.d"}, "pkg.b": {"pkg.c", "pkg.e"}, "pkg.c": set(),
        "pkg.c.d": {"pkg.b", "pkg.a"}, "pkg.e": set(),
    }
    assert _describe(import_cycles(import_graph(root))) == "pkg.a -> pkg.c.d -> pkg.a"


def test_a_circle_closed_only_under_type_checking_is_found(tmp_path: Path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "",
        "layout.py": "from pkg.shrink import shrink_layout\n",
        "shrink.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.layout import Layout\n",
    })
    assert _describe(import_cycles(import_graph(root))) == "pkg.layout -> pkg.shrink -> pkg.layout"
