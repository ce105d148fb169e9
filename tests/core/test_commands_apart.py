"""The ``allowlist`` and ``migrate`` commands import nothing private of each other.

They share the scanner, its settings and the file handling through ``pgregistry._source``; beyond
that each command's package (``pgregistry.allowlist``, ``pgregistry.migrate``) and its module of the
command table (``cli/_allowlist.py``, ``cli/_migrate.py``) is its own. ``migrate --write`` runs the
allowlist's update through the public ``pgregistry.allowlist.main``. Before, ``cli/_migrate.py``
imported the allowlist's private ``_ratchet.file_to_rewrite`` (now in ``_source/storage.py``).
"""

from __future__ import annotations

from pathlib import Path

from fixtures.source_trees import write_package
from test_import_cycles import import_graph

import pgregistry

PACKAGE = Path(pgregistry.__file__).resolve().parent
COMMANDS = {"allowlist": "cli._allowlist", "migrate": "cli._migrate"}
"""Command -> its module of the command table."""


def private_imports_across(graph: dict[str, set[str]], package: str) -> list[str]:
    """``importer -> imported`` for each private module of one command imported by the other's code."""
    crossing = []
    for command, table_module in COMMANDS.items():
        own = (f"{package}.{command}", f"{package}.{table_module}")
        for other in set(COMMANDS) - {command}:
            private = f"{package}.{other}._"
            for importer in sorted(graph):
                if importer in own or importer.startswith(f"{package}.{command}."):
                    crossing += [
                        f"{importer} -> {target}"
                        for target in sorted(graph[importer])
                        if target.startswith(private)
                    ]
    return crossing


def test_neither_command_imports_a_private_module_of_the_other() -> None:
    assert private_imports_across(import_graph(PACKAGE), "pgregistry") == []


def test_a_private_import_across_is_named(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "allowlist/__init__.py": "",
        "allowlist/_ratchet.py": "",
        "migrate/__init__.py": "",
        "migrate/_engine.py": "",
        "cli/__init__.py": "",
        "cli/_allowlist.py": "from pkg.allowlist._ratchet import x\n",
        "cli/_migrate.py": "from pkg.migrate import _engine\nfrom pkg.allowlist import main\n"
        "def f():\n    from pkg.allowlist._ratchet import y\n",
    }
    root = write_package(tmp_path, files)
    assert private_imports_across(import_graph(root), "pkg") == [
        "pkg.cli._migrate -> pkg.allowlist._ratchet"
    ]
