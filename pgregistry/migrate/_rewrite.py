"""Apply a :class:`~pgregistry.migrate._plan.FilePlan` to its libcst tree: the new source text.

Only the nodes planning named change; libcst keeps every other byte (comments, blank lines, quotes,
parentheses). In order: each planned read becomes, in place, its call of the fallback helper
(parenthesised where it is a conditional and an operand), each call that passes a collection gets
the keyword, each threaded function gets its keyword-only parameter; then the helper's import is
added among the file's imports of the same top package, and the imports the rewrite left unused are
removed (a name the old code used and the new code does not; a name only re-exported is kept).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

import libcst as cst

from pgregistry.migrate._idioms import Idiom, helper_aliases
from pgregistry.migrate._import_errors import (
    binds_any,
    imports_kept_for_their_error,
    in_tree,
    with_noqa_marker,
)
from pgregistry.migrate._layout import (
    split_argument_line,
    split_arguments,
    split_condition,
    split_header,
    split_key,
    split_lengthened_argument_line,
    split_statement,
)
from pgregistry.migrate._plan import FilePlan, Way, bound_name, import_module_text
from pgregistry.migrate._shims import Dissolved
from pgregistry.migrate._skeleton import restore_placeholders
from pgregistry.migrate._style import DEFAULT_WIDTH

__all__ = ["UnrestorableError", "apply_rewrites"]

_NO_SPACE = cst.SimpleWhitespace("")


def _count_name_reads(nodes: Iterable[ast.AST]) -> Counter[str]:
    """How often each name is read in ``nodes`` outside imports (``x.name`` reads x only)."""
    count: Counter[str] = Counter()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                count[node.id] += 1
    return count


def _count_reads_in_code(code: str | bytes) -> Counter[str]:
    """:func:`_count_name_reads` of ``code``, through :mod:`ast`.

    Many times faster than a libcst walk, since only names count."""
    return _count_name_reads([ast.parse(code)])


class _Prune(cst.CSTTransformer):
    """Drop the import aliases the rewrite left unused, and a statement left importing nothing.

    The modules they import are imported where the code that reads them runs: the fallback helper's
    import of ``parallel_state`` when it falls back. Such a statement is dropped by its block, not a
    ``pass`` left in its place, and the comments above it go onto the statement after it: they say
    what that code does. Not libcst's ``RemoveImportsVisitor``: it needs a ``ScopeProvider``
    analysis of each file (here the unused names come from one :mod:`ast` count) and drops a
    statement's comments with it.

    An import inside a ``try`` or ``with`` statement stays: whether it fails is what the handler
    (``except ImportError: HAVE_MCORE = False``) or the context manager (``suppress``) sees, so
    dropping it would change what the module computes where Megatron-Core is not installed. So
    does one that would fail there, where nothing else would fail first in its place
    (:mod:`~pgregistry.migrate._import_errors`): it stays, marked ``# noqa: F401``, as a guarded
    one binding a name the rewrite left unused is."""

    def __init__(self, unused: set[str], of_tree: Callable[[str], bool]) -> None:
        super().__init__()
        self.unused = unused
        self.of_tree = of_tree
        #: The import statements (ids) kept for the error they raise where their package is missing.
        self.kept_for_error: set[int] = set()
        #: A statement dropped (by id of the original node) -> the comment lines above it.
        self.dropped: dict[int, list[cst.EmptyLine]] = {}
        #: How many ``try`` / ``with`` statements hold the node visited.
        self.guards = 0

    def enter_guard(self, node: cst.CSTNode) -> bool:
        """Count a ``try`` (``try``/``except*``) or ``with`` statement entered; visit its body."""
        self.guards += 1
        return True

    def leave_guard(
        self, original_node: cst.BaseStatement, updated_node: cst.BaseStatement
    ) -> cst.BaseStatement:
        """Count a ``try`` or ``with`` statement left; it stays as the rewrite made it."""
        self.guards -= 1
        return updated_node

    visit_Try = visit_TryStar = visit_With = enter_guard
    leave_Try = leave_TryStar = leave_With = leave_guard

    def keep_failing_imports(self, block: Sequence[cst.CSTNode]) -> None:
        """Mark the imports of ``block`` that stay for their error (outside ``try`` / ``with``)."""
        if not self.guards:
            self.kept_for_error |= imports_kept_for_their_error(block, self.unused, self.of_tree)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        self.keep_failing_imports(node.body)
        return True

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if id(original) in self.kept_for_error or self.guards and binds_any(original, self.unused):
            return with_noqa_marker(original)  # kept though unused: linters are told
        if updated.body:
            return updated
        self.dropped[id(original)] = [
            line for line in original.leading_lines if line.comment is not None
        ]
        return cst.RemoveFromParent()  # not a ``pass`` left in its place

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return _comments_kept(original, updated, self.dropped)

    def _drop_unused_aliases(self, names: Sequence[cst.ImportAlias]) -> list[cst.ImportAlias]:
        kept = [alias for alias in names if bound_name(alias) not in self.unused]
        if kept and len(kept) < len(names):  # the last one's comma (a trailing one, or none)
            kept[-1] = kept[-1].with_changes(comma=names[-1].comma)
        return kept

    def leave_Import(
        self, original: cst.Import, updated: cst.Import
    ) -> cst.Import | cst.RemovalSentinel:
        kept = self._drop_unused_aliases(updated.names)
        return updated.with_changes(names=kept) if kept else cst.RemoveFromParent()

    def leave_ImportFrom(
        self, original: cst.ImportFrom, updated: cst.ImportFrom
    ) -> cst.ImportFrom | cst.RemovalSentinel:
        if isinstance(updated.names, cst.ImportStar):
            return updated
        kept = self._drop_unused_aliases(updated.names)
        if not kept:
            return cst.RemoveFromParent()
        return updated if len(kept) == len(updated.names) else updated.with_changes(names=kept)


def _comments_kept(
    original: cst.IndentedBlock, updated: cst.IndentedBlock, dropped: dict[int, list[cst.EmptyLine]]
) -> cst.IndentedBlock:
    """``updated`` with the comments above each dropped statement moved onto the statement after it.

    ``updated`` is ``original`` without the statements ``dropped`` names (id -> the comment lines
    above it); where no statement follows, the comments go below the block's last one."""
    if not any(id(statement) in dropped for statement in original.body):
        return updated
    kept = iter(updated.body)
    body: list[cst.BaseStatement] = []
    comments: list[cst.EmptyLine] = []
    for statement in original.body:
        if id(statement) in dropped:
            comments += dropped[id(statement)]
            continue
        new = next(kept)
        body.append(
            _with_leading(new, _one_blank([*comments, *_leading_lines(new)])) if comments else new
        )
        comments = []
    if not body:  # the block held only what was dropped: it still needs a statement
        body = [cst.SimpleStatementLine([cst.Pass()])]
    return updated.with_changes(body=body, footer=[*comments, *updated.footer])


