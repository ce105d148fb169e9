"""Rewrap the docstring paragraphs and comment blocks that run past 100 columns, structure kept.

    python scripts/wrap_prose.py                   # rewrap pgregistry/ in place, list what is left
    python scripts/wrap_prose.py pgregistry/rng.py # some files or folders
    python scripts/wrap_prose.py --dry-run         # say which files would change (exit 1 if any)
    python scripts/wrap_prose.py --check HEAD~1    # the code means what it meant at HEAD~1
    python scripts/wrap_prose.py --split-strings   # long string literals too; then ruff format

``ruff format`` wraps code but not prose: a docstring or a comment keeps the width it was written
at. This rewraps only the paragraphs that have a line over the width, so a second run changes
nothing and prose already within the width is never touched. Docstrings (a string statement: a
module's, class's or function's, or an attribute's) and comments are found with ``ast`` and
``tokenize``; a paragraph is refilled greedily, words never split, and keeps its first line's
lead (indentation, the opening quotes, ``# ``) and its continuation indent. Structure is kept:

- blank lines, the summary line (split only if it is too long itself), each bullet (``- ``, ``* ``,
  ``+ ``, ``1. ``) with its hanging indent; a continuation line never starts with a word that would
  read as a bullet, a doctest prompt or a pragma;
- ``Args:``, ``Raises:`` and like sections, one paragraph per entry at its indent, continued
  deeper; ``Returns:`` and like sections as paragraphs;
- verbatim: ``>>>`` lines and their output, what a ``::`` introduces, a paragraph indented deeper
  than its context (code), tables (``|``, ``+--``, ``===``), ``..`` directives, docstrings with
  a backslash continuation or other than triple-quoted, pragma comments (``# noqa``, ``# type:``,
  ``# fmt:``, ...) which never move off their line, trailing comments, and ``# fmt: off`` regions.

A rule comment (``# ------ steps``) over the width gets a shorter run of dashes; a word hyphenated
at a line's end (``Megatron-`` then ``Core``) is joined whole.

With ``--split-strings``, a string literal (or an implicit concatenation of them) on a line over
the width is cut after spaces into implicitly concatenated parts of even lengths, never inside a
replacement field; a part without one is a plain string. Those the cut cannot serve (no space to
cut at, a string that is not what makes its line long, a triple-quoted one) are left and listed.

What is still too long afterwards is listed (``path:line: width: what``) for a hand fix.
``--check REV`` compares every file with its version at ``REV``: the ``ast`` with each docstring's
whitespace collapsed must be identical (so a hand split of a long string into implicitly
concatenated parts passes), and so must the sequence of comment words (rules of any length).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

WIDTH = 100
REPO = Path(__file__).resolve().parent.parent

BULLET = re.compile(r"([-*+]|\d+[.)])\s+\S")
# Sections whose entries (``name: what it is``) each start a paragraph at the entry indent.
ENTRY_SECTIONS = frozenset(
    "Args Arguments Parameters Params Keyword Args Keyword Arguments Other Parameters Raises Warns "
    "Attributes".split()
)
SECTION_HEADER = re.compile(
    r"(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Raises|"
    r"Warns|Attributes|Returns|Return|Yields|Yield|Examples?|Notes?|Warnings?|See Also|Todo|"
    r"References):\s*"
)
TABLE = re.compile(r"(\||\+[-=+]{2}|={3})")
PRAGMA = re.compile(
    r"#\s*(type:|noqa|fmt:|pragma|pylint:|mypy:|isort:|ruff:|nosec|pyright:|-\*-)|^#!", re.I
)
HYPHENATED_END = re.compile(r"[A-Za-z]-\s*$")
# A comment that draws a rule (``# ------ steps``): too long, its run of dashes is shortened.
RULE = re.compile(r"(([-=#*~])\2{2,})(\s.*)?")
# Words a continuation line must not start with: they would read as a bullet, a doctest prompt or
# output marker, a table row, a directive, a comment pragma or another comment.
RISKY_START = re.compile(
    r"([-*+]|\d+[.)]|>>>|\.\.\.?|\||#.*|noqa.*"
    r"|(type|fmt|pragma|pylint|mypy|isort|ruff|pyright):.*)",
    re.I,
)


@dataclass
class Row:
    """One physical line of a docstring or comment block, split into what the rewrap keeps."""

    lead: str  # what precedes the text: indentation, the opening quotes, ``# ``
    text: str  # the prose, without the lead's spaces
    indent: int  # the structural indent: the text's column in the docstring or after ``#``
    suffix: str = ""  # what follows the text on the last row: the closing quotes and beyond
    verbatim: bool = False

    @property
    def width(self) -> int:
        return len(self.lead) + len(self.text) + len(self.suffix)

    @property
    def blank(self) -> bool:
        return not self.text.strip()

    def render(self) -> str:
        return self.lead + self.text + self.suffix


@dataclass
class Paragraph:
    """Rows refilled together: a paragraph, a bullet or a section entry."""

    rows: list[Row]
    hang: int  # the indent of its continuation rows
    hang_known: bool  # whether ``hang`` comes from a continuation row (not a guess)
    bullet: bool = False
    entry: bool = False


def join_rows(texts: list[str]) -> str:
    """The rows' texts as one line: a word hyphenated at a row's end (``Megatron-``) stays whole."""
    joined = ""
    for text in texts:
        glued = HYPHENATED_END.search(joined) and text.strip()[:1].isalpha()
        joined = joined.rstrip() + ("" if glued else " ") + text.strip() if joined else text
    return joined


def fill(paragraph: Paragraph, lead: str, width: int) -> list[str]:
    """Refill ``paragraph`` at ``width``, its first lead kept, its continuations led by ``lead``."""
    words = join_rows([row.text for row in paragraph.rows]).split()
    suffix = paragraph.rows[-1].suffix
    lines: list[list[str]] = [[]]
    leads = [paragraph.rows[0].lead]
    for index, word in enumerate(words):
        last = index == len(words) - 1
        current = lines[-1]
        candidate = leads[-1] + " ".join([*current, word]) + (suffix if last else "")
        if not current or len(candidate) <= width:
            current.append(word)
            continue
        carried: list[str] = []
        # A continuation must not start with a word that changes what the line is: the previous
        # word comes along (and the one before it, if that one is risky too).
        while RISKY_START.fullmatch(([*carried, word])[0]) and len(current) > 1:
            carried.insert(0, current.pop())
        lines.append([*carried, word])
        leads.append(lead)
    rendered = [first + " ".join(line) for first, line in zip(leads, lines, strict=True)]
    rendered[-1] += suffix
    return rendered


def segment(rows: list[Row], base_indent: int) -> Iterator[Paragraph | Row]:
    """Split ``rows`` into paragraphs to refill and verbatim rows, following their structure."""
    current: Paragraph | None = None
    literal_above: int | None = None  # rows indented deeper than this are a literal block
    to_blank = False  # a doctest, a table or a directive: verbatim up to the next blank row
    section: tuple[int, bool] | None = None  # (header indent, whether entries start paragraphs)
    entry_indent: int | None = None
    list_hangs: set[int] = set()  # continuation indents of the bullets and entries seen

    def close() -> Iterator[Paragraph]:
        nonlocal current, literal_above
        if current is not None:
            if current.rows[-1].text.rstrip().endswith("::"):
                literal_above = current.rows[0].indent
            yield current
        current = None

    for row in rows:
        text = row.text.strip()
        if row.verbatim or row.blank:
            yield from close()
            to_blank = False
            yield row
            continue
        if literal_above is not None:
            if row.indent > literal_above:
                yield row
                continue
            literal_above = None
        if section is not None and row.indent <= section[0]:
            section, entry_indent = None, None
        if to_blank or text.startswith((">>>", ".. ")) or TABLE.match(text):
            yield from close()
            to_blank = True
            if text.startswith(".. "):
                literal_above = row.indent
            yield row
            continue
        if SECTION_HEADER.fullmatch(text):
            yield from close()
            section = (row.indent, text.rstrip(": ") in ENTRY_SECTIONS)
            entry_indent = None
            yield row
            continue
        bullet = BULLET.match(text)
        if section is not None and entry_indent is None:
            entry_indent = row.indent
        entry = section is not None and section[1] and row.indent == entry_indent
        if current is not None and not bullet and not entry:
            if current.hang_known or current.bullet or current.entry:
                continues = row.indent == current.hang or (
                    current.entry and not current.hang_known and row.indent > current.rows[0].indent
                )
            else:
                continues = row.indent == current.rows[0].indent
            if continues:
                if not current.hang_known:
                    current.hang, current.hang_known = row.indent, True
                    if current.bullet or current.entry:
                        list_hangs.add(row.indent)
                current.rows.append(row)
                continue
        yield from close()
        plain = not bullet and not entry
        if plain and section is None and row.indent > base_indent and row.indent not in list_hangs:
            # Indented deeper than its context and not a list's continuation: code or a quote.
            literal_above = row.indent - 1
            yield row
            continue
        if bullet:
            hang = row.indent + bullet.end() - 1
            list_hangs.add(hang)
        elif entry:
            hang = row.indent + 4
        else:
            hang = row.indent
        current = Paragraph([row], hang, False, bullet=bool(bullet), entry=entry)
    yield from close()


def rewrap(rows: list[Row], base_indent: int, lead_of: Lead, width: int) -> list[str] | None:
    """The lines ``rows`` become, or None when no paragraph of them needed a refill."""
    out: list[str] = []
    changed = False
    for unit in segment(rows, base_indent):
        if isinstance(unit, Row):
            out.append(unit.render())
        elif max(row.width for row in unit.rows) > width:
            out.extend(fill(unit, lead_of(unit.hang), width))
            changed = True
        else:
            out.extend(row.render() for row in unit.rows)
    return out if changed else None


class Lead:
    """Builds the lead of a continuation row at a structural indent."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, indent: int) -> str:
        return self.prefix + " " * indent


