"""The part of a file libcst must see: definitions no rewrite can touch replaced by placeholders.

libcst's parse builds a Python object per token and its render visits every node, so on a large tree
they are most of ``migrate``'s time, while the rewrites touch a few functions per file. Before
parsing, each module-level ``def`` / ``class`` (and each ``def`` / ``class`` member of a
module-level class) that holds no read and that nothing else needs walked is replaced by a
placeholder assignment of the same lines: a one-line ``_pgregistry_kept_<n> = 0`` or, for a
definition of several lines, a string literal spanning them, so every line keeps its number (the
scanner's positions and the :mod:`ast` spans stay those of the file). After the rewrite each
placeholder, untouched, is replaced by the text it stands for. A file that already holds the prefix
is parsed whole; a placeholder found twice in the rewritten text (which no rewrite causes) is the
caller's internal error.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Kept",
    "Skeleton",
    "build_skeleton",
    "definition_span",
    "has_line_within",
    "line_starts",
    "lines_between",
    "make_needed_check",
    "restore_placeholders",
]

_PREFIX = b"_pgregistry_kept_"
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Skeleton:
    """The text to parse, and each placeholder's text with the original lines (bytes) it holds."""

    data: bytes
    kept: Mapping[bytes, bytes]

    def decode_kept(self, encoding: str) -> Kept:
        """:attr:`kept` as text, in the file's encoding (the one libcst detected)."""
        return Kept({k.decode(encoding): v.decode(encoding) for k, v in self.kept.items()})


class Kept(dict[str, str]):
    """Each placeholder's text -> the original text it stands for, indexed by placeholder name once.

    So that :func:`restore_placeholders` runs in time linear in the text it is given, however many
    placeholders the file has (it runs once per rewritten statement)."""

    def __init__(self, pairs: Mapping[str, str]) -> None:
        super().__init__(pairs)
        self.by_name: dict[
            str, tuple[str, int]
        ] = {}  # name -> (placeholder, where the name starts in it)
        for placeholder in self:
            found = _PLACEHOLDER.search(placeholder)
            assert found is not None, placeholder
            self.by_name[found.group()] = (placeholder, found.start())


def restore_placeholders(text: str, kept: Mapping[str, str]) -> str | None:
    """``text`` with each placeholder replaced by its original lines; None when one occurs twice.

    One pass over ``text``: a placeholder is found by its name, then checked whole."""
    if not kept:
        return text
    index = kept if isinstance(kept, Kept) else Kept(kept)
    pieces, done, restored = [], 0, set()
    for found in _PLACEHOLDER.finditer(text):
        entry = index.by_name.get(found.group())
        if entry is None:
            continue
        placeholder, indent = entry
        begin = found.start() - indent  # the placeholder starts with its line's indentation
        if begin < done or not text.startswith(placeholder, begin):
            continue
        if found.group() in restored:
            return None
        restored.add(found.group())
        pieces += [text[done:begin], index[placeholder]]
        done = begin + len(placeholder)
    pieces.append(text[done:])
    return "".join(pieces)


def definition_span(node: ast.stmt) -> tuple[int, int]:
    """The first and last line of ``node``, a decorated definition from its first decorator."""
    decorators = getattr(node, "decorator_list", ())
    return min([node.lineno, *(d.lineno for d in decorators)]), node.end_lineno or node.lineno


#: A line ending as Python's tokenizer reads one: ``\r\n``, a lone ``\r`` (old Mac files) or ``\n``.
_LINE_END = re.compile(rb"\r\n|\r|\n")
#: A placeholder's name (its tag: the definition's index in the module, and in its class).
_PLACEHOLDER = re.compile(re.escape(_PREFIX.decode()) + r"\d+(?:_\d+)?\b")


def line_starts(data: bytes) -> list[int]:
    """Each line's offset in ``data`` (for :func:`lines_between`), lines ended as Python does."""
    return [0, *(m.end() for m in _LINE_END.finditer(data))]


