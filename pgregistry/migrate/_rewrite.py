"""Apply a :class:`~pgregistry.migrate._plan.FilePlan` to its libcst tree: the new source text.

Only the nodes planning named change; libcst keeps every other byte (comments, blank lines, quotes,
parentheses). In order: each planned read becomes its replacement (parenthesised where it is an operand and a
comparison or conditional), each call that passes a collection gets the keyword, each threaded function gets its
keyword-only parameter and, where an unguarded read needs it, the door at the top of its body (after the
docstring); then the imports the new code needs are added and the imports it left unused are removed (a name
the old code used and the new code does not; a name only re-exported is kept).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import libcst as cst

from pgregistry.migrate._idioms import Idiom
from pgregistry.migrate._plan import LEFT, FilePlan, Function
from pgregistry.migrate._skeleton import restore

__all__ = ["UnrestorableError", "rewrite"]

_NO_SPACE = cst.SimpleWhitespace("")


def _names(nodes: Iterable[ast.AST]) -> Counter[str]:
    """How often each name is read in ``nodes`` outside import statements (``x.name`` reads x only)."""
    count: Counter[str] = Counter()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                count[node.id] += 1
    return count


def _uses(code: str | bytes) -> Counter[str]:
    """:func:`_names` of ``code``. Through :mod:`ast`, many times faster than a libcst walk, since only names
    count."""
    return _names([ast.parse(code)])


def _bound(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    node: cst.BaseExpression = alias.name
    while isinstance(node, cst.Attribute):
        node = node.value  # ``import a.b`` binds ``a``
    assert isinstance(node, cst.Name)
    return node.value


#: The comment on an import the rewrite left unused but keeps: it may be what imports its module first.
NOQA = "# noqa: F401  (kept for its import order)"


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


class _Prune(cst.CSTTransformer):
    """Drop the import aliases whose names the rewrite left unused, where dropping cannot change what is
    imported when: an import runs its module's code (and can decide a circular import's order), so a name goes
    only when it is no submodule (a module of the scanned tree whose submodules are known) or one imported
    already, and its statement still imports the module or the module was imported already (above, at module
    level, or as the file's own package). Any other unused alias stays, its statement marked :data:`NOQA`."""

    def __init__(self, unused: set[str], module: str, package: list[str], modules: frozenset[str]) -> None:
        super().__init__()
        self.unused = unused
        self.package = package
        self.modules = modules
        #: Modules surely imported before the statement now visited (the module-level imports above it).
        self.imported = _ancestors(module) if module else set()
        self.kept_unused = False

    def _attribute(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` surely reads an attribute, not a submodule it would import."""
        qualified = f"{module}.{name}"
        if qualified in self.imported:
            return True
        return module in self.modules and qualified not in self.modules and not any(
            m.startswith(qualified + ".") for m in self.modules)

    def _kept(self, names: Sequence[cst.ImportAlias], droppable: list[bool]) -> list[cst.ImportAlias]:
        kept = [alias for alias, drop in zip(names, droppable, strict=True) if not drop]
        if kept and len(kept) < len(names) and names[-1].comma is not cst.MaybeSentinel.DEFAULT:
            kept[-1] = kept[-1].with_changes(comma=names[-1].comma)
        elif kept and len(kept) < len(names):
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return kept

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if not updated.body:
            return cst.RemoveFromParent()  # not a ``pass`` left in its place
        if self.kept_unused:
            self.kept_unused = False
            updated = updated.with_changes(trailing_whitespace=_noqa(updated.trailing_whitespace))
        return updated

    def leave_Import(self, original: cst.Import, updated: cst.Import) -> cst.Import | cst.RemovalSentinel:
        names = updated.names
        unused = [_bound(alias) in self.unused for alias in names]
        droppable = [u and ".".join(_parts(a.name)) in self.imported for u, a in zip(unused, names, strict=True)]
        self.kept_unused |= any(u and not d for u, d in zip(unused, droppable, strict=True))
        kept = self._kept(names, droppable)
        return updated.with_changes(names=kept) if kept else cst.RemoveFromParent()

    def leave_ImportFrom(
        self, original: cst.ImportFrom, updated: cst.ImportFrom
    ) -> cst.ImportFrom | cst.RemovalSentinel:
        if isinstance(updated.names, cst.ImportStar):
            return updated
        module = _absolute(updated, self.package)
        names = updated.names
        unused = [_bound(alias) in self.unused for alias in names]
        droppable = [u and _attribute for u, _attribute in
                     zip(unused, (self._attribute(module, ".".join(_parts(a.name))) for a in names), strict=True)]
        if all(droppable) and module not in self.imported:
            droppable = [False] * len(names)  # the statement would go, and with it the import of its module
        kept = self._kept(names, droppable)
        if not kept:
            return cst.RemoveFromParent()
        if any(u and not d for u, d in zip(unused, droppable, strict=True)):
            whitespace = updated.lpar.whitespace_after if updated.lpar is not None else None
            if isinstance(whitespace, cst.ParenthesizedWhitespace):  # the comment goes on the first line
                first = whitespace.first_line.with_changes(comment=_comment(whitespace.first_line.comment))
                lpar = updated.lpar
                assert lpar is not None
                updated = updated.with_changes(
                    lpar=lpar.with_changes(whitespace_after=whitespace.with_changes(first_line=first)))
            else:
                self.kept_unused = True
        return updated if len(kept) == len(names) else updated.with_changes(names=kept)

    def note(self, statement: cst.CSTNode) -> None:
        """Record the modules a module-level import statement that stays imports."""
        if not _is_import(statement):
            return
        assert isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    self.imported |= _ancestors(".".join(_parts(alias.name)))
            elif isinstance(small, cst.ImportFrom):
                module = _absolute(small, self.package)
                if module:
                    self.imported |= _ancestors(module)
                if not isinstance(small.names, cst.ImportStar):
                    self.imported |= {f"{module}.{'.'.join(_parts(a.name))}" for a in small.names
                                      if not self._attribute(module, ".".join(_parts(a.name)))}


def _comment(comment: cst.Comment | None) -> cst.Comment:
    if comment is None:
        return cst.Comment(NOQA)
    codes = re.search(r"#\s*noqa(:)?", comment.value, re.IGNORECASE)
    if codes is not None:  # a bare noqa covers F401; one with codes gets it added
        if codes.group(1) is None or "F401" in comment.value[codes.end():].split("#")[0]:
            return comment
        return cst.Comment(f"{comment.value[:codes.end()]} F401,{comment.value[codes.end():]}")
    return cst.Comment(f"{comment.value}  {NOQA}")


def _noqa(trailing: cst.TrailingWhitespace) -> cst.TrailingWhitespace:
    whitespace = trailing.whitespace if trailing.comment is not None else cst.SimpleWhitespace("  ")
    return trailing.with_changes(whitespace=whitespace, comment=_comment(trailing.comment))


def _absolute(node: cst.ImportFrom, package: list[str]) -> str:
    """The absolute name of the module ``node`` imports from (relative to ``package``)."""
    parts = _parts(node.module) if node.module is not None else []
    level = len(node.relative)
    if level == 0:
        return ".".join(parts)
    base = package[: max(0, len(package) - (level - 1))]
    return ".".join([*base, *parts])


def _clean(comma: cst.Comma | cst.MaybeSentinel) -> cst.Comma | cst.MaybeSentinel:
    """``comma`` (its line break and indentation, to copy the one-a-line style) without its comment."""
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        after = comma.whitespace_after.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
        return comma.with_changes(whitespace_after=after)
    return comma


def _with_parameter(params: cst.Parameters, name: str) -> cst.Parameters:
    """``params`` with ``name=None`` added keyword-only (after ``*args`` or a new bare ``*``, before ``**kw``)."""
    new = cst.Param(cst.Name(name), default=cst.Name("None"),
                    equal=cst.AssignEqual(whitespace_before=_NO_SPACE, whitespace_after=_NO_SPACE))
    if params.kwonly_params:
        kwonly = list(params.kwonly_params)
        if kwonly[-1].comma is not cst.MaybeSentinel.DEFAULT and params.star_kwarg is None:
            new = new.with_changes(comma=kwonly[-1].comma)  # one parameter a line, trailing comma: keep the style
            if len(kwonly) >= 2:
                kwonly[-1] = kwonly[-1].with_changes(comma=_clean(kwonly[-2].comma))
        return params.with_changes(kwonly_params=[*kwonly, new])
    if isinstance(params.star_arg, (cst.Param, cst.ParamStar)):
        return params.with_changes(kwonly_params=[new])
    positional = list(params.params)
    last = positional[-1].comma if positional else cst.MaybeSentinel.DEFAULT
    if isinstance(last, cst.Comma) and params.star_kwarg is None:
        inner = _clean((positional[-2] if len(positional) >= 2 else positional[-1]).comma)
        positional[-1] = positional[-1].with_changes(comma=inner)
        star = cst.ParamStar(comma=inner) if isinstance(inner, cst.Comma) else cst.ParamStar()
        return params.with_changes(params=positional, star_arg=star,
                                   kwonly_params=[new.with_changes(comma=last)])
    return params.with_changes(star_arg=cst.ParamStar(), kwonly_params=[new])


def _break_kept(before: cst.Parameters, after: cst.Parameters) -> cst.Parameters:
    """``after`` (``before`` with the new keyword-only parameter last) with the line break that preceded the
    closing parenthesis moved from the old last parameter to the new one: ``(\\n    a, b\\n)`` becomes
    ``(\\n    a, b, *, pg_collection=None\\n)``, not a break before the ``*`` at column 0."""
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


def _with_keyword(call: cst.Call, keyword: str, value: str) -> cst.Call:
    """``call`` with ``keyword=value`` after its arguments, in their layout: one a line when they are (the
    closing parenthesis kept on its own line), else after a comma and a space."""
    new = cst.Arg(cst.parse_expression(value), keyword=cst.Name(keyword),
                  equal=cst.AssignEqual(whitespace_before=_NO_SPACE, whitespace_after=_NO_SPACE))
    args = list(call.args)
    if args and args[-1].comma is not cst.MaybeSentinel.DEFAULT:  # a trailing comma: one argument per line
        new = new.with_changes(comma=args[-1].comma)
        if len(args) >= 2:
            args[-1] = args[-1].with_changes(comma=_clean(args[-2].comma))
    elif args and isinstance(args[-1].whitespace_after_arg, cst.ParenthesizedWhitespace) and isinstance(
            call.whitespace_before_args, cst.ParenthesizedWhitespace):  # the last argument on its own line
        line_break = call.whitespace_before_args.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
        new = new.with_changes(whitespace_after_arg=args[-1].whitespace_after_arg)
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=line_break), whitespace_after_arg=_NO_SPACE)
    return call.with_changes(args=[*args, new])


def _docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


class _Rewriter(cst.CSTTransformer):
    def __init__(self, plan: FilePlan, target: Idiom) -> None:
        super().__init__()
        self.target = target
        self.plan = plan
        self.replacements: dict[int, cst.BaseExpression] = {}
        self.imports: list[tuple[str, str]] = []
        #: How many indented blocks enclose the node being left (the door's indentation).
        self.depth = 0
        #: Module-level statement -> the members of its class body to walk (None: the whole statement).
        self.touched: dict[int, set[int] | None] = {}
        for top, member in plan.passing_tops:
            self._touch(top, member)
        for read in plan.reads:
            if read.way == LEFT or read.call is None or read.function is None:
                continue
            self._touch(read.top, read.member)
            code, operator = target.replacement(read, _owner(plan, read.function))
            if operator and id(read.call) not in plan.alone:
                code = f"({code})"
            self.replacements[id(read.call)] = cst.parse_expression(code)
            self.imports += target.imports(code)
        self.functions = {id(f.node): f for f in plan.functions if f.added or f.door_name or f.shim_name}
        for function in self.functions.values():
            self._touch(function.top, function.member)

    def _touch(self, top: int, member: int) -> None:
        members = self.touched.setdefault(top, set())
        if members is not None and member >= 0:
            members.add(member)
        else:
            self.touched[top] = None

    def walk(self, index: int, statement: cst.BaseStatement) -> object:
        """``statement`` rewritten, walking only what changes (a class's touched members, not all of it)."""
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

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        self.depth += 1
        return True

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        self.depth -= 1
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        replacement = self.replacements.get(id(original))
        if replacement is not None:
            return replacement
        passing = self.plan.passes.get(id(original))
        if passing is not None:
            return _with_keyword(updated, *passing)
        return updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        function = self.functions.get(id(original))
        if function is None:
            return updated
        if function.added:
            params = _with_parameter(updated.params, function.added)
            updated = updated.with_changes(params=_break_kept(updated.params, params))
        if not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        inserts: list[tuple[int, int, cst.BaseStatement]] = []  # (index in the original body, order there, it)
        if function.shim_name:
            listed = ", ".join(f'"{f}"' for f in function.shim_fields)
            shim = (f"{function.shim_name} = {function.builder_class}.use_mpu_process_groups(\n"
                    f"    required_pgs=[{listed}]\n)\n")
            inserts.append((function.shim_at, 0, cst.parse_statement(shim)))
        if function.door_name:
            indent = (self.depth + 1) * len(self.plan.wrapper.module.default_indent.expandtabs())
            code = self.target.door(function.door_name, _owner(self.plan, function), function.door, indent)
            self.imports += self.target.imports(code)
            at = max(function.door_at, 1 if body and _docstring(body[0]) else 0)
            inserts.append((at, 1, cst.parse_statement(code)))
        # Both indexes are of the original body: inserted from the last, each lands where it was planned.
        for at, _, statement in sorted(inserts, key=lambda insert: (insert[0], insert[1]), reverse=True):
            body.insert(at, statement)
        if inserts:
            updated = updated.with_changes(body=updated.body.with_changes(body=body))
        return updated


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


def _with_imports(module: cst.Module, needed: list[tuple[str, str]]) -> cst.Module:
    """``module`` with ``from M import N`` for each needed pair it does not import yet, after its last top-level
    import (after the docstring when it has none): top-level statements only, no walk of the tree."""
    have = {
        (".".join(_parts(small.module)), _bound(alias))
        for statement in module.body if _is_import(statement)
        for small in (statement.body if isinstance(statement, cst.SimpleStatementLine) else ())
        if isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative
        and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    }
    grouped: dict[str, list[str]] = {}
    for module_name, name in needed:
        if (module_name, name) not in have:
            grouped.setdefault(module_name, []).append(name)
    if not grouped:
        return module
    body = list(module.body)
    at = 0
    for index, statement in enumerate(body):
        if _is_import(statement) or (index == 0 and _docstring(statement)):
            at = index + 1
    lines = [cst.parse_statement(f"from {m} import {', '.join(sorted(names))}\n") for m, names in grouped.items()]
    return module.with_changes(body=[*body[:at], *lines, *body[at:]])


def _parts(node: cst.BaseExpression) -> list[str]:
    if isinstance(node, cst.Attribute):
        return [*_parts(node.value), node.attr.value]
    assert isinstance(node, cst.Name)
    return [node.value]


class _Renderer:
    """Renders module-level statements once: each one's text is kept (with the node, as ids are reused) and the
    module's text is theirs joined, so a statement rendered to count its names is not rendered again."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.done: dict[int, tuple[cst.CSTNode, str]] = {}

    def statement(self, node: cst.CSTNode) -> str:
        kept = self.done.get(id(node))
        if kept is not None and kept[0] is node:
            return kept[1]
        text = self.module.code_for_node(node)
        self.done[id(node)] = (node, text)
        return text

    def code(self, module: cst.Module) -> str:
        """``module.code``, from the statements' texts (libcst's own render where the file has no final newline,
        which pops it)."""
        if not module.has_trailing_newline:
            return module.code
        text = "".join([*(module.code_for_node(h) for h in module.header), *map(self.statement, module.body),
                        *(module.code_for_node(f) for f in module.footer)])
        return text or module.default_newline


def _unused(plan: FilePlan, body: Sequence[object], touched: Sequence[int], render: _Renderer) -> set[str] | None:
    """The names the rewrite leaves unread: read in a statement it changed, not in that statement's new code,
    and nowhere else (the other statements' text is searched first; the rare hit is checked on their ast). None
    when a new statement does not parse alone."""
    assert plan.data is not None
    old = _names(n for index in touched for n in plan.statements[index])
    new: Counter[str] = Counter()
    try:
        for index in touched:
            statement = body[index]
            if isinstance(statement, cst.CSTNode):
                new.update(_uses(_restored(plan, render.statement(statement))))
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
        # An identifier's text is its name unless it is not ASCII (the parser normalises those): then the ast.
        hits = [i for i, text in texts.items() if word.search(text) or not text.isascii()]
        if not hits or _names(n for i in hits for n in plan.statements[i])[name] == 0:
            unused.add(name)
    return unused


class UnrestorableError(RuntimeError):
    """A placeholder of the skeleton occurs twice in the rewritten text: a bug of this tool."""


def _restored(plan: FilePlan, text: str) -> str:
    """``text`` with the skeleton's placeholders it holds replaced by their original text."""
    if not plan.kept:
        return text
    restored = restore(text, plan.kept)
    if restored is None:
        raise UnrestorableError(f"{plan.path}: a placeholder occurs twice in the rewritten text")
    return restored


def _owner(plan: FilePlan, function: Function) -> str:
    return f"{plan.module}.{function.qualname}" if plan.module else function.qualname


def rewrite(plan: FilePlan, target: Idiom, modules: frozenset[str] = frozenset()) -> str | None:
    """The source of ``plan``'s file with its planned rewrites applied; None when none is planned. ``modules``:
    the dotted names of the scanned tree's modules (which names an import may not drop, see :class:`_Prune`)."""
    module = plan.wrapper.module
    rewriter = _Rewriter(plan, target)
    if not rewriter.replacements and not plan.passes and not rewriter.functions:
        return None
    data = plan.data if plan.data is not None else module.bytes
    render = _Renderer(module)
    # Only the module-level statements with a change are walked: a libcst walk rebuilds every node it visits.
    body = [rewriter.walk(i, s) for i, s in enumerate(module.body)]
    changed = module.with_changes(body=[s for s in body if isinstance(s, cst.CSTNode)])
    if rewriter.imports:
        changed = _with_imports(changed, list(dict.fromkeys(rewriter.imports)))
    unused = _unused(plan, body, sorted(rewriter.touched), render) if plan.statements else None
    if unused is None:  # no spans, or a statement that does not parse alone: the whole texts
        before, after = _uses(data), _uses(_restored(plan, render.code(changed)))
        unused = {name for name, count in before.items() if count and after[name] <= 0}
    if not unused:
        return _restored(plan, render.code(changed))
    # An import the rewrite left unused is at module level, in a module-level block (``if TYPE_CHECKING:``,
    # ``try:``) or in a statement the rewrite changed, and its old text says ``import``: only those are walked.
    prune = _Prune(unused, plan.module, plan.package, modules)
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
    for statement in changed.body:  # in order: each import kept tells what the ones below may drop
        visited = statement.visit(prune) if may_import(statement) else statement
        if isinstance(visited, cst.BaseStatement):
            prune.note(visited)
            pruned.append(visited)
    return _restored(plan, render.code(changed.with_changes(body=pruned)))
