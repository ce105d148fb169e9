"""Every function, class and method of the package has a one-line summary, public or private.

Issue 39: a docstring opens with a one-line summary, then a blank line, then arguments, returns, raises
and an example where it helps. ``help()``, an IDE's hover and docs/api.md's entries read the first line
alone, so a summary wrapped onto a second line is cut mid-sentence there. The public API is what
tests/core/test_public_api.py enumerates (public modules' ``__all__``); a public class adds its own
public methods, class and static methods, and properties (inherited ones are checked on their class).
The private code (underscore names and modules, nested functions too) is read from the source, every
module of ``pgregistry/``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

from test_public_api import PACKAGE, ROOT, _identity, _in_code


def _documented(owner: str, value: object) -> Iterator[tuple[str, object]]:
    """The public name ``owner`` and, for a class, its own public methods and properties."""
    yield owner, value
    if not inspect.isclass(value):
        return
    for name, member in vars(value).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            yield f"{owner}.{name}", member


def _public_api() -> dict[object, tuple[str, object]]:
    """Each public object once (a re-export is the object it re-exports), by its first public name."""
    found: dict[object, tuple[str, object]] = {}
    for module, names in _in_code().items():
        imported = importlib.import_module(module)
        for name in names:
            value = getattr(imported, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue  # a constant or a type alias: documented in docs/api.md, not by a docstring
            for qualified, documented in _documented(f"{module}.{name}", value):
                found.setdefault(_identity(documented), (qualified, documented))
    return found


def test_the_public_api_is_enumerated() -> None:
    # The scan must see the API it guards: every public module, and methods as well as classes.
    names = [qualified for qualified, _ in _public_api().values()]
    assert len(names) > 200, f"only {len(names)} public objects found"
    assert "pgregistry.optim.FlatOptimizer.load_state_dict" in names


def test_every_public_docstring_opens_with_a_one_line_summary() -> None:
    faults = []
    for qualified, documented in _public_api().values():
        text = inspect.cleandoc(documented.__doc__ or "")
        if not text:
            faults.append(f"{qualified}: no docstring")
        elif "\n" in text.split("\n\n", 1)[0]:
            faults.append(f"{qualified}: summary spans lines: {text.splitlines()[0]!r}")
    assert not faults, (
        f"{len(faults)} public docstrings lack a one-line summary; say it in one line of at most 100 "
        "columns, then a blank line and the rest:\n" + "\n".join(faults)
    )


def _multi_line_summaries(paths: list[Path]) -> list[str]:
    """``path:line name: first line`` for each documented function or class of ``paths`` whose summary spans lines."""
    faults = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            text = ast.get_docstring(node) or ""  # cleaned as inspect.cleandoc cleans __doc__
            if "\n" in text.split("\n\n", 1)[0]:
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                faults.append(f"{shown}:{node.lineno} {node.name}: {text.splitlines()[0]!r}")
    return faults


def test_every_private_docstring_opens_with_a_one_line_summary() -> None:
    checked = sorted(PACKAGE.rglob("*.py"))
    assert len(checked) > 100  # the whole package, not an empty glob
    faults = _multi_line_summaries(checked)
    assert not faults, (
        f"{len(faults)} docstrings lack a one-line summary; say what the function or class does or returns "
        "in one line of at most 100 columns, then a blank line and the rest:\n" + "\n".join(faults)
    )


def test_the_private_check_flags_a_wrapped_summary(tmp_path: Path) -> None:
    module = tmp_path / "planted.py"
    module.write_text(
        'def _wrapped():\n    """Say what this does\n    over two lines."""\n\n\n'
        'class _Fine:\n    """One line.\n\n    Then the rest,\n    over two lines."""\n\n'
        '    def _nested(self):\n        """Also\n        wrapped."""\n'
    )
    assert _multi_line_summaries([module]) == [
        f"{module}:1 _wrapped: 'Say what this does'",
        f"{module}:12 _nested: 'Also'",
    ]
