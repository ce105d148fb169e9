"""A package whose ``__init__`` docstring lists its modules lists every one of them.

The list (``:mod:`~pgregistry.checkpoint._disk```, or a name in double backquotes) is where a
newcomer reads what the package holds; a module added later and not listed there is a claim that
the package holds less than it does. ``grad_stats`` and ``migrate`` list some of their modules only
and are not checked yet; ``cli`` lists its command modules, ``interop`` its public ones, ``modules``
and ``optim`` none.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pgregistry"
LISTING_EVERY_MODULE = ("_runtime", "_source", "allowlist", "checkpoint", "experts", "grad_stats", "migrate", "testing")


def unlisted_modules(package: Path) -> list[str]:
    """The modules of ``package`` that its ``__init__`` docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(path.stem for path in package.glob("*.py") if path.stem not in ("__init__", "__main__"))
    return [
        module for module in modules if f"``{module}``" not in doc and f".{package.name}.{module}`" not in doc
    ]


def test_every_listing_package_names_each_of_its_modules() -> None:
    assert {name: unlisted_modules(PACKAGE / name) for name in LISTING_EVERY_MODULE} == {
        name: [] for name in LISTING_EVERY_MODULE
    }


def test_a_module_left_out_of_the_list_is_named(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""The modules: ``_listed``, :mod:`~x.pkg._too`."""\n')
    for module in ("_listed", "_too", "_forgotten"):
        (tmp_path / "pkg" / f"{module}.py").write_text("")
    assert unlisted_modules(tmp_path / "pkg") == ["_forgotten"]
