"""The part of a file libcst needs to see: definitions no rewrite can touch stood in for by placeholders.

libcst's parse builds a Python object per token and its render visits every node, so on a large tree they are
most of ``migrate``'s time, while the rewrites touch a few functions per file. Before parsing, each module-level
``def`` / ``class`` (and each ``def`` / ``class`` member of a module-level class) that holds no read and that
nothing else needs walked is replaced by a placeholder assignment of the same lines: a one-line
``_pgregistry_kept_<n> = 0`` or, for a definition of several lines, a string literal spanning them, so every line
keeps its number (the scanner's positions and the :mod:`ast` spans stay those of the file). After the rewrite each
placeholder, untouched, is replaced by the text it stands for. A file that already holds the prefix is parsed
whole; a placeholder found twice in the rewritten text (which no rewrite causes) is the caller's internal error.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Skeleton", "line_starts", "lines", "needed_by", "restore", "skeleton", "span"]

_PREFIX = b"_pgregistry_kept_"
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Skeleton:
    """The text to parse, and each placeholder's text with the original lines it stands for (bytes)."""

    data: bytes
    kept: Mapping[bytes, bytes]

    def decoded(self, encoding: str) -> dict[str, str]:
        """:attr:`kept` as text, in the file's encoding (the one libcst detected)."""
        return {k.decode(encoding): v.decode(encoding) for k, v in self.kept.items()}


def restore(text: str, kept: Mapping[str, str]) -> str | None:
    """``text`` with each placeholder it holds replaced by its original lines; None when one occurs twice."""
    for placeholder, original in kept.items():
        at = text.find(placeholder)
        if at < 0:
            continue
        if text.find(placeholder, at + 1) >= 0:
            return None
        text = text[:at] + original + text[at + len(placeholder):]
    return text


def span(node: ast.stmt) -> tuple[int, int]:
    """The first and last line of ``node``, a decorated definition from its first decorator."""
    decorators = getattr(node, "decorator_list", ())
    return min([node.lineno, *(d.lineno for d in decorators)]), node.end_lineno or node.lineno


def line_starts(data: bytes) -> list[int]:
    """The offset of each line of ``data`` (for :func:`lines`)."""
    return [0, *(m.end() for m in re.finditer(rb"\n", data))]


def lines(data: bytes, starts: Sequence[int], start: int, end: int) -> bytes:
    """Lines ``start`` to ``end`` (1-based, inclusive) of ``data``, whose :func:`line_starts` are ``starts``."""
    return data[starts[start - 1]: starts[end] if end < len(starts) else None]


def skeleton(data: bytes, tree: ast.Module, needed: Callable[[int, int, bool], bool]) -> Skeleton | None:
    """``data`` (parsed as ``tree``) with each definition for which ``needed(first line, last line, member)`` is
    false stood in for by a placeholder; None when nothing is, or the file already holds the prefix."""
    if _PREFIX in data:
        return None
    rows = data.split(b"\n")
    kept: dict[bytes, bytes] = {}

    def stand_in(node: ast.stmt, tag: str) -> None:
        start, end = span(node)
        original = b"\n".join(rows[start - 1:end])
        first = rows[start - 1]
        indent = first[: len(first) - len(first.lstrip(b" \t\f"))]
        eol = [b"\r" if row.endswith(b"\r") else b"" for row in rows[start - 1:end]]
        name = indent + _PREFIX + tag.encode()
        if start == end:
            placeholder = [name + b" = 0" + eol[0]]
        else:
            placeholder = [name + b' = """' + eol[0], *eol[1:-1], b'"""' + eol[-1]]
        rows[start - 1:end] = placeholder
        kept[b"\n".join(placeholder)] = original

    for index, node in enumerate(tree.body):
        if not isinstance(node, _DEFINITIONS):
            continue
        start, end = span(node)
        if not needed(start, end, False):
            stand_in(node, str(index))
        elif isinstance(node, ast.ClassDef):
            for member, inner in enumerate(node.body):
                if isinstance(inner, _DEFINITIONS) and span(inner)[0] > node.lineno and not needed(
                        *span(inner), True):
                    stand_in(inner, f"{index}_{member}")
    if not kept:
        return None
    return Skeleton(b"\n".join(rows), kept)


def needed_by(data: bytes, site_lines: set[int], calls: re.Pattern[bytes] | None,
              name: re.Pattern[bytes]) -> Callable[[int, int, bool], bool]:
    """The usual ``needed``: a definition is needed when it holds a read (a line of ``site_lines``), a call
    ``calls`` matches (one that may pass a threaded function its collection), or, as a class member, the
    collection's ``name`` (where a method binds ``self.<name>``)."""
    starts = line_starts(data)

    def needed(start: int, end: int, member: bool) -> bool:
        if any(start <= line <= end for line in site_lines):
            return True
        text = lines(data, starts, start, end)
        return bool((calls is not None and calls.search(text)) or (member and name.search(text)))

    return needed