def _one_blank(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    """``lines`` with each run of blank lines (no comment) one blank line.

    The blank lines above a dropped statement and those above the next one, joined."""
    kept: list[cst.EmptyLine] = []
    for line in lines:
        if line.comment is None and kept and kept[-1].comment is None:
            continue
        kept.append(line)
    return kept


def _comma_without_comment(comma: cst.Comma | cst.MaybeSentinel) -> cst.Comma | cst.MaybeSentinel:
    """``comma`` (its line break and indent, to copy the one-a-line style) without its comment."""
    if isinstance(comma, cst.Comma) and isinstance(
        comma.whitespace_after, cst.ParenthesizedWhitespace
    ):
        after = comma.whitespace_after.with_changes(
            first_line=cst.TrailingWhitespace(), empty_lines=[]
        )
        return comma.with_changes(whitespace_after=after)
    return comma


def _with_parameter(params: cst.Parameters, name: str) -> cst.Parameters:
    """``params`` with ``name=None`` added keyword-only.

    It goes after ``*args`` or a new bare ``*``, before ``**kw``.
    """
    new = cst.Param(
        cst.Name(name),
        default=cst.Name("None"),
        equal=cst.AssignEqual(whitespace_before=_NO_SPACE, whitespace_after=_NO_SPACE),
    )
    if params.kwonly_params:
        kwonly = list(params.kwonly_params)
        if kwonly[-1].comma is not cst.MaybeSentinel.DEFAULT and params.star_kwarg is None:
            new = new.with_changes(
                comma=kwonly[-1].comma
            )  # one parameter a line, trailing comma: keep the style
            if len(kwonly) >= 2:
                kwonly[-1] = kwonly[-1].with_changes(comma=_comma_without_comment(kwonly[-2].comma))
        return params.with_changes(kwonly_params=[*kwonly, new])
    if isinstance(params.star_arg, (cst.Param, cst.ParamStar)):
        return params.with_changes(kwonly_params=[new])
    positional = list(params.params)
    last = positional[-1].comma if positional else cst.MaybeSentinel.DEFAULT
    if isinstance(last, cst.Comma) and params.star_kwarg is None:
        inner = _comma_without_comment(
            (positional[-2] if len(positional) >= 2 else positional[-1]).comma
        )
        positional[-1] = positional[-1].with_changes(comma=inner)
        star = cst.ParamStar(comma=inner) if isinstance(inner, cst.Comma) else cst.ParamStar()
        return params.with_changes(
            params=positional, star_arg=star, kwonly_params=[new.with_changes(comma=last)]
        )
    return params.with_changes(star_arg=cst.ParamStar(), kwonly_params=[new])


def _break_kept(before: cst.Parameters, after: cst.Parameters) -> cst.Parameters:
    """``after`` with the line break before its closing parenthesis moved to the new parameter.

    ``after`` is ``before`` with the new keyword-only parameter last; the line break that preceded
    the closing parenthesis moves from the old last parameter to the new one: ``(\\n a, b\\n)``
    becomes ``(\\n a, b, *, pg_collection=None\\n)``, not a break before the ``*`` at column 0."""
    if after.star_kwarg is not None or not after.kwonly_params:
        return after
    if before.kwonly_params:
        old = after.kwonly_params[-2]
    elif isinstance(before.star_arg, cst.Param) and isinstance(after.star_arg, cst.Param):
        old = after.star_arg
    elif before.params and not before.kwonly_params:
        old = after.params[-1]
    else:
        return after
    moved = old.whitespace_after_param
    if not isinstance(moved, cst.ParenthesizedWhitespace):
        return after
    kept = old.with_changes(whitespace_after_param=_NO_SPACE)
    new = after.kwonly_params[-1].with_changes(whitespace_after_param=moved)
    if before.kwonly_params:
        return after.with_changes(kwonly_params=[*after.kwonly_params[:-2], kept, new])
    if old is after.star_arg:
        return after.with_changes(star_arg=kept, kwonly_params=[new])
    return after.with_changes(params=[*after.params[:-1], kept], kwonly_params=[new])


def _with_keyword(call: cst.Call, keyword: str, value: cst.BaseExpression) -> cst.Call:
    """``call`` with ``keyword=value`` after its arguments, in their layout.

    One a line when they are (the closing parenthesis kept on its own line), else after a comma and
    a space."""
    new = cst.Arg(
        value,
        keyword=cst.Name(keyword),
        equal=cst.AssignEqual(whitespace_before=_NO_SPACE, whitespace_after=_NO_SPACE),
    )
    args = list(call.args)
    if (
        args and args[-1].comma is not cst.MaybeSentinel.DEFAULT
    ):  # a trailing comma: one argument per line
        new = new.with_changes(comma=args[-1].comma)
        if len(args) >= 2:
            args[-1] = args[-1].with_changes(comma=_comma_without_comment(args[-2].comma))
    elif (
        args
        and isinstance(args[-1].whitespace_after_arg, cst.ParenthesizedWhitespace)
        and isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace)
    ):  # the last argument on its own line
        line_break = call.whitespace_before_args.with_changes(
            first_line=cst.TrailingWhitespace(), empty_lines=[]
        )
        new = new.with_changes(whitespace_after_arg=args[-1].whitespace_after_arg)
        args[-1] = args[-1].with_changes(
            comma=cst.Comma(whitespace_after=line_break), whitespace_after_arg=_NO_SPACE
        )
    return call.with_changes(args=[*args, new])


