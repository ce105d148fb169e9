"""Tables in the README and docs/ fit in 100 columns, so a reader sees a row without scrolling sideways.

A row that needs more room becomes a list item (as the README's command list does) or loses words.
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


def test_every_docs_table_fits_in_100_columns() -> None:
    assert _wide_table_rows(ROOT, [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]) == []


def test_a_wide_row_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("| a | b |\n| --- | --- |\n| " + "x" * WIDTH + " | y |\n| short | row |\n")
    assert _wide_table_rows(tmp_path, [page]) == [f"page.md:3 ({WIDTH + 8})"]