@dataclass
class Edit:
    """Replace source lines ``first``..``last`` (1-based, inclusive) by ``lines``."""

    first: int
    last: int
    lines: list[str]


@dataclass
class Leftover:
    line: int
    what: str


@dataclass
class Result:
    text: str
    leftovers: list[Leftover] = field(default_factory=list)


def docstring_nodes(tree: ast.AST) -> Iterator[ast.Expr]:
    """Every string statement: a module's, class's or function's docstring, or an attribute's."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node


def fmt_off_lines(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """The lines between ``# fmt: off`` and ``# fmt: on``: left as they are."""
    lines: set[int] = set()
    start: int | None = None
    for token in tokens:
        if token.type == tokenize.COMMENT:
            directive = token.string[1:].strip().replace(" ", "")
            if directive == "fmt:off" and start is None:
                start = token.start[0]
            elif directive == "fmt:on" and start is not None:
                lines.update(range(start, token.start[0] + 1))
                start = None
    if start is not None:
        lines.update(range(start, 10**9))
    return lines


def char_column(line: str, byte_offset: int) -> int:
    """The column, in characters, of ``ast``'s ``byte_offset`` (UTF-8 bytes) into ``line``."""
    return len(line.encode()[:byte_offset].decode())


def docstring_edit(lines: list[str], token: tokenize.TokenInfo, width: int) -> Edit | None:
    """The edit that rewraps the docstring ``token``, or None when nothing needs it or may."""
    (first, column), (last, end) = token.start, token.end
    prefix = re.match(r"[rRuU]*", token.string).group()  # type: ignore[union-attr]
    quotes = token.string[len(prefix) : len(prefix) + 3]
    span = lines[first - 1 : last]
    if quotes not in ('"""', "'''"):
        return None
    body = token.string[len(prefix) + 3 : -3]
    if "r" not in prefix.lower() and re.search(r"\\\n", body):
        return None  # a backslash joins lines: whitespace here is not free
    opener = span[0][: column + len(prefix) + 3]
    rows: list[Row] = []
    for index, line in enumerate(span):
        start = len(opener) if index == 0 else 0
        stop = end - 3 if index == len(span) - 1 else len(line)
        content = line[start:stop]
        suffix = line[stop:] if index == len(span) - 1 else ""
        if index == 0:
            rows.append(Row(opener, content, column, suffix))
        else:
            stripped = content.lstrip(" ")
            indent = len(content) - len(stripped)
            rows.append(Row(content[:indent], stripped, indent, suffix, verbatim="\t" in content))
    new = rewrap(rows, column, Lead(""), width)
    return Edit(first, last, new) if new is not None else None


