"""Rows of text as aligned columns: the tables ``pgregistry layout`` prints (its group listing, its
placement table and its comparison), kept apart from both command modules so neither imports the
other."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align_columns"]


def align_columns(rows: Sequence[Sequence[str]], numeric: tuple[int, ...]) -> list[str]:
    """Rows as text columns; the ``numeric`` columns right-aligned, the last one left as it is."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(row[:-1])
        ]
        out.append("  ".join([*cells, row[-1]]).rstrip())
    return out