class _SingleQuoted(cst.CSTTransformer):
    """Each plain string literal of a node the rewrite made in single quotes.

    Such as ``"tp"``, ``"next_rank"``: before Python 3.12 an expression inside a double-quoted
    f-string may not hold a double quote."""

    def leave_SimpleString(
        self, original: cst.SimpleString, updated: cst.SimpleString
    ) -> cst.SimpleString:
        if updated.value.startswith('"') and "'" not in updated.value and "\\" not in updated.value:
            return updated.with_changes(value=f"'{updated.value[1:-1]}'")
        return updated


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


class _Rewriter(cst.CSTTransformer):
    def __init__(self, plan: FilePlan, target: Idiom, width: int) -> None:
        super().__init__()
        self.target = target
        self.plan = plan
        #: The tree's line length and indentation unit; how many blocks enclose the node visited;
        #: whether the statement being visited has a call the rewrite changed (then a line it made
        #: too long is split).
        self.width = width
        self.unit = plan.wrapper.module.default_indent
        self.depth = 0
        self.changed = False
        self.replacements: dict[int, cst.BaseExpression] = {}
        self.imports: list[tuple[str, str]] = []
        #: Module-level statement -> the members of its class body to walk (None: the whole
        #: statement).
        self.touched: dict[int, set[int] | None] = {}
        for top, member in plan.passing_tops:
            self._mark_touched(top, member)
        #: A dissolved shim's field reads (by id of the ``Attribute``), and the statements assigning
        #: it (by id).
        self.field_reads: dict[int, cst.BaseExpression] = {}
        self.shims: set[int] = set()
        #: The statements removed (by id of the original) -> the comment lines above each.
        self.dropped: dict[int, list[cst.EmptyLine]] = {}
        for read in plan.reads:
            if read.way == Way.LEFT or read.call is None or read.function is None:
                continue
            self._mark_touched(read.top, read.member)
            if read.shim is not None:
                self._dissolve_shim(read.shim, read.collection)
                continue
            code, operator = target.replacement(read)
            if operator and id(read.call) not in plan.alone:
                code = f"({code})"
            self.replacements[id(read.call)] = cst.parse_expression(code)
            self.imports += target.imports(code)
        self.functions = {id(f.node): f for f in plan.functions if f.added or f.shim_name}
        for function in self.functions.values():
            self._mark_touched(function.top, function.member)
        #: The ``If`` nodes (by id) that are the ``elif`` of another.
        self.elifs: set[int] = set()
        #: The quotes of the f-strings enclosing the node visited (``f"``, ``rf'''``), innermost
        #: last.
        self.f_strings: list[str] = []

    def _dissolve_shim(self, shim: Dissolved, collection: str) -> None:
        """Plan shim ``shim`` (:mod:`._shims`) rewritten.

        Each field read becomes a read of ``collection``.
        """
        for attribute, field, keywords in shim.reads:
            code = self.target.field_read(collection, field, keywords)
            self.field_reads[id(attribute)] = cst.parse_expression(code)
            self.imports += self.target.imports(code)
        if shim.statement is not None:
            self.shims.add(id(shim.statement))

    def _mark_touched(self, top: int, member: int) -> None:
        members = self.touched.setdefault(top, set())
        if members is not None and member >= 0:
            members.add(member)
        else:
            self.touched[top] = None

    def walk(self, index: int, statement: cst.BaseStatement) -> object:
        """``statement`` rewritten, walking only what changes (a class's touched members)."""
        members = self.touched.get(index, set())
        if index not in self.touched:
            return statement
        if members is None or not isinstance(statement, cst.ClassDef):
            return statement.visit(self)
        self.depth = 1  # a member is visited alone: its class's block is not entered
        body = [s.visit(self) if i in members else s for i, s in enumerate(statement.body.body)]
        self.depth = 0
        kept = [s for s in body if isinstance(s, cst.CSTNode)]
        return statement.with_changes(body=statement.body.with_changes(body=kept))

    def _indent_columns(self) -> int:
        return self.depth * len(self.unit.expandtabs(4))

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        self.depth += 1
        return True

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        self.depth -= 1
        return _comments_kept(original, updated, self.dropped)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        self.changed = False
        return True

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if (
            id(original) in self.shims
        ):  # a dissolved shim's assignment: its reads are the fields' now
            self.dropped[id(original)] = list(
                original.leading_lines
            )  # its blank lines and comments go on
            return cst.RemoveFromParent()
        if not self.changed:
            return updated
        self.changed = False
        return split_statement(updated, self._indent_columns(), self.width, self.unit)

    def visit_If(self, node: cst.If) -> bool:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))
        return True

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if updated.test.deep_equals(
            original.test
        ):  # libcst rebuilds every node: ``is`` never holds
            return updated
        keyword = "elif" if id(original) in self.elifs else "if"
        split = split_condition(updated, keyword, self._indent_columns(), self.width, self.unit)
        assert isinstance(split, cst.If)
        return split

    def leave_While(self, original: cst.While, updated: cst.While) -> cst.While:
        if updated.test.deep_equals(original.test):
            return updated
        split = split_condition(updated, "while", self._indent_columns(), self.width, self.unit)
        assert isinstance(split, cst.While)
        return split

    def visit_FormattedString(self, node: cst.FormattedString) -> bool:
        self.f_strings.append(node.start)
        return True

    def leave_FormattedString(
        self, original: cst.FormattedString, updated: cst.FormattedString
    ) -> cst.FormattedString:
        self.f_strings.pop()
        return updated

    def _with_f_string_quotes(self, node: cst.BaseExpression) -> cst.BaseExpression:
        """``node`` (made by the rewrite) with quotes the enclosing f-string allows inside."""
        if self.f_strings and '"' in self.f_strings[-1]:
            return node.visit(_SingleQuoted())  # type: ignore[return-value]
        return node

    def leave_Attribute(
        self, original: cst.Attribute, updated: cst.Attribute
    ) -> cst.BaseExpression:
        replacement = self.field_reads.get(id(original))
        if replacement is None:
            return updated
        self.changed = True
        return self._with_f_string_quotes(replacement)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        replacement = self.replacements.get(id(original))
        if replacement is not None:
            self.changed = True
            return self._with_f_string_quotes(replacement)
        passing = self.plan.passes.get(id(original))
        if passing is not None:
            self.changed = True
            keyword, value = passing
            added = _with_keyword(
                updated, keyword, self._with_f_string_quotes(cst.parse_expression(value))
            )
            updated = split_argument_line(
                added, updated, original, self._indent_columns(), self.width, self.unit
            )
        if not (self.changed and updated.args):
            return updated
        indent = self._indent_columns()
        # an argument on a line of its own, or the one line of arguments, a rewrite made too long
        updated = split_arguments(updated, original, indent, self.width, self.unit)
        return split_lengthened_argument_line(updated, original, indent, self.width, self.unit)

    def leave_DictComp(self, original: cst.DictComp, updated: cst.DictComp) -> cst.DictComp:
        if updated.key.deep_equals(original.key):  # the author's key, however long, is left
            return updated
        return split_key(
            updated, self._indent_columns(), self.width, self.unit
        )  # a key the rewrite made too long

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        function = self.functions.get(id(original))
        if function is None:
            return updated
        if function.added:
            params = _with_parameter(updated.params, function.added)
            updated = updated.with_changes(params=_break_kept(updated.params, params))
            updated = split_header(updated, self._indent_columns(), self.width, self.unit)
        if not function.shim_name or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        listed = ", ".join(f'"{f}"' for f in function.shim_fields)
        shim = cst.parse_statement(
            f"{function.shim_name} = {function.builder_class}.use_mpu_process_groups("
            f"required_pgs=[{listed}])\n"
        )
        assert isinstance(shim, cst.SimpleStatementLine)
        shim = split_statement(
            shim, self._indent_columns() + len(self.unit.expandtabs(4)), self.width, self.unit
        )
        body = list(updated.body.body)
        body.insert(function.shim_at, shim)
        return updated.with_changes(body=updated.body.with_changes(body=body))


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