def shorten_rules(lines: list[str], tokens: list[tokenize.TokenInfo], width: int) -> None:
    """Shorten the run of dashes of each whole-line rule comment over ``width``, in place."""
    for token in tokens:
        number, column = token.start
        line = lines[number - 1]
        if token.type != tokenize.COMMENT or line[:column].strip() or len(line) <= width:
            continue
        rule = RULE.fullmatch(token.string[1:].strip())
        if rule is not None:
            run = rule.group(1)
            shorter = run[: max(3, len(run) - (len(line) - width))]
            lines[number - 1] = line[:column] + line[column:].replace(run, shorter, 1)


def comment_blocks(
    lines: list[str], tokens: list[tokenize.TokenInfo], skip: set[int]
) -> Iterator[tuple[int, list[Row], Lead]]:
    """Runs of whole-line comments at one column: (first line, their rows, their lead)."""
    block: list[Row] = []
    block_start = block_column = -1
    block_marker = ""
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        number, column = token.start
        whole_line = not lines[number - 1][:column].strip()
        if not whole_line:
            continue  # a trailing comment stays on its line
        comment = lines[number - 1][column:]  # the token's text, its rule maybe shortened
        marker = "#:" if comment.startswith("#:") else "#"
        rest = comment[len(marker) :]
        stripped = rest.lstrip(" ")
        indent = len(rest) - len(stripped)
        row = Row(
            lines[number - 1][:column] + marker + rest[:indent],
            stripped,
            indent,
            verbatim=bool(PRAGMA.search(comment) or RULE.fullmatch(stripped))
            or number in skip
            or "\t" in rest,
        )
        adjacent = number == block_start + len(block) and column == block_column
        if block and adjacent and marker == block_marker:
            block.append(row)
            continue
        if block:
            yield block_start, block, Lead(" " * block_column + block_marker)
        block, block_start, block_column, block_marker = [row], number, column, marker
    if block:
        yield block_start, block, Lead(" " * block_column + block_marker)


