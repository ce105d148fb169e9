"""A change as a unified diff, in time linear in the file (for files a rewrite touches throughout).

:func:`difflib.unified_diff` alone is quadratic on a long file whose changes are spread over it:
each matching block its matcher finds costs a scan of the rest (a generated 1 MB file: minutes). The
lines that occur once in the old text and once in the new one, in the same order in both (their
longest increasing run, found in ``n log n``), are matched first, as ``git diff --patience`` does;
:class:`difflib.SequenceMatcher` only matches the short stretches between two of them. The diff is
``patch``'s format either way.

The diff is of the files' bytes, as ``git diff`` gives it: a file in latin-1 (its ``# -*-
coding: ... -*-`` line) or with a BOM is shown in its own encoding, so the diff applies to it byte
for byte, whatever encoding the terminal has (a diff decoded as UTF-8 crashed on such a file). Every
encoding Python accepts for a source file keeps ``\\n`` a line's end, which is where ``patch`` and
``git`` split lines (a file ending its lines with a lone ``\\r`` is one line to them).
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections import Counter
from collections.abc import Iterator, Sequence

__all__ = ["render_unified_diff"]

_LINE = re.compile(rb"[^\n]*\n|[^\n]+")
#: Lines of context around each change, as ``diff -u`` gives.
_CONTEXT = 3


def _unique_line_anchors(
    a: Sequence[bytes], b: Sequence[bytes], alo: int, ahi: int, blo: int, bhi: int
) -> list[tuple[int, int]]:
    """The pairs (i, j) of equal lines unique to both ranges, in their longest increasing run.

    The ranges are ``a[alo:ahi]`` and ``b[blo:bhi]``; the run is the longest in which both indexes
    increase (patience sorting)."""
    count_a, count_b = Counter(a[alo:ahi]), Counter(b[blo:bhi])
    where_b = {b[j]: j for j in range(blo, bhi) if count_b[b[j]] == 1}
    pairs = [(i, where_b[a[i]]) for i in range(alo, ahi) if count_a[a[i]] == 1 and a[i] in where_b]
    tails: list[int] = []  # tails[k]: the smallest j ending an increasing run of k + 1 pairs
    ends: list[int] = []  # the pair index of each tail
    before: list[int] = []  # each pair's predecessor in its run
    for index, (_, j) in enumerate(pairs):
        k = bisect.bisect_left(tails, j)
        before.append(ends[k - 1] if k else -1)
        if k == len(tails):
            tails.append(j)
            ends.append(index)
        else:
            tails[k], ends[k] = j, index
    run, at = [], ends[-1] if ends else -1
    while at >= 0:
        run.append(pairs[at])
        at = before[at]
    return run[::-1]


def _matching_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> list[tuple[int, int, int]]:
    """What :meth:`difflib.SequenceMatcher.get_matching_blocks` gives, anchored on unique lines."""
    blocks: list[tuple[int, int, int]] = []
    stretches = [(0, len(a), 0, len(b))]
    while stretches:
        alo, ahi, blo, bhi = stretches.pop()
        while alo < ahi and blo < bhi and a[alo] == b[blo]:  # the common head, line by line
            blocks.append((alo, blo, 1))
            alo, blo = alo + 1, blo + 1
        while alo < ahi and blo < bhi and a[ahi - 1] == b[bhi - 1]:
            blocks.append((ahi - 1, bhi - 1, 1))
            ahi, bhi = ahi - 1, bhi - 1
        if alo == ahi or blo == bhi:
            continue
        anchors = _unique_line_anchors(a, b, alo, ahi, blo, bhi)
        if not anchors:
            matcher = difflib.SequenceMatcher(None, a[alo:ahi], b[blo:bhi], autojunk=False)
            blocks += [
                (alo + i, blo + j, size) for i, j, size in matcher.get_matching_blocks() if size
            ]
            continue
        previous_a, previous_b = alo, blo
        for i, j in anchors:
            blocks.append((i, j, 1))
            stretches.append((previous_a, i, previous_b, j))
            previous_a, previous_b = i + 1, j + 1
        stretches.append((previous_a, ahi, previous_b, bhi))
    merged: list[tuple[int, int, int]] = []
    for i, j, size in sorted(blocks):
        if merged and merged[-1][0] + merged[-1][2] == i and merged[-1][1] + merged[-1][2] == j:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((i, j, size))
    return [*merged, (len(a), len(b), 0)]


class _Matcher(difflib.SequenceMatcher[bytes]):
    """A :class:`difflib.SequenceMatcher` whose matching blocks are :func:`_matching_blocks`'."""

    def __init__(self, a: Sequence[bytes], b: Sequence[bytes]) -> None:
        super().__init__(None, a, b, autojunk=False)
        self._lines = (a, b)
        self._blocks: list[difflib.Match] | None = None

    def get_matching_blocks(self) -> list[difflib.Match]:
        if self._blocks is None:
            self._blocks = [difflib.Match(*block) for block in _matching_blocks(*self._lines)]
        return self._blocks