def _leading_lines(statement: cst.CSTNode) -> Sequence[cst.EmptyLine]:
    return (
        statement.leading_lines
        if isinstance(statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
        else ()
    )


def _with_leading(
    statement: cst.BaseStatement, lines: Sequence[cst.EmptyLine]
) -> cst.BaseStatement:
    """``statement`` with ``lines`` (blank lines, comments) above it."""
    if isinstance(statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        return statement.with_changes(leading_lines=lines)
    return statement


def _from_import(module: str, names: Sequence[str], width: int) -> cst.BaseStatement:
    """``from module import names`` as black writes it: on one line, or one name a line.

    One name a line in parentheses where one line would pass ``width``."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) > width:
        line = f"from {module} import (\n" + "".join(f"    {name},\n" for name in names) + ")"
    return cst.parse_statement(line + "\n")


def _from_import_names(statement: cst.BaseStatement) -> tuple[str, list[str]] | None:
    """(module, names) of a module-level ``from M import names`` statement standing alone.

    A name imported under another is ``name as alias``, as :func:`_from_import` writes it."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return None
    small = statement.body[0]
    if not isinstance(small, cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
        return None
    return import_module_text(small), [
        alias.evaluated_name
        if alias.evaluated_alias is None
        else f"{alias.evaluated_name} as {alias.evaluated_alias}"
        for alias in small.names
    ]


def _helper_bindings(module: cst.Module, helper_module: str) -> dict[str, str]:
    """The names ``module``'s own imports of ``helper_module`` bind -> the helper's name each is."""
    bound: dict[str, str] = {}
    for statement in module.body:
        found = _from_import_names(statement)
        if found is not None and found[0] == helper_module:
            for text in found[1]:
                name, _, alias = text.partition(" as ")
                bound[alias or name] = name
    return bound


def _with_imports(module: cst.Module, needed: list[tuple[str, str]], width: int) -> cst.Module:
    """``module`` importing each needed ``(module, name)``.

    Each is added to its ``from M import`` of that module if it has one, else as a new statement
    among its peers (the module-level imports of the same top package, in order of module name,
    relative ones last), after its last module-level import when it has none (after the docstring
    when it has no import). Top-level statements only, no walk of the tree. Not libcst's
    ``AddImportsVisitor``: it puts a new statement at the end of the first import block, not among
    its peers, on one line whatever its length."""
    body: list[cst.BaseStatement] = list(module.body)
    for name in dict.fromkeys(m for m, _ in needed):
        names = sorted({n for m, n in needed if m == name})
        top = name.partition(".")[0]
        at, peers = 0, []
        for index, statement in enumerate(body):
            found = _from_import_names(statement)
            if found is not None and found[0] == name:
                have = found[1]
                if not set(names) <= set(
                    have
                ):  # one import of the helper, its blank lines above kept
                    merged = _from_import(name, sorted({*have, *names}), width)
                    body[index] = _with_leading(merged, _leading_lines(statement))
                break
            if _is_import(statement) or (index == 0 and _is_docstring(statement)):
                at = index + 1
            if found is not None and (
                found[0].startswith(".") or found[0].partition(".")[0] == top
            ):
                peers.append((index, found[0]))
        else:
            later = [index for index, peer in peers if peer.startswith(".") or peer > name]
            new = _from_import(name, names, width)
            if later:  # first of its peers: it takes the blank lines and comments above the block
                at = later[0]
                new, body[at] = (
                    _with_leading(new, _leading_lines(body[at])),
                    _with_leading(body[at], ()),
                )
            else:
                at = peers[-1][0] + 1 if peers else at
            body.insert(at, new)
    return module.with_changes(body=body)


#: A text's last line ending, as Python's tokenizer ends a line: ``\r\n``, a lone ``\r``, ``\n``.
_FINAL_LINE_END = re.compile(rb"(?:\r\n|\r|\n)\Z")


class _Renderer:
    """Renders module-level statements once, keeping each one's text for the module's.

    Each one's text is kept (with the node, as ids are reused) and the module's text is theirs
    joined, so a statement rendered to count its names is not rendered again. ``source``: the bytes
    parsed, whose last line ending the module's text keeps."""

    def __init__(self, module: cst.Module, source: bytes) -> None:
        self.module = module
        self.done: dict[int, tuple[cst.CSTNode, str]] = {}
        # libcst takes a file whose last line ends in a lone ``\r``, or in a comment ending with
        # ``\``, for one without a final newline, and its render drops that line's ending.
        final = _FINAL_LINE_END.search(source)
        self.dropped_ending = (
            final.group().decode("ascii") if final and not module.has_trailing_newline else ""
        )

    def statement(self, node: cst.CSTNode) -> str:
        kept = self.done.get(id(node))
        if kept is not None and kept[0] is node:
            return kept[1]
        text = self.module.code_for_node(node)
        self.done[id(node)] = (node, text)
        return text

    def code(self, module: cst.Module) -> str:
        """``module.code``, from the statements' texts.

        Through libcst's own render where it found no final newline, which pops it (and the ending
        it dropped put back, see :meth:`__init__`)."""
        if not module.has_trailing_newline:
            return module.code + self.dropped_ending
        text = "".join(
            [
                *(module.code_for_node(h) for h in module.header),
                *map(self.statement, module.body),
                *(module.code_for_node(f) for f in module.footer),
            ]
        )
        return text or module.default_newline


def _names_left_unread(
    plan: FilePlan, body: Sequence[object], touched: Sequence[int], render: _Renderer
) -> set[str] | None:
    """The names the rewrite leaves unread; None when a new statement does not parse alone.

    Unread: read in a statement it changed, not in that statement's new code, and nowhere else (the
    other statements' text is searched first; the rare hit is checked on their ast)."""
    assert plan.data is not None
    old = _count_name_reads(n for index in touched for n in plan.statements[index])
    new: Counter[str] = Counter()
    try:
        for index in touched:
            statement = body[index]
            if isinstance(statement, cst.CSTNode):
                new.update(
                    _count_reads_in_code(_restore_skeleton_text(plan, render.statement(statement)))
                )
    except (SyntaxError, ValueError):
        return None
    gone = {name for name, count in old.items() if count and new[name] <= 0}
    if not gone:
        return gone
    changed = set(touched)
    texts = {i: plan.text(*plan.spans[i]) for i in range(len(plan.statements)) if i not in changed}
    unused = set()
    for name in gone:
        word = re.compile(rb"\b" + re.escape(name.encode()) + rb"\b")
        # An identifier's text is its name unless it is not ASCII (the parser normalises those):
        # then the ast.
        hits = [i for i, text in texts.items() if word.search(text) or not text.isascii()]
        if not hits or _count_name_reads(n for i in hits for n in plan.statements[i])[name] == 0:
            unused.add(name)
    return unused


class UnrestorableError(RuntimeError):
    """A placeholder of the skeleton occurs twice in the rewritten text: a bug of this tool."""


def _restore_skeleton_text(plan: FilePlan, text: str) -> str:
    """``text`` with the skeleton's placeholders it holds replaced by their original text."""
    if not plan.kept:
        return text
    restored = restore_placeholders(text, plan.kept)
    if restored is None:
        raise UnrestorableError(f"{plan.path}: a placeholder occurs twice in the rewritten text")
    return restored


def apply_rewrites(
    plan: FilePlan,
    target: Idiom,
    width: int = DEFAULT_WIDTH,
    reached: AbstractSet[str] = frozenset(),
    modules: AbstractSet[str] = frozenset(),
) -> str | None:
    """The source of ``plan``'s file with its planned rewrites applied; None when none is planned.

    ``width``: the tree's line length (:mod:`~pgregistry.migrate._style`). ``reached``: the names of
    the file's module that other code reaches (``from m import x`` in another file, ``__all__``;
    ``*``: every public name, for ``from m import *``): an import binding one stays. ``modules``:
    the migrated tree's modules, whose imports cannot fail for a package that is not installed."""
    module = plan.wrapper.module
    data = plan.data if plan.data is not None else module.bytes
    # A helper's name the file binds itself is shadowed by it, or shadows it: called by another.
    aliases = helper_aliases(data, _helper_bindings(module, target.module))
    rewriter = _Rewriter(plan, replace(target, aliases=aliases) if aliases else target, width)
    if (
        not rewriter.replacements
        and not rewriter.field_reads
        and not rewriter.shims
        and not plan.passes
        and not rewriter.functions
    ):
        return None
    render = _Renderer(module, data)
    # Only the module-level statements with a change are walked: a libcst walk rebuilds every node
    # it visits.
    body = [rewriter.walk(i, s) for i, s in enumerate(module.body)]
    changed = module.with_changes(body=[s for s in body if isinstance(s, cst.CSTNode)])
    if rewriter.imports:
        changed = _with_imports(changed, list(dict.fromkeys(rewriter.imports)), width)
    unused = (
        _names_left_unread(plan, body, sorted(rewriter.touched), render)
        if plan.statements
        else None
    )
    if unused is None:  # no spans, or a statement that does not parse alone: the whole texts
        before = _count_reads_in_code(data)
        after = _count_reads_in_code(_restore_skeleton_text(plan, render.code(changed)))
        unused = {name for name, count in before.items() if count and after[name] <= 0}
    unused = {
        name
        for name in unused
        if name not in reached and ("*" not in reached or name.startswith("_"))
    }
    if not unused:
        return _restore_skeleton_text(plan, render.code(changed))
    # An import the rewrite left unused is at module level, in a module-level block (``if
    # TYPE_CHECKING:``, ``try:``) or in a statement the rewrite changed, and its old text says
    # ``import``: only those are walked.
    prune = _Prune(unused, lambda imported: in_tree(imported, modules))
    prune.keep_failing_imports(changed.body)
    index = {id(s): i for i, s in enumerate(body)}

    def may_import(statement: cst.CSTNode) -> bool:
        at = index.get(id(statement))
        if at is None:  # an import the rewrite added
            return True
        if at not in rewriter.touched and isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            return False
        if not plan.spans:
            return True
        return b"import" in plan.text(*plan.spans[at])

    pruned: list[cst.BaseStatement] = []
    orphaned: Sequence[
        cst.EmptyLine
    ] = ()  # the blank lines and comments above a statement that went
    for statement in changed.body:
        visited = statement.visit(prune) if may_import(statement) else statement
        if isinstance(visited, cst.BaseStatement):
            pruned.append(
                _with_leading(visited, [*orphaned, *_leading_lines(visited)])
                if orphaned
                else visited
            )
            orphaned = ()
        elif not orphaned:
            orphaned = _leading_lines(statement)
    return _restore_skeleton_text(plan, render.code(changed.with_changes(body=pruned)))
