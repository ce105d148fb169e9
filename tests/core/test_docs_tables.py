"""Tables in the README and docs/ fit in 100 columns, so a reader sees a row without scrolling sideways.

A row that needs more room becomes a list item (as the README's command list does) or loses words.
The two pages read as tables, docs/architecture.md's module map and docs/api.md's entries (one list
item per module or name), fit too: the map whole, api.md's list items with their continuations.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 100


def _wide_table_rows(root: Path, paths: list[Path]) -> list[str]:
    """Each table row wider than ``WIDTH``, as ``file:line (width)`` with the file relative to ``root``."""
    wide = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.startswith("|") and len(line) > WIDTH:
                wide.append(f"{path.relative_to(root)}:{number} ({len(line)})")
    return wide


def _wide_list_items(root: Path, path: Path) -> list[str]:
    """Each line of a list item (``- `` or its indented continuation) wider than ``WIDTH``."""
    return [
        f"{path.relative_to(root)}:{number} ({len(line)})"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.startswith(("- ", "  ")) and len(line) > WIDTH
    ]


def test_the_module_map_and_the_api_entries_fit_in_100_columns() -> None:
    architecture = ROOT / "docs" / "architecture.md"
    wide = [
        f"docs/architecture.md:{number} ({len(line)})"
        for number, line in enumerate(architecture.read_text().splitlines(), start=1)
        if len(line) > WIDTH
    ]
    assert wide + _wide_list_items(ROOT, ROOT / "docs" / "api.md") == []


def test_every_docs_table_fits_in_100_columns() -> None:
    assert _wide_table_rows(ROOT, [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]) == []


def test_a_wide_row_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("| a | b |\n| --- | --- |\n| " + "x" * WIDTH + " | y |\n| short | row |\n")
    assert _wide_table_rows(tmp_path, [page]) == [f"page.md:3 ({WIDTH + 8})"]


def test_a_wide_list_item_is_found(tmp_path: Path) -> None:
    page = tmp_path / "api.md"
    page.write_text("Prose " + "x" * WIDTH + "\n- `name`: short\n  " + "y" * WIDTH + "\n")
    assert _wide_list_items(tmp_path, page) == [f"api.md:3 ({WIDTH + 2})"]
