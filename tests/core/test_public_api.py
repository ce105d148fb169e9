"""The public API is what docs/api.md lists, both ways, and it stays small.

A public module is one whose dotted path has no component starting with an underscore; its public names are its
``__all__``. docs/api.md has a section ``## `pgregistry.x``` per public module and an entry per public name: a
list item (``- `name`: what it is``, its text wrapped onto lines indented by two spaces) or a table row
(``| `name` | what it is |``). Everything the package uses internally lives in underscore modules or names.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pgregistry"
API = ROOT / "docs" / "api.md"
MOST_NAMES = 160

_SECTION = re.compile(r"^## `(pgregistry[\w.]*)`\s*$")
_ROW = re.compile(r"^\| `(\w+)` \| (.*) \|\s*$")
_ITEM = re.compile(r"^- `(\w+)`: (.*)$")


def _public_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if any(part.startswith("_") and part != "__init__" for part in parts):
            continue
        names.append(".".join(part for part in parts if part != "__init__"))
    return names


def _in_code() -> dict[str, list[str]]:
    out = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        assert isinstance(getattr(module, "__all__", None), list), f"public module {name} has no __all__ list"
        out[name] = list(module.__all__)
    return out


def _in_docs() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    section = item = None
    for line in API.read_text().splitlines():
        if match := _SECTION.match(line):
            section, item = match.group(1), None
            assert section not in out, f"docs/api.md has two sections for {section}"
            out[section] = {}
        elif section is not None and (match := _ROW.match(line) or _ITEM.match(line)):
            item, text = match.groups()
            assert item not in out[section], f"docs/api.md lists {section}.{item} twice"
            out[section][item] = text.strip()
        elif section is not None and item is not None and line.startswith("  "):
            out[section][item] += " " + line.strip()  # an item's text, wrapped
        else:
            item = None
    return out


def test_docs_api_lists_every_public_name_and_no_other() -> None:
    code, docs = _in_code(), _in_docs()
    assert sorted(docs) == sorted(code), "docs/api.md's sections are not the public modules"
    for module, names in code.items():
        assert sorted(docs[module]) == sorted(names), f"docs/api.md and {module}.__all__ differ"


def test_every_listed_name_exists_and_has_a_line() -> None:
    for module, rows in _in_docs().items():
        imported = importlib.import_module(module)
        for name, text in rows.items():
            assert hasattr(imported, name), f"{module}.{name}"
            assert text and not text.startswith("|"), f"{module}.{name} has no description"


def _identity(value: Any) -> object:
    """One public name per object: a re-export (``pgregistry.grad_norm``) is the name it re-exports."""
    if hasattr(value, "__module__") and hasattr(value, "__qualname__"):
        return (value.__module__, value.__qualname__)
    return id(value)


def test_the_public_api_has_at_most_160_names() -> None:
    objects = {
        _identity(getattr(importlib.import_module(module), name))
        for module, names in _in_code().items()
        for name in names
    }
    assert len(objects) <= MOST_NAMES, f"{len(objects)} public names; keep the API to at most {MOST_NAMES}"
