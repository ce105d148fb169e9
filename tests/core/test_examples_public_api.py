"""The examples import only pgregistry's public API, as docs/architecture.md says.

Every ``import pgregistry...`` and ``from pgregistry... import name`` of ``examples/`` names a public
module (no component starting with an underscore) and, for a name, one of its ``__all__`` or a public
submodule. The one exception is the one the doc names: ``moe_demo`` checks its ``--json`` file with
the command line's ``check_output_file``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED_IN_THE_DOC = {("examples/moe_demo/job.py", "pgregistry.cli._options", "check_output_file")}


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def private_imports(root: Path) -> list[tuple[str, str, str]]:
    """``(file, module, name)`` of every import of ``root``'s examples that is not public API
    (``name`` empty for ``import module``)."""
    found = []
    for path in sorted((root / "examples").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found += [
                    (relative, alias.name, "")
                    for alias in node.names
                    if alias.name.split(".")[0] == "pgregistry" and not _is_public(alias.name)
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pgregistry":
                module = node.module or ""
                for alias in node.names:
                    if not _is_public(module) or not _is_public_name(module, alias.name):
                        found.append((relative, module, alias.name))
    return found


def _is_public_name(module: str, name: str) -> bool:
    imported = importlib.import_module(module)
    if name in imported.__all__:
        return True
    is_package = hasattr(imported, "__path__")
    return is_package and _is_public(name) and importlib.util.find_spec(f"{module}.{name}") is not None


def test_the_examples_import_only_public_names_but_the_one_the_doc_names() -> None:
    assert set(private_imports(ROOT)) == NAMED_IN_THE_DOC
    doc = " ".join((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    assert "the command line's `check_output_file` of `cli/_options.py`" in doc


def test_a_private_import_is_named(tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "demo.py").write_text(
        "import pgregistry._runtime.flags\n"
        "from pgregistry import modules, registry\n"
        "from pgregistry.layout import ParallelLayout, require_layout\n"
        "from pgregistry.grad_stats._lists import clip_grads_\n"
    )
    assert private_imports(tmp_path) == [
        ("examples/demo.py", "pgregistry._runtime.flags", ""),
        ("examples/demo.py", "pgregistry.layout", "require_layout"),
        ("examples/demo.py", "pgregistry.grad_stats._lists", "clip_grads_"),
    ]
