"""One Python source file to its reads of global process-group state: bytes in, sites out, no I/O.

A *site* is one read, keyed by what survives edits: the enclosing qualified scope (``Class.method``,
``outer.inner``, ``<module>``), the accessor read (its real name, however it was imported or
aliased) and the form of the read (``call``, ``reference`` or ``getattr``). Line and column ride
along for the report only.

Names are resolved through the file's imports, wherever they appear (flow-insensitive): ``import
a.parallel_state as ps``, ``from a import parallel_state as mpu``, ``from a.parallel_state import
get_x as y``, relative imports (resolved against the file's package, taken from its path) and ``from
a.parallel_state import *``. A name no import binds stands for itself, so a fully dotted
``a.b.parallel_state.get_x()`` resolves without any import, and the configured aliases (``ps``)
count as the legacy module, as Megatron-LM's checker (pull request 6258) counts them.

Speed: parsing dominates, so the walk is pruned. A file that mentions none of the trigger words
(module names, aliases, shims) cannot hold a site and is only parsed (a syntax error is still an
error). Otherwise only the statements and expressions whose line span covers a line with a trigger
word (or a name imported from a matching module) are visited; a node's span covers its children's,
so the pruning never hides a site.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
import warnings
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import translate
from functools import lru_cache
from typing import Any

from pgregistry._source.config import ScanConfig

__all__ = [
    "CALL",
    "FAMILIES",
    "GETATTR",
    "MODULE_SCOPE",
    "REFERENCE",
    "FileResult",
    "ParseFailure",
    "Site",
    "absolute_module",
    "attribute_chain",
    "decode_result",
    "encode_result",
    "family_of",
    "module_name",
    "scan_source",
]

MODULE_SCOPE = "<module>"
CALL = "call"
REFERENCE = "reference"
GETATTR = "getattr"

LEGACY = "parallel_state"
REGISTRY = "registry"
SHIM = "shim"
HELPER = "fallback-helper"


@dataclass(frozen=True, order=True)
class Site:
    """One read of global process-group state.

    ``key`` (scope, accessor, form) identifies it in the allowlist; ``line``/``col`` (1-based)
    locate it for the report; ``expr`` is the read as spelled in the source; ``family`` is
    ``parallel_state``, ``registry``, ``shim`` or ``fallback-helper`` (a configured helper that
    reads the global grid when given None). ``guarded``: the read only runs as a fallback, inside an
    ``if x is None`` branch (or its ``else`` for ``is not None``), after ``x or``, or in a function
    named ``*_if_none``.
    """

    line: int
    col: int
    scope: str
    accessor: str
    form: str
    expr: str
    family: str
    guarded: bool = False

    @property
    def key(self) -> str:
        return f"{self.scope}|{self.accessor}|{self.form}"


#: The burn-down families of reads, in the order reports list them (:func:`family_of`).
FAMILIES = ("direct", "global", "fallback", "shim", "registry")


def family_of(site: Site) -> str:
    """The burn-down family of a read.

    ``fallback`` (a fallback helper, or a read that only runs when a value is missing), ``shim``,
    ``registry`` (pgregistry's own grid), ``global`` (a module global such as
    ``_TENSOR_MODEL_PARALLEL_GROUP``) or ``direct`` (an accessor call or reference)."""
    if site.family == SHIM:
        return "shim"
    if site.family == HELPER or site.guarded:
        return "fallback"
    if site.family == REGISTRY:
        return "registry"
    return "global" if site.accessor.startswith("_") else "direct"


@dataclass(frozen=True)
class ParseFailure:
    """Why a file could not be scanned: syntax error or undecodable bytes, at ``line``/``col``.

    Both are 1-based.

    ``needs`` is the Python version (``"3.12"``) whose syntax the failing line uses, when it is
    newer than the running interpreter's: such a file is not broken, only ahead of this Python
    (empty otherwise)."""

    message: str
    line: int
    col: int
    needs: str = ""


@dataclass(frozen=True)
class FileResult:
    """The sites of one file (sorted by position), or the reason it could not be parsed."""

    path: str
    sites: tuple[Site, ...] = ()
    failure: ParseFailure | None = None


def encode_result(result: FileResult) -> list[Any]:
    """``result`` without its path, as nested lists of str and int (for JSON and :mod:`marshal`)."""
    failure = result.failure
    return [
        [
            [s.line, s.col, s.scope, s.accessor, s.form, s.expr, s.family, s.guarded]
            for s in result.sites
        ],
        None if failure is None else [failure.message, failure.line, failure.col, failure.needs],
    ]


_SITE_TYPES = (int, int, str, str, str, str, str, bool)
_FAILURE_TYPES = (str, int, int, str)


def _check_row_types(values: Sequence[Any], types: tuple[type, ...]) -> Sequence[Any]:
    if len(values) != len(types) or not all(
        type(v) is t for v, t in zip(values, types, strict=True)
    ):
        raise ValueError(f"malformed result row: {values!r}")
    return values


def decode_result(path: str, row: Sequence[Any]) -> FileResult:
    """The inverse of :func:`encode_result`; raises ``ValueError`` on a row of the wrong shape."""
    sites, failure = row
    return FileResult(
        path,
        tuple(Site(*_check_row_types(site, _SITE_TYPES)) for site in sites),
        None if failure is None else ParseFailure(*_check_row_types(failure, _FAILURE_TYPES)),
    )


class _Family:
    """One kind of global state: the modules that hold it and the accessor names that read it."""

    def __init__(
        self,
        label: str,
        modules: Sequence[str],
        aliases: Sequence[str],
        accept: Sequence[str],
        ignore: Sequence[str],
    ) -> None:
        self.label = label
        self.modules = tuple(modules)
        self.suffixes = tuple("." + module for module in modules)
        self.aliases = frozenset(aliases)
        self.accept = _any_of(accept)
        self.ignore = _any_of(ignore)

    def accessor(self, name: str) -> bool:
        return self.accept.match(name) is not None and self.ignore.match(name) is None

    def module(self, dotted: str) -> bool:
        return dotted in self.modules or dotted.endswith(self.suffixes)


def _any_of(patterns: Sequence[str]) -> re.Pattern[str]:
    if not patterns:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(translate(pattern) for pattern in patterns))


class _Rules:
    """A :class:`ScanConfig` compiled for matching; built once per process and configuration."""

    def __init__(self, config: ScanConfig) -> None:
        self.families = (
            _Family(
                LEGACY, config.modules, config.aliases, config.accessors, config.ignore_accessors
            ),
            _Family(REGISTRY, config.registry_modules, (), config.registry_accessors, ()),
        )
        self.shims = frozenset(config.shims)
        self.helpers = tuple(config.fallback_helpers)
        self.exempt = _Family("exempt", config.exempt_modules, (), (), ())
        # Every component of every module name: an import that binds a prefix of a dotted module
        # name (``import pgregistry as pg`` for ``pgregistry.global_grid``) must be seen for
        # ``pg.global_grid.x`` to resolve.
        words = {
            part
            for family in self.families
            for module in family.modules
            for part in module.split(".")
        }
        helper_names = {helper.rpartition(".")[2] for helper in self.helpers}
        self.words = frozenset(words | set(config.aliases) | self.shims | helper_names)
        self.trigger = _word_pattern(self.words)

    def match(
        self, parts: Sequence[str], bound: bool, stars: Iterable[_Family]
    ) -> tuple[str, str] | None:
        """(family, accessor) when the dotted name ``parts`` reads global state.

        ``bound``: whether its first part was bound by an import (aliases count only when it was
        not)."""
        name = parts[-1]
        if name in self.shims:
            return SHIM, name
        if self.helper(parts):
            return HELPER, name
        if len(parts) == 1:
            for family in stars if not bound else ():
                if family.accessor(name):
                    return family.label, name
            return None
        module = ".".join(parts[:-1])
        for family in self.families:
            if family.accessor(name) and (
                family.module(module)
                or (not bound and len(parts) == 2 and parts[0] in family.aliases)
            ):
                return family.label, name
        return None

    def helper(self, parts: Sequence[str]) -> bool:
        """Whether the dotted name ``parts`` is a configured fallback helper (or ends with one)."""
        dotted = ".".join(parts)
        return any(dotted == helper or dotted.endswith("." + helper) for helper in self.helpers)

    def relevant(self, target: str) -> bool:
        """Whether importing ``target`` can lead to a site (so the name bound is a trigger word)."""
        parts = target.split(".")
        return self.match(parts, True, ()) is not None or any(
            family.module(target) for family in self.families
        )

    def star_family(self, module: str) -> _Family | None:
        return next((family for family in self.families if family.module(module)), None)


def _word_pattern(words: Iterable[str]) -> re.Pattern[bytes]:
    alternatives = "|".join(re.escape(word) for word in sorted(words))
    return re.compile(rb"\b(?:" + alternatives.encode() + rb")\b")


@lru_cache(maxsize=8)
def _compile_rules(config: ScanConfig) -> _Rules:
    return _Rules(config)


def _lines_matching(pattern: re.Pattern[bytes], text: bytes) -> list[int]:
    """The sorted, distinct 1-based numbers of the lines of ``text`` where ``pattern`` matches."""
    lines: list[int] = []
    line, position = 1, 0
    for match in pattern.finditer(text):
        start = match.start()
        line += text.count(b"\n", position, start)
        position = start
        if not lines or lines[-1] != line:
            lines.append(line)
    return lines


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    """The 1-based (line, column) of the byte at ``offset``."""
    return data.count(b"\n", 0, offset) + 1, offset - data.rfind(b"\n", 0, offset)


def _decode_failure(data: bytes) -> ParseFailure | None:
    """A failure naming the first undecodable line, in the file's declared encoding (default UTF-8).

    Checked before parsing because :func:`ast.parse` accepts invalid bytes inside comments."""
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as error:
        encoding, start, reason = "utf-8", error.start, error.reason
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as error:  # an unknown or contradictory coding cookie
        return ParseFailure(str(error.msg), max(1, error.lineno or 1), 1)
    if encoding not in ("utf-8", "utf-8-sig"):
        try:
            data.decode(encoding)
            return None
        except UnicodeDecodeError as error:
            start, reason = error.start, error.reason
    return ParseFailure(
        f"not valid {encoding} ({reason}, byte 0x{data[start]:02x})", *_line_and_column(data, start)
    )


#: Syntax newer than some Python still in use, recognised on the line a SyntaxError points at:
#: (version that introduced it, pattern of the line, what it is).
_NEWER_SYNTAX: tuple[tuple[tuple[int, int], re.Pattern[str], str], ...] = (
    ((3, 10), re.compile(r"\s*(match\s+\S.*|case\s+\S.*):\s*(#.*)?$"), "match statement"),
    ((3, 11), re.compile(r"\s*except\s*\*"), "except*"),
    ((3, 12), re.compile(r"\s*type\s+[A-Za-z_]\w*\s*(\[.*\])?\s*="), "type alias statement"),
    ((3, 12), re.compile(r"\s*(async\s+)?(def|class)\s+[A-Za-z_]\w*\s*\["), "type parameter list"),
    (
        (3, 14),
        re.compile(r"\s*except\s+[^\s(:][^:(]*,[^:]*:"),
        "except without parentheses (PEP 758)",
    ),
    ((3, 14), re.compile(r".*(?<![\w.])[tT][rR]?['\"]"), "template string (PEP 750)"),
)


#: What Python < 3.12 says about f-strings that PEP 701 made valid (a reused quote, a backslash, a
#: comment).
_PEP_701_ERRORS = ("f-string: expecting '}'", "f-string expression part cannot include")


def _newer_syntax(data: bytes, line: int, message: str) -> tuple[str, str] | None:
    """("3.12", what) when ``line`` uses syntax newer than the running Python; None otherwise."""
    if sys.version_info < (3, 12) and message.startswith(_PEP_701_ERRORS):
        return (
            "3.12",
            "f-string syntax of PEP 701 (nested quotes, backslashes or comments in an expression)",
        )
    lines = data.decode("utf-8", "replace").splitlines()
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    for version, pattern, what in _NEWER_SYNTAX:
        if version > sys.version_info[:2] and pattern.match(text):
            return f"{version[0]}.{version[1]}", what
    return None


def _parse_module(data: bytes, path: str) -> ast.Module | ParseFailure:
    failure = _decode_failure(data)
    if failure is not None:
        return failure
    try:
        with warnings.catch_warnings():  # invalid escapes warn; under -W error they would raise
            warnings.simplefilter("ignore")
            return ast.parse(data, filename=path)
    except SyntaxError as error:
        if error.lineno is None and b"\0" in data:
            line, col = _line_and_column(data, data.index(b"\0"))
        else:
            line, col = max(1, error.lineno or 1), max(1, error.offset or 1)
        newer = _newer_syntax(data, line, str(error.msg))
        if newer is not None:
            running = ".".join(map(str, sys.version_info[:3]))
            message = (
                f"syntax error: {error.msg}: this looks like {newer[1]}, which needs Python "
                f">= {newer[0]} (the scan runs Python {running}); run the scan with Python "
                f"{newer[0]}+, or pass --skip-newer-syntax to skip such files with a warning"
            )
            return ParseFailure(message, line, col, newer[0])
        return ParseFailure(f"syntax error: {error.msg}", line, col)
    except ValueError as error:  # null bytes, on some Python versions
        return ParseFailure(f"syntax error: {error}", 1, 1)
    except RecursionError:  # Python's own compiler refuses such a file too
        return ParseFailure(
            "syntax error: nested too deeply for Python's parser (recursion limit)", 1, 1
        )


def _lines_cover(lines: list[int], first: int, last: int) -> bool:
    index = bisect_left(lines, first)
    return index < len(lines) and lines[index] <= last


class _Imports:
    """What each imported name is bound to, and the families star-imported.

    Targets are dotted; a name may be bound in several places."""

    def __init__(self, rules: _Rules, package: list[str]) -> None:
        self.rules = rules
        self.package = package
        self.bindings: dict[str, set[str]] = {}
        self.stars: list[_Family] = []

    def collect(self, body: list[ast.stmt], lines: list[int]) -> None:
        """Walk the statements (not expressions: imports are statements) spanning ``lines``."""
        pending: list[list[ast.stmt]] = [body]
        while pending:
            for stmt in pending.pop():
                if not _lines_cover(lines, stmt.lineno, stmt.end_lineno or stmt.lineno):
                    continue
                if isinstance(stmt, ast.Import):
                    for alias in stmt.names:
                        if alias.asname:
                            self._bind_name(alias.asname, alias.name)
                        else:
                            head = alias.name.split(".", 1)[0]
                            self._bind_name(head, head)
                elif isinstance(stmt, ast.ImportFrom):
                    module = absolute_module(stmt.module, stmt.level, self.package)
                    for alias in stmt.names:
                        if alias.name == "*":
                            family = self.rules.star_family(module)
                            if family is not None and family not in self.stars:
                                self.stars.append(family)
                        else:
                            target = f"{module}.{alias.name}" if module else alias.name
                            self._bind_name(alias.asname or alias.name, target)
                else:
                    for field in ("body", "orelse", "finalbody"):
                        block = getattr(stmt, field, None)
                        if block:
                            pending.append(block)
                    for clause in getattr(stmt, "handlers", ()) or getattr(stmt, "cases", ()):
                        pending.append(clause.body)

    def _bind_name(self, name: str, target: str) -> None:
        self.bindings.setdefault(name, set()).add(target)

    def trigger_names(self) -> set[str]:
        """Names bound to something relevant: their uses need not spell any configured word."""
        return {
            name
            for name, targets in self.bindings.items()
            if name not in self.rules.words and any(map(self.rules.relevant, targets))
        }


def absolute_module(module: str | None, level: int, package: list[str]) -> str:
    """The absolute name of ``module`` imported ``level`` packages up from ``package``.

    ``migrate`` uses it too."""
    if level == 0:
        return module or ""
    base = package[: max(0, len(package) - (level - 1))]
    return ".".join([*base, module] if module else base)


def attribute_chain(node: ast.expr) -> list[str] | None:
    """The names of a dotted expression: ``a.b.c`` -> ``["a", "b", "c"]``.

    None when its root is not a plain name (a call, a subscript, ...). ``migrate`` uses it too."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *parts[::-1]] if isinstance(node, ast.Name) else None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _branch_when_missing(test: ast.expr) -> str | None:
    """Which branch of ``if test`` runs when a value is missing, if ``test`` checks for one.

    ``"body"`` for ``x is None``, ``not x`` (a name or attribute, not a call) or an ``or`` of such
    tests, ``"orelse"`` for ``x is not None``; None when ``test`` is no such check."""
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and _is_none_constant(test.comparators[0])
    ):
        return (
            "body"
            if isinstance(test.ops[0], ast.Is)
            else "orelse"
            if isinstance(test.ops[0], ast.IsNot)
            else None
        )
    if isinstance(test, ast.UnaryOp) and isinstance(
        test.op, ast.Not
    ):  # ``not group``, not ``not ready()``
        return "body" if isinstance(test.operand, (ast.Name, ast.Attribute)) else None
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        if any(_branch_when_missing(v) == "body" for v in test.values):
            return "body"
    return None