def _hunk_range(start: int, stop: int) -> str:
    """A hunk's range as ``diff -u`` writes it (1-based start, and the length unless it is 1)."""
    length = stop - start
    first = start + 1 if length else start
    return str(first) if length == 1 else f"{first},{length}"


def _diff_hunks(a: Sequence[bytes], b: Sequence[bytes]) -> Iterator[bytes]:
    for group in _Matcher(a, b).get_grouped_opcodes(_CONTEXT):
        yield (
            f"@@ -{_hunk_range(group[0][1], group[-1][2])} "
            f"+{_hunk_range(group[0][3], group[-1][4])} @@\n"
        ).encode()
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                yield from (b" " + line for line in a[i1:i2])
                continue
            yield from (b"-" + line for line in a[i1:i2] if tag != "insert")
            yield from (b"+" + line for line in b[j1:j2] if tag != "delete")


#: The escapes of ``git diff``'s C-style quoted names; any other byte it quotes is ``\\ooo``.
_ESCAPES = {
    b"\a"[0]: b"\\a",
    b"\b"[0]: b"\\b",
    b"\t"[0]: b"\\t",
    b"\n"[0]: b"\\n",
    b"\v"[0]: b"\\v",
    b"\f"[0]: b"\\f",
    b"\r"[0]: b"\\r",
    b'"'[0]: b'\\"',
    b"\\"[0]: b"\\\\",
}


def _git_name(prefix: str, path: str) -> bytes:
    """``prefix`` and ``path`` as ``git diff`` names a file (``git apply`` and ``patch`` read it).

    The name's bytes (one that is no UTF-8 as the file system holds it); in double quotes, C-style
    escaped, where they hold a control character, a quote, a backslash or a byte past ASCII (git's
    ``core.quotePath``): a newline in a name would end the line naming it."""
    name = (prefix + path).encode("utf-8", "surrogateescape")
    plain = [32 <= byte < 127 and byte not in _ESCAPES for byte in name]
    if all(plain):
        return name
    quoted = (
        bytes([byte]) if kept else _ESCAPES.get(byte, b"\\%03o" % byte)
        for byte, kept in zip(name, plain, strict=True)
    )
    return b'"' + b"".join(quoted) + b'"'


def render_unified_diff(path: str, before: bytes, after: bytes, *, created: bool = False) -> bytes:
    """The change of ``path`` from ``before`` to ``after`` as a unified diff; empty when equal.

    In the file's own bytes; its files are ``a/PATH`` and ``b/PATH``, as ``git diff`` names them
    (``/dev/null`` and ``b/PATH`` for a ``created`` file; quoted as git quotes them)."""
    hunks = list(_diff_hunks(_LINE.findall(before), _LINE.findall(after)))
    if not hunks:
        return b""
    source = b"/dev/null" if created else _git_name("a/", path)
    lines = [b"--- " + source + b"\n", b"+++ " + _git_name("b/", path) + b"\n", *hunks]
    return b"".join(
        line if line.endswith(b"\n") else line + b"\n\\ No newline at end of file\n"
        for line in lines
    )