def lines_between(data: bytes, starts: Sequence[int], start: int, end: int) -> bytes:
    """Lines ``start`` to ``end`` (1-based, inclusive) of ``data``, with ``starts`` its line starts.

    ``starts`` is what :func:`line_starts` returns for ``data``.
    """
    return data[starts[start - 1] : starts[end] if end < len(starts) else None]


def has_line_within(ordered: Sequence[int], start: int, end: int) -> bool:
    """Whether one of the sorted line numbers ``ordered`` lies in ``start .. end``.

    A bisection: a file's definitions checked against its reads' lines in time linear in the file,
    not their product."""
    at = bisect.bisect_left(ordered, start)
    return at < len(ordered) and ordered[at] <= end


def _lines_with_endings(data: bytes) -> list[tuple[bytes, bytes]]:
    """Each line of ``data`` as (its text, its line ending).

    The ending is ``\\r\\n``, ``\\r``, ``\\n`` or, last, none."""
    starts = line_starts(data)
    rows = []
    for begin, end in zip(starts, [*starts[1:], len(data)], strict=True):
        row = data[begin:end]
        content = row.rstrip(b"\r\n")
        rows.append((content, row[len(content) :]))
    return rows


def build_skeleton(
    data: bytes, tree: ast.Module, needed: Callable[[int, int, bool], bool]
) -> Skeleton | None:
    """``data`` (parsed as ``tree``), each definition not ``needed`` stood in for by a placeholder.

    Not needed: ``needed(first line, last line, member)`` is false. None when no definition is stood
    in for, or the file already holds the prefix."""
    if _PREFIX in data:
        return None
    rows = _lines_with_endings(data)
    kept: dict[bytes, bytes] = {}

    def stand_in(node: ast.stmt, tag: str) -> None:
        start, end = definition_span(node)
        ends = [ending for _, ending in rows[start - 1 : end]]
        original = b"".join(text + ending for text, ending in rows[start - 1 : end])
        first = rows[start - 1][0]
        indent = first[: len(first) - len(first.lstrip(b" \t\f"))]
        name = indent + _PREFIX + tag.encode()
        if start == end:
            placeholder = [(name + b" = 0", ends[0])]
        else:
            placeholder = [
                (name + b' = """', ends[0]),
                *((b"", e) for e in ends[1:-1]),
                (b'"""', ends[-1]),
            ]
        rows[start - 1 : end] = placeholder
        text = b"".join(text + ending for text, ending in placeholder)
        # Both without the last line's ending, which stays in the text around them.
        kept[text[: len(text) - len(ends[-1])]] = original[: len(original) - len(ends[-1])]

    for index, node in enumerate(tree.body):
        if not isinstance(node, _DEFINITIONS):
            continue
        start, end = definition_span(node)
        if not needed(start, end, False):
            stand_in(node, str(index))
        elif isinstance(node, ast.ClassDef):
            for member, inner in enumerate(node.body):
                if (
                    isinstance(inner, _DEFINITIONS)
                    and definition_span(inner)[0] > node.lineno
                    and not needed(*definition_span(inner), True)
                ):
                    stand_in(inner, f"{index}_{member}")
    if not kept:
        return None
    return Skeleton(b"".join(text + ending for text, ending in rows), kept)


def make_needed_check(
    data: bytes, site_lines: set[int], calls: re.Pattern[bytes] | None, name: re.Pattern[bytes]
) -> Callable[[int, int, bool], bool]:
    """The usual ``needed`` check, from the reads' lines, the calls and the collection's name.

    A definition is needed when it holds a read (a line of ``site_lines``), a call ``calls`` matches
    (one that may pass a threaded function its collection), or, as a class member, the collection's
    ``name`` (where a method binds ``self.<name>``)."""
    starts = line_starts(data)
    ordered = sorted(site_lines)

    def is_needed(start: int, end: int, member: bool) -> bool:
        if has_line_within(ordered, start, end):
            return True
        text = lines_between(data, starts, start, end)
        return bool((calls is not None and calls.search(text)) or (member and name.search(text)))

    return is_needed