def _is_none_constant(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


class _Walker:
    """The pruned walk that records sites; iterative, so deep nesting cannot overflow the stack."""

    def __init__(
        self, rules: _Rules, imports: _Imports, lines: list[int] | None, module: list[str]
    ) -> None:
        self.rules = rules
        self.bindings = imports.bindings
        self.stars = imports.stars
        self.lines = lines
        self.module = module
        self.sites: list[Site] = []

    def walk(self, tree: ast.Module) -> list[Site]:
        # (node, scope, guarded): ``guarded`` when the node only runs as a fallback for a missing
        # value.
        stack: list[tuple[ast.AST, str, bool]] = [(tree, MODULE_SCOPE, False)]
        lines = self.lines
        while stack:
            node, scope, guarded = stack.pop()
            if lines is not None and isinstance(node, (ast.stmt, ast.expr)):
                # A decorated definition starts at its first decorator, above ``node.lineno``.
                first = (
                    node.decorator_list[0].lineno
                    if isinstance(node, _SCOPES) and node.decorator_list
                    else 0
                )
                if not _lines_cover(lines, first or node.lineno, node.end_lineno or node.lineno):
                    continue
            if isinstance(node, ast.Call):
                # getattr(ps, "get_x")(...) is one site: the outer call falls through to the inner
                # one.
                if self._record_site(node.func, scope, CALL, guarded):
                    stack.extend((child, scope, guarded) for child in [*node.args, *node.keywords])
                    continue
                if self._record_getattr(node, scope, guarded):
                    stack.extend(
                        (child, scope, guarded) for child in [*node.args[2:], *node.keywords]
                    )
                    continue
            elif isinstance(node, (ast.Attribute, ast.Name)):
                if isinstance(node.ctx, ast.Load) and self._record_site(
                    node, scope, REFERENCE, guarded
                ):
                    continue
            elif isinstance(node, (ast.If, ast.IfExp)):
                branch = _branch_when_missing(node.test)
                stack.append((node.test, scope, guarded))
                for field in ("body", "orelse"):
                    value = getattr(node, field)
                    fallback = guarded or branch == field
                    stack.extend(
                        (child, scope, fallback)
                        for child in (value if isinstance(value, list) else [value])
                    )
                continue
            elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
                first_value, *rest = (
                    node.values
                )  # ``x or ps.get_x()``: the rest runs when x is missing
                stack.append((first_value, scope, guarded))
                stack.extend((child, scope, True) for child in rest)
                continue
            elif isinstance(node, _SCOPES):
                inner = node.name if scope == MODULE_SCOPE else f"{scope}.{node.name}"
                body_guarded = guarded or node.name.endswith("_if_none")
                for field, value in ast.iter_fields(node):
                    child_scope, child_guarded = (
                        (inner, body_guarded) if field == "body" else (scope, guarded)
                    )
                    if isinstance(value, list):
                        stack.extend(
                            (child, child_scope, child_guarded)
                            for child in value
                            if isinstance(child, ast.AST)
                        )
                    elif isinstance(value, ast.AST):
                        stack.append((value, child_scope, child_guarded))
                continue
            stack.extend((child, scope, guarded) for child in ast.iter_child_nodes(node))
        self.sites.sort()
        return self.sites

    def _resolve_accessor(self, parts: list[str]) -> tuple[str, str] | None:
        targets = self.bindings.get(parts[0])
        if targets is None:
            if len(parts) == 1 and self.rules.helper(
                [*self.module, parts[0]]
            ):  # the helper's own module
                return HELPER, parts[0]
            return self.rules.match(parts, False, self.stars)
        for target in sorted(targets):
            hit = self.rules.match([*target.split("."), *parts[1:]], True, ())
            if hit is not None:
                return hit
        return None

    def _record_site(self, node: ast.expr, scope: str, form: str, guarded: bool) -> bool:
        parts = attribute_chain(node)
        if parts is None:
            return False
        hit = self._resolve_accessor(parts)
        if hit is None:
            return False
        family, accessor = hit
        self.sites.append(
            Site(
                node.lineno,
                node.col_offset + 1,
                scope,
                accessor,
                form,
                ".".join(parts),
                family,
                guarded,
            )
        )
        return True

    def _record_getattr(self, call: ast.Call, scope: str, guarded: bool) -> bool:
        """``getattr(ps, "get_x")`` (with or without a default) with a literal name."""
        if not (
            isinstance(call.func, ast.Name)
            and call.func.id == "getattr"
            and len(call.args) >= 2
            and isinstance(call.args[1], ast.Constant)
            and isinstance(call.args[1].value, str)
        ):
            return False
        parts = attribute_chain(call.args[0])
        name = call.args[1].value
        if parts is None or not name.isidentifier():
            return False
        hit = self._resolve_accessor([*parts, name])
        if hit is None:
            return False
        family, accessor = hit
        expr = f"getattr({'.'.join(parts)}, {name!r})"
        self.sites.append(
            Site(call.lineno, call.col_offset + 1, scope, accessor, GETATTR, expr, family, guarded)
        )
        return True


def module_name(path: str) -> list[str]:
    """The dotted module name of project path ``path`` as parts (``a/b/__init__.py``: ``a.b``)."""
    parts = path.split("/")
    last = parts[-1].removesuffix(".py")
    return parts[:-1] if last == "__init__" else [*parts[:-1], last]


def scan_source(data: bytes, path: str, config: ScanConfig) -> FileResult:
    """The sites in one file's bytes.

    ``path`` is the project-relative POSIX path: it names the file in failures and gives the package
    that relative imports resolve against."""
    tree = _parse_module(data, path)
    if isinstance(tree, ParseFailure):
        return FileResult(path, failure=tree)
    rules = _compile_rules(config)
    module = module_name(path)
    if rules.exempt.module(".".join(module)):
        return FileResult(path)
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in data else data
    lines = _lines_matching(rules.trigger, text)
    if not lines:
        return FileResult(path)
    imports = _Imports(rules, path.split("/")[:-1])
    imports.collect(tree.body, lines)
    names = imports.trigger_names()
    if names:
        extra = _lines_matching(_word_pattern(names), text)
        lines = sorted(set(lines).union(extra))
    walker = _Walker(rules, imports, None if imports.stars else lines, module)
    return FileResult(path, tuple(walker.walk(tree)))