def wrap_source(source: str, width: int = WIDTH, split_strings: bool = False) -> Result:
    """``source`` with its long docstring paragraphs and comment blocks rewrapped, and its long
    string literals split with ``split_strings``."""
    tree = ast.parse(source)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.split("\n")
    skip = fmt_off_lines(tokens)
    shorten_rules(lines, tokens, width)
    edits: list[Edit] = []
    strings = {token.start: token for token in tokens if token.type == tokenize.STRING}
    for node in docstring_nodes(tree):
        value = node.value
        assert value.end_lineno is not None and value.end_col_offset is not None
        start = (value.lineno, char_column(lines[value.lineno - 1], value.col_offset))
        end = (value.end_lineno, char_column(lines[value.end_lineno - 1], value.end_col_offset))
        token = strings.get(start)
        if token is None or token.end != end:
            continue  # implicitly concatenated parts, or an f-string: not a plain docstring
        if node.lineno in skip:
            continue
        edit = docstring_edit(lines, token, width)
        if edit is not None:
            edits.append(edit)
    for start, rows, lead in comment_blocks(lines, tokens, skip):
        new = rewrap(rows, 1, lead, width)
        if new is not None:
            edits.append(Edit(start, start + len(rows) - 1, new))
    if split_strings:
        docstrings = {node.lineno for node in docstring_nodes(tree)}
        for group, depth in string_groups(tokens):
            if group[0].start[0] not in docstrings and group[0].start[0] not in skip:
                edit = string_edit(lines, group, depth, width)
                if edit is not None:
                    edits.append(edit)
    for edit in sorted(edits, key=lambda edit: edit.first, reverse=True):
        lines[edit.first - 1 : edit.last] = edit.lines
    text = "\n".join(lines)
    return Result(text, describe_long_lines(text, width))


# --- long string literals (--split-strings) ---------------------------------------------------

STRING_START = re.compile(r"([A-Za-z]*)('|\")")
CLOSING = re.compile(r"[\s,)\]}]*(#.*)?")


@dataclass
class Part:
    """One string literal of an implicit concatenation, read from its token."""

    token: tokenize.TokenInfo
    formatted: bool  # an f-string
    raw: bool
    quote: str
    body: str  # between the quotes

    @classmethod
    def of(cls, token: tokenize.TokenInfo) -> Part | None:
        """The part, or None for one not split here (bytes, ``u``, triple-quoted, multi-line)."""
        match = STRING_START.match(token.string)
        assert match is not None
        prefix, quote = match.group(1).lower(), match.group(2)
        triple = token.string[len(prefix) :].startswith(quote * 3)
        if set(prefix) - {"f", "r"} or triple or token.start[0] != token.end[0]:
            return None
        return cls(token, "f" in prefix, "r" in prefix, quote, token.string[len(prefix) + 1 : -1])


