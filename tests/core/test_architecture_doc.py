"""docs/architecture.md's module map names every module of the package, so the map cannot fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _unmapped(doc: str) -> list[str]:
    out = []
    for path in sorted((ROOT / "pgregistry").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") and path.parent.name != "cli":
            continue
        name, package = re.escape(path.name), re.escape(path.parent.name)
        if not re.search(rf"(?<![\w/]){name}|{package}/{name}", doc):
            out.append(str(path.relative_to(ROOT)))
    return out


def test_every_module_is_in_the_module_map() -> None:
    assert _unmapped((ROOT / "docs/architecture.md").read_text()) == []


def test_a_module_missing_from_the_map_is_found() -> None:
    doc = (ROOT / "docs/architecture.md").read_text().replace("`_runtime/group_cache.py`", "`group cache`")
    assert _unmapped(doc) == ["pgregistry/_runtime/group_cache.py"]