def string_groups(
    tokens: list[tokenize.TokenInfo],
) -> Iterator[tuple[list[tokenize.TokenInfo], int]]:
    """Each implicit concatenation (one literal or more) with its bracket depth."""
    depth = 0
    group: list[tokenize.TokenInfo] = []
    for token in tokens:
        if token.type == tokenize.STRING:
            group.append(token)
            continue
        if token.type == tokenize.NL and group:
            continue
        if group:
            yield group, depth
            group = []
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1


def replacement_fields(body: str) -> list[bool]:
    """For each character of an f-string's ``body``, whether it is inside ``{...}``."""
    inside = [False] * len(body)
    depth = index = 0
    while index < len(body):
        if depth == 0 and body[index : index + 2] in ("{{", "}}"):
            index += 2
            continue
        if body[index] == "{":
            depth += 1
        inside[index] = depth > 0
        if body[index] == "}" and depth:
            depth -= 1
        index += 1
    return inside


def split_body(body: str, room: int, formatted: bool, raw: bool) -> list[str] | None:
    """``body`` cut after spaces (never in a replacement field or after a backslash) into pieces of
    at most ``room`` characters where it can be; None when there is no space to cut at."""
    inside = replacement_fields(body) if formatted else [False] * len(body)
    pieces: list[str] = []
    start = 0
    while len(body) - start > room:
        cut = next(
            (
                index + 1
                for index in range(min(start + room, len(body)) - 1, start, -1)
                if body[index] == " " and not inside[index] and (raw or body[index - 1] != "\\")
            ),
            None,
        )
        if cut is None:
            return None
        pieces.append(body[start:cut])
        start = cut
    return [*pieces, body[start:]]


def balanced_pieces(body: str, room: int, formatted: bool, raw: bool) -> list[str] | None:
    """The split of ``body`` into the fewest pieces, of lengths as even as the spaces allow."""
    pieces = split_body(body, room, formatted, raw)
    if pieces is None or len(pieces) == 1:
        return pieces
    for narrower in range(len(body) // len(pieces), room):
        even = split_body(body, narrower, formatted, raw)
        if even is not None and len(even) == len(pieces):
            return even
    return pieces


def literal(piece: str, formatted: bool, raw: bool, quote: str) -> str:
    """``piece`` as a literal: an f-string only if it holds a replacement field."""
    if formatted and "{" not in piece.replace("{{", "").replace("}}", ""):
        formatted, piece = False, piece.replace("{{", "{").replace("}}", "}")
    return ("f" if formatted else "") + ("r" if raw else "") + quote + piece + quote


def string_edit(
    lines: list[str], group: list[tokenize.TokenInfo], depth: int, width: int
) -> Edit | None:
    """The edit that splits the concatenation ``group`` at ``width``, or None when it needs none
    or this cannot do it. Its parts are joined and cut again after spaces, one to a line: where
    they stood alone on their lines inside brackets (followed by closing brackets and commas at
    most) they stay there, else they go in parentheses (a call's own when they are its one
    argument), one indent deeper than their line (``ruff format`` keeps these layouts)."""
    first, last = group[0], group[-1]
    if all(len(lines[token.start[0] - 1]) <= width for token in group):
        return None
    parts = [Part.of(token) for token in group]
    if any(part is None for part in parts) or len({token.start[0] for token in group}) < len(group):
        return None
    known = [part for part in parts if part is not None]
    if len({part.raw for part in known}) > 1 or len({part.quote for part in known}) > 1:
        return None
    for index, token in enumerate(group):  # nothing but the parts between the first and the last
        line = lines[token.start[0] - 1]
        if (index > 0 and line[: token.start[1]].strip()) or (
            index < len(group) - 1 and line[token.end[1] :].strip()
        ):
            return None
    formatted = any(part.formatted for part in known)
    body = "".join(
        part.body
        if part.formatted or not formatted
        else part.body.replace("{", "{{").replace("}", "}}")
        for part in known
    )
    before = lines[first.start[0] - 1][: first.start[1]]
    after = lines[last.end[0] - 1][last.end[1] :]
    # Alone on their lines inside brackets, with at most closing brackets and commas after them.
    stacked = not before.strip() and depth > 0 and CLOSING.fullmatch(after) is not None
    indent = first.start[1] if stacked else len(before) - len(before.lstrip()) + 4
    room = width - indent - len("f" if formatted else "") - len("r" if known[0].raw else "") - 2
    pieces = balanced_pieces(
        body, room - (len(after.rstrip()) if stacked else 0), formatted, known[0].raw
    )
    if pieces is None or (len(pieces) == 1 and len(group) == 1):
        return None  # no space to cut at, or the string is not what makes its line long
    new = [
        " " * indent + literal(piece, formatted, known[0].raw, known[0].quote) for piece in pieces
    ]
    if stacked:
        new[-1] += after
    elif before.rstrip().endswith("(") and after.lstrip().startswith(")"):
        new = [before.rstrip(), *new, " " * (indent - 4) + after.lstrip()]  # a call's one argument
    else:
        new = [before + "(", *new, " " * (indent - 4) + ")" + after]
    return Edit(first.start[0], last.end[0], new)


def describe_long_lines(source: str, width: int) -> list[Leftover]:
    """Each line over ``width`` in ``source``, with what it is."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    kind: dict[int, str] = {}
    docstrings = {
        line
        for node in docstring_nodes(ast.parse(source))
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    code_lines = {
        token.start[0]
        for token in tokens
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT)
    }
    for token in tokens:
        if token.type == tokenize.COMMENT:
            number = token.start[0]
            kind[number] = "trailing comment" if number in code_lines else "comment"
        elif token.type == tokenize.STRING or token.type in _FSTRING_TOKENS:
            for line in range(token.start[0], token.end[0] + 1):
                kind.setdefault(line, "docstring" if line in docstrings else "string")
    out = []
    for number, line in enumerate(source.split("\n"), 1):
        if len(line) > width:
            what = kind.get(number, "code")
            if line.strip().startswith((">>>", "...")):
                what += " (doctest)"
            out.append(Leftover(number, f"{len(line)}: {what}"))
    return out


_FSTRING_TOKENS = {
    getattr(tokenize, name)
    for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
    if hasattr(tokenize, name)
}


def normalized_dump(source: str) -> str:
    """The ``ast`` of ``source`` with each docstring's whitespace collapsed."""
    tree = ast.parse(source)
    for node in docstring_nodes(tree):
        assert isinstance(node.value, ast.Constant)
        node.value.value = join_rows(node.value.value.split())
    return ast.dump(tree)


def comment_words(source: str) -> list[str]:
    """The words of every comment of ``source``, hyphenated words whole, rules of any length."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    text = join_rows([t.string.lstrip("#:") for t in tokens if t.type == tokenize.COMMENT])
    return re.sub(r"([-=#*~])\1{2,}", r"\1\1\1", text).split()


def check(paths: Iterable[Path], revision: str) -> list[str]:
    """What differs in meaning between each file and its version at ``revision``."""
    problems = []
    for path in paths:
        relative = path.resolve().relative_to(REPO).as_posix()
        shown = subprocess.run(
            ["git", "show", f"{revision}:{relative}"], cwd=REPO, capture_output=True, text=True
        )
        if shown.returncode != 0:
            continue  # not in that revision
        before, after = shown.stdout, path.read_text()
        if normalized_dump(before) != normalized_dump(after):
            problems.append(f"{relative}: the code differs (beyond docstring whitespace)")
        if comment_words(before) != comment_words(after):
            problems.append(f"{relative}: the comments' words differ")
    return problems


def python_files(paths: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", default=[str(REPO / "pgregistry")])
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--dry-run", action="store_true", help="change nothing; exit 1 if needed")
    parser.add_argument("--check", metavar="REV", help="compare the code's meaning with REV's")
    parser.add_argument(
        "--split-strings",
        action="store_true",
        help="also split long string literals into implicitly concatenated parts (then run ruff "
        "format)",
    )
    args = parser.parse_args(argv)
    files = python_files(args.paths)
    if args.check:
        problems = check(files, args.check)
        print("\n".join(problems) or f"{len(files)} files mean what they meant at {args.check}")
        return 1 if problems else 0
    changed = 0
    for path in files:
        source = path.read_text()
        result = wrap_source(source, args.width, args.split_strings)
        if result.text != source:
            changed += 1
            if args.dry_run:
                print(f"{path}: would be rewrapped")
            else:
                path.write_text(result.text)
        for leftover in result.leftovers:
            print(f"{path}:{leftover.line}: {leftover.what}")
    verb = "would change" if args.dry_run else "changed"
    print(f"{changed} of {len(files)} files {verb}", file=sys.stderr)
    return 1 if args.dry_run and changed else 0


if __name__ == "__main__":
    sys.exit(main())
