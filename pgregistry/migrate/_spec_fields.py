"""Modules built from a spec: ``submodules.linear_proj(...)`` passes the collection when every class
the tree may put in that field takes it.

Megatron-Core builds a layer's parts from a ``ModuleSpec``: ``Attention.__init__`` calls
``submodules.linear_proj(..., tp_group=self.pg_collection.tp)``, where ``submodules`` is a
``SelfAttentionSubmodules`` the layer specs filled (``linear_proj=RowParallelLinear``,
``linear_proj=backend.row_parallel_linear()``, ``ModuleSpec(module=TERowParallelLinear, ...)``). No
by-name rule resolves such a call, so a class whose ``__init__`` the tool threaded
(``RowParallelLinear``: its ``gtp_remat`` read) falls back whenever it is built that way, even under
a caller holding a collection. Megatron-LM's authors made the same change by hand later
(``pg_collection=self.pg_collection`` in ``Attention.__init__``, every class of the field taking the
keyword).

The rule, decided once over the whole tree: a call ``<...>submodules.X(...)`` or
``build_module(<...>submodules.X, ...)`` in a module-level function or method is passed the keyword
when the tree may put a class the tool threads in that field (else there is nothing to gain) and
every value it may put there is shown to take the keyword after the rewrite: one the tool threads
(its own ``__init__``, or one it inherits unchanged), whose reads then fall back field by field when
the collection lacks one. A class that takes the keyword already is not enough: it gives the keyword
a meaning of its own (Megatron-Core's ``Attention`` asserts the fields it needs), so the collection
in the caller's scope, often one its shim built for other fields, may fail there where ``None``
built its own.

The values are found by the field's name: keywords ``X=`` (of a call of a class holding the field:
that class's; of any other call: every class's), assignments ``<...>.X =``, a dataclass field's
default; followed through ``not_none(C)``, ``a if c else b``, a local the function assigns,
``ModuleSpec(module=C, params={...})`` (params that cannot set the keyword) and a backend's method
``obj.m()`` (every ``def m`` of the tree returning a class). The classes holding the field are those
the call's ``submodules`` parameter is annotated with, and their subclasses (``MLP``'s
``MLPSubmodules``, not ``GroupedMLPSubmodules``); every class declaring it when there is no such
annotation. Anything else (a parameter, a ``partial``, a class outside the tree, a submodules class
built positionally or from ``**``) leaves the call as it is, with the reason in the report. A class
a user's own spec names from outside the tree is not seen: see docs/migrating.md, "Modules built
from a spec".

A call of a local assigned classes (``GPTModel.__init__``'s ``output_layer_cls(...)``, the local
holding ``TELMHeadColumnParallelLinear`` or ``ColumnParallelLinear``) is decided the same way, its
values read as a field's are: the local must be bound in its function by plain assignments only (no
loop, ``with``, unpacking, walrus, import, ``global``: :func:`_only_assigned`), so those assignments
are every value it may hold.

The calls of a spec's field, and each class's parameters and first base, are read from the files'
facts (:mod:`._facts`); the values put in a field with :mod:`ast`, from the files that mention its
name (or assign a threaded class's).
Pure: no I/O.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from pgregistry._source.scanner import attribute_chain
from pgregistry.migrate._facts import (
    FileFacts,
    Key,
    SpecCall,
    TreeIndex,
    functions_by_qualname,
    resolve_dotted_name,
)

__all__ = ["SpecFields", "SpecCallLeft", "decide_spec_fields"]


@dataclass(frozen=True)
class SpecCallLeft:
    """A call of a spec's field left without the collection: where it is, the field, and why.

    With ``local``, a call of a local assigned classes, and the field is the local's name."""

    path: str
    line: int
    field: str
    reason: str
    local: bool = False


@dataclass(frozen=True)
class SpecFields:
    """What the rule decided: the calls that pass the collection, and the calls left.

    ``passed``: (module, function, field) -> keyword; ``left``: the calls of a field that may hold a
    threaded class but not only classes shown to take the keyword."""

    passed: Mapping[tuple[str, str, str], str] = field(default_factory=dict)
    left: tuple[SpecCallLeft, ...] = ()
    #: The calls of a local assigned classes that pass the collection ((module, function, local) ->
    #: keyword).
    local_classes: Mapping[tuple[str, str, str], str] = field(default_factory=dict)


@dataclass
class _Module:
    """One file of the tree the rule walks: its facts and its syntax."""

    facts: FileFacts
    tree: ast.Module

    @property
    def path(self) -> str:
        return self.facts.path

    @property
    def name(self) -> str:
        return self.facts.module


class _Tree:
    """The tree's files, parsed on demand, and the facts the rule reads from them.

    ``contents``: path -> bytes; ``index``: their facts."""

    def __init__(self, contents: Mapping[str, bytes], index: TreeIndex, keyword: str) -> None:
        self.contents = contents
        self.index = index
        self.keyword = keyword
        self.parsed: dict[str, _Module] = {}
        #: What each method name's ``def``s return (:func:`_method_returns`).
        self.returns: dict[str, _Values] = {}

    def module(self, facts: FileFacts) -> _Module:
        if facts.path not in self.parsed:
            self.parsed[facts.path] = _Module(facts, ast.parse(self.contents[facts.path]))
        return self.parsed[facts.path]

    def mentioning(self, pattern: re.Pattern[bytes]) -> Iterator[_Module]:
        for path, facts in self.index.files.items():
            if pattern.search(self.contents[path]):
                yield self.module(facts)

    def resolve(self, dotted: list[str], where: _Module) -> Key | None:
        """(module, name) ``dotted`` names in ``where``: a module-level definition or an import."""
        return resolve_dotted_name(dotted, where.name, where.facts.bound, where.facts.defined)

    def takes_keyword(self, key: Key, threaded: Mapping[Key, str]) -> str | None:
        """None when calling ``key`` with the keyword is shown to keep behaviour, else why not.

        Behaviour after the rewrite: the tool threads it, and its reads fall back field by field."""
        if threaded.get(key) == self.keyword:
            return None
        label = ".".join(key)
        if self.index.definition(key) is None:
            return f"{label} is not in the tree"
        if self._declares_keyword(key, threaded):
            return (
                f"{label} takes {self.keyword} already, with a meaning of its own (given a "
                "collection without the fields it reads, it may fail where it built its own)"
            )
        return f"{label} has no parameter {self.keyword}"

    def _declares_keyword(self, key: Key, threaded: Mapping[Key, str], depth: int = 0) -> bool:
        """Whether ``key``'s ``__init__`` or ``def`` has the keyword as a parameter a call can name.

        Its ``__init__``: its own or the one it inherits in the tree."""
        found = self.index.definition(key)
        if found is None or depth > 8:
            return False
        top, where = found
        if top.is_class and top.parameters is None:
            inherited = (
                resolve_dotted_name(top.first_base, where.module, where.bound, where.defined)
                if top.first_base is not None
                else None
            )
            return inherited is not None and self._declares_keyword(inherited, threaded, depth + 1)
        return self.keyword in (top.parameters or ())


@dataclass
class _Values:
    """What the tree puts in one field: the classes, and why a value may not be one.

    ``classes``: each class with where it is put; ``unknown``: the first reason a value is not a
    class the rule can name."""

    classes: dict[Key, str] = field(default_factory=dict)
    unknown: str = ""


class _Locals:
    """The names a scope assigns, with their values, read when first asked (most scopes never are).

    The scope is a function, or a module's top level."""

    def __init__(self, scope: ast.AST) -> None:
        self.scope = scope
        self.assigned: dict[str, list[ast.expr]] | None = None

    def get(self, name: str) -> list[ast.expr]:
        if self.assigned is None:
            self.assigned = _name_assignments(self.scope)
        return self.assigned.get(name, [])


def _name_assignments(scope: ast.AST) -> dict[str, list[ast.expr]]:
    """The plain names ``scope`` (a function, or a module's top level) assigns, with their values.

    A function's nested functions' too: more values only make the rule more careful."""
    found: dict[str, list[ast.expr]] = {}
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(scope, ast.Module) and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        stack += ast.iter_child_nodes(node)
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = scope.args
        for parameter in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            found.pop(parameter.arg, None)  # its callers' values are not known here
    return found


def _walk_with_locals(module: ast.Module) -> Iterator[tuple[ast.AST, _Locals]]:
    """Every node of ``module`` with the names its innermost function (or the module) assigns."""
    stack: list[tuple[ast.AST, _Locals]] = [(module, _Locals(module))]
    while stack:
        node, names = stack.pop()
        yield node, names
        for child in ast.iter_child_nodes(node):
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            stack.append((child, _Locals(child) if inner else names))


def _field_values(
    tree: _Tree,
    value: ast.expr,
    where: _Module,
    found: _Values,
    depth: int = 0,
    names: _Locals | None = None,
) -> None:
    """Add the classes ``value`` may be to ``found``.

    ``where``: the module ``value`` is in; ``names``: what its scope assigns."""
    spot = f"{where.path}:{value.lineno}"
    if isinstance(value, ast.Constant) and value.value is None:
        return
    if isinstance(value, ast.IfExp):
        _field_values(tree, value.body, where, found, depth, names)
        _field_values(tree, value.orelse, where, found, depth, names)
        return
    if isinstance(value, ast.Call):
        callee = attribute_chain(value.func) or []
        if callee[-1:] == ["not_none"] and len(value.args) == 1 and not value.keywords:
            _field_values(tree, value.args[0], where, found, depth, names)
            return
        if callee[-1:] == ["ModuleSpec"]:
            _module_spec_values(tree, value, where, found, depth)
            return
        if (
            isinstance(value.func, ast.Attribute)
            and not value.args
            and not value.keywords
            and depth < 4
        ):
            _method_returns(tree, value.func.attr, spot, found, depth)
            return
    dotted = attribute_chain(value)
    key = tree.resolve(dotted, where) if dotted is not None else None
    assigned = names.get(value.id) if names is not None and isinstance(value, ast.Name) else []
    if key is None and assigned and depth < 4:
        for local in assigned:  # a local the scope assigns a class to
            _field_values(tree, local, where, found, depth + 1, names)
        return
    if key is None:
        found.unknown = found.unknown or f"a value that names no class of the tree ({spot})"
    else:
        found.classes.setdefault(key, spot)


def _module_spec_values(
    tree: _Tree, spec: ast.Call, where: _Module, found: _Values, depth: int
) -> None:
    """The class of ``ModuleSpec(module=C, params={...}, ...)``, whose params lack the keyword.

    Its params must be a literal dict without the keyword: ``build_module`` passes both, and a
    duplicate keyword is a TypeError."""
    spot = f"{where.path}:{spec.lineno}"
    arguments = {k.arg: k.value for k in spec.keywords}
    module = spec.args[0] if spec.args else arguments.get("module")
    params = spec.args[1] if len(spec.args) > 1 else arguments.get("params")
    if module is None or None in arguments:
        found.unknown = found.unknown or f"a ModuleSpec whose module is not named ({spot})"
        return
    if params is not None and not (
        isinstance(params, ast.Dict)
        and all(isinstance(k, ast.Constant) and k.value != tree.keyword for k in params.keys)
    ):
        found.unknown = (
            found.unknown or f"a ModuleSpec whose params may set {tree.keyword} ({spot})"
        )
        return
    _field_values(tree, module, where, found, depth)


def _method_returns(tree: _Tree, method: str, spot: str, found: _Values, depth: int) -> None:
    """Add the classes every ``def method`` of the tree returns to ``found``.

    Such as a backend's ``row_parallel_linear()``; read once per method name."""
    returns = tree.returns.get(method)
    if returns is None:
        returns = tree.returns[method] = _Values()
        _read_method_returns(tree, method, returns, depth)
    found.unknown = found.unknown or (f"{returns.unknown} ({spot})" if returns.unknown else "")
    for key, where in returns.classes.items():
        found.classes.setdefault(key, where)


def _read_method_returns(tree: _Tree, method: str, found: _Values, depth: int) -> None:
    returned = False
    for facts in tree.index.defining(method):
        module = tree.module(facts)
        for node in ast.walk(module.tree):
            if not (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method
            ):
                continue
            values = [r.value for r in ast.walk(node) if isinstance(r, ast.Return)]
            if not values and _is_abstract_body(node):
                continue  # an abstract method: its overrides are the tree's other defs
            for value in values:
                returned = True
                if value is None:
                    found.unknown = found.unknown or f"{method}() returns nothing"
                else:
                    _field_values(tree, value, module, found, depth + 1, _Locals(node))
    if not returned:
        found.unknown = found.unknown or f"no def {method} of the tree returns a class"


def _is_abstract_body(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``node``'s body is only a docstring, ``...`` or ``pass`` (an abstract method's)."""
    return all(
        isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
        for s in node.body
    )


#: A field's values by the class that holds it: (submodules class name, field); None: a value put in
#: the field of an object whose class is not known (``dataclasses.replace(s, X=...)``, ``s.X =
#: ...``).
Slot = tuple[str | None, str]


@dataclass
class _FieldsOfTree:
    """What the tree puts in the fields asked about, by slot, and the classes holding each field.

    ``holders``: the submodules classes holding each field (those declaring it and their subclasses,
    by name)."""

    values: dict[Slot, _Values] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)
    #: Class name -> its bases' last names.
    bases: dict[str, set[str]] = field(default_factory=dict)

    def of_call(self, call: SpecCall) -> _Values:
        """Every value the field of ``call`` may hold, from the classes that may hold it.

        Of the classes its ``submodules`` is annotated with, their subclasses (an instance of one
        may be given) and bases (whose defaults they inherit), when one holds the field, else of
        every class holding it; and the unknown owners'."""
        holders = self.holders.get(call.field, set())
        owners = holders & call.annotated
        related: set[str] = {""}
        while related:
            related = {
                cls
                for cls in holders - owners
                if self.bases.get(cls, set()) & owners
                or any(cls in self.bases.get(owner, set()) for owner in owners)
            }
            owners |= related
        owners = owners or holders
        merged = _Values()
        for owner in [None, *sorted(owners)]:
            part = self.values.get((owner, call.field), _Values())
            merged.unknown = merged.unknown or part.unknown
            for key, spot in part.classes.items():
                merged.classes.setdefault(key, spot)
        return merged


def _values_of_fields(tree: _Tree, names: set[str]) -> _FieldsOfTree:
    """What the tree puts in each field of ``names``: keywords, assignments, dataclass defaults.

    Keywords ``X=`` (of a call of a class holding the field: its slot; of any other call: the
    unknown owner's), assignments ``<...>.X =`` (not ``self.X =``: the part a module built from the
    field), dataclass defaults ``X: T = v``."""
    found = _FieldsOfTree()
    if not names:
        return found
    alternatives = b"|".join(re.escape(n.encode()) for n in sorted(names))
    # Where a field is declared (``X: T``), given (``X=``) or assigned (``<...>.X =``, a local ``X
    # =``).
    modules = list(tree.mentioning(re.compile(rb"\b(?:" + alternatives + rb")[ \t]*(?::|=(?!=))")))
    declared: dict[str, set[str]] = {}  # class name -> the fields of ``names`` it declares
    bases = found.bases
    #: The calls and assignments that may put a value in a field, with their module and scope (one
    #: walk).
    puts: list[tuple[ast.Call | ast.Assign | ast.AnnAssign, _Module, _Locals]] = []
    for module in modules:
        for node, assigned in _walk_with_locals(module.tree):
            if isinstance(node, ast.Call) and any(k.arg in names for k in node.keywords):
                puts.append((node, module, assigned))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                puts.append((node, module, assigned))
            elif isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    (attribute_chain(b) or [""])[-1] for b in node.bases
                )
                for member in node.body:
                    if (
                        isinstance(member, ast.AnnAssign)
                        and isinstance(member.target, ast.Name)
                        and member.target.id in names
                    ):
                        declared.setdefault(node.name, set()).add(member.target.id)
                        if member.value is not None:
                            slot = (node.name, member.target.id)
                            values = found.values.setdefault(slot, _Values())
                            _field_values(tree, member.value, module, values)
    holding = {cls: set(fields) for cls, fields in declared.items()}
    changed = True
    while changed:  # a subclass holds its bases' fields
        changed = False
        for cls, parents in bases.items():
            inherited = set().union(*(holding.get(p, set()) for p in parents)) - holding.get(
                cls, set()
            )
            if inherited:
                holding.setdefault(cls, set()).update(inherited)
                changed = True
    for cls, fields in holding.items():
        for name in fields:
            found.holders.setdefault(name, set()).add(cls)

    def slot_values(owner: str | None, name: str) -> _Values:
        return found.values.setdefault((owner if owner in holding else None, name), _Values())

    for node, module, assigned in puts:
        if isinstance(node, ast.Call):
            callee = (attribute_chain(node.func) or [""])[-1]
            for keyword in node.keywords:
                if keyword.arg in names:
                    values = slot_values(callee, keyword.arg)
                    _field_values(tree, keyword.value, module, values, names=assigned)
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr in names
                and node.value
                and attribute_chain(target.value) != ["self"]  # a module's own part, built here
            ):
                values = slot_values(None, target.attr)
                _field_values(tree, node.value, module, values, names=assigned)
    return found


def _mark_built_positionally(tree: _Tree, found: _FieldsOfTree, names: set[str]) -> None:
    """Make unknown the fields of ``names`` of each holder built positionally or from ``**``.

    A holder: a class holding one of them, which the tree builds so. Which value lands in which
    field is not read."""
    holding: dict[str, set[str]] = {}
    for name in names:
        for cls in found.holders.get(name, ()):
            holding.setdefault(cls, set()).add(name)
    if not holding:
        return
    builds = re.compile(
        rb"\b(?:" + b"|".join(re.escape(c.encode()) for c in sorted(holding)) + rb")\("
    )
    for module in tree.mentioning(builds):
        for built in ast.walk(module.tree):
            made = attribute_chain(built.func) if isinstance(built, ast.Call) else None
            if not made or made[-1] not in holding:
                continue
            assert isinstance(built, ast.Call)
            if built.args or any(k.arg is None for k in built.keywords):
                for name in holding[made[-1]]:
                    values = found.values.setdefault((made[-1], name), _Values())
                    values.unknown = values.unknown or (
                        f"{made[-1]} built positionally or from ** ({module.path}:{built.lineno})"
                    )


def decide_spec_fields(
    index: TreeIndex,
    contents: Mapping[str, bytes],
    threaded_classes: Mapping[Key, str],
    keyword: str,
    classes: Collection[Key] = (),
) -> SpecFields:
    """Which calls of a spec's field, and of a local assigned classes, in the tree pass ``keyword``.

    ``index``: the tree's files' facts; ``contents``: path -> bytes. ``threaded_classes``: the
    functions and classes that take it after the rewrite ((module, name) -> keyword, subclasses
    inheriting it and names packages re-export included); ``classes``: those of them that are
    classes (a local assigned one of them is looked for)."""
    tree = _Tree(contents, index, keyword)
    calls = [call for facts in index.files.values() for call in facts.spec_calls]
    # A field some class declares (``linear_proj: LinearProjBuilder``), not ``submodules.append``.
    if calls:
        found = {word for facts in index.files.values() for word in facts.declared_words}
        calls = [call for call in calls if call.field.encode() in found]
    fields = _values_of_fields(tree, {call.field for call in calls})
    # Only the fields that may hold a threaded class matter: the others are passed nothing either
    # way.
    relevant = {
        name
        for (_, name), values in fields.values.items()
        if any(threaded_classes.get(key) == keyword for key in values.classes)
    }
    _mark_built_positionally(tree, fields, relevant)
    passed: dict[tuple[str, str, str], str] = {}
    left: list[SpecCallLeft] = []
    for call in calls:
        values = fields.of_call(call)
        if not any(threaded_classes.get(key) == keyword for key in values.classes):
            continue  # no class of the field reads through the keyword: nothing to pass
        reason = _refusal_reason(tree, values, threaded_classes)
        if not reason:
            passed[(call.module, call.function, call.field)] = keyword
            continue
        message = (
            f"a module built from a spec's field {call.field}: not "
            f"every class there is shown to take {keyword}: {reason}"
        )
        left.append(SpecCallLeft(call.path, call.line, call.field, message))
    local_classes: dict[tuple[str, str, str], str] = {}
    for call, values in _local_class_calls(tree, classes, threaded_classes):
        reason = _refusal_reason(tree, values, threaded_classes)
        if not reason:
            local_classes[(call.module, call.function, call.field)] = keyword
            continue
        message = (
            f"a call of a local assigned classes, {call.field}: not every "
            f"class it may hold is shown to take {keyword}: {reason}"
        )
        left.append(SpecCallLeft(call.path, call.line, call.field, message, local=True))
    return SpecFields(passed, tuple(sorted(left, key=lambda c: (c.path, c.line))), local_classes)


def _refusal_reason(tree: _Tree, values: _Values, threaded: Mapping[Key, str]) -> str:
    """Why a call of ``values`` may not pass the keyword; empty when it may.

    A value that names no class of the tree, or the first class not shown to take it."""
    if values.unknown:
        return values.unknown
    refusals = [
        f"{why} ({spot})"
        for key, spot in sorted(values.classes.items())
        for why in [tree.takes_keyword(key, threaded)]
        if why is not None
    ]
    return refusals[0] if refusals else ""


def _only_assigned(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names ``function`` binds only by plain assignments (``x = ...``, ``x: T = ...``).

    No loop, ``with``, unpacking, walrus, ``del``, ``except ... as``, import, nested definition,
    ``global`` or ``nonlocal``, so the assignments' values are every value the name may hold."""
    plain: dict[str, int] = {}
    stored: dict[str, int] = {}
    other: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    plain[target.id] = plain.get(target.id, 0) + 1
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stored[node.id] = stored.get(node.id, 0) + 1
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            other.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif node is not function and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            other.add(node.name)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            other.add(node.name)
    return {name for name, count in plain.items() if stored.get(name) == count} - other


def _local_class_calls(
    tree: _Tree, classes: Collection[Key], threaded: Mapping[Key, str]
) -> Iterator[tuple[SpecCall, _Values]]:
    """The calls of a plainly assigned local that may hold a threaded class, with its values.

    The calls ``name(...)`` (passing neither the keyword nor ``**``) of a local ``name`` that a
    module-level function or method assigns only plainly (:func:`_only_assigned`), some value of
    which is one of ``classes`` that takes the keyword (``threaded``), with every value it may hold
    (:func:`_field_values`). Read in the files that assign one of those classes' names (``x = C``,
    ``x = (C if ... else ...)``)."""
    names = sorted({key[1] for key in classes if threaded.get(key) == tree.keyword})
    if not names:
        return
    assigning = re.compile(
        rb"=\s*\(?\s*(?:not_none\(\s*)?[\w.]*\b(?:"
        + b"|".join(re.escape(n.encode()) for n in names)
        + rb")\b"
    )
    for module in tree.mentioning(assigning):
        for qualname, function in functions_by_qualname(module.tree):
            assigned = _Locals(function)
            plain: set[str] | None = None
            stack: list[ast.AST] = list(function.body)
            while stack:  # the function's own calls, not its nested functions' or lambdas'
                node = stack.pop()
                if isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
                ):
                    continue
                stack += ast.iter_child_nodes(node)
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and assigned.get(node.func.id)
                    and all(k.arg not in (None, tree.keyword) for k in node.keywords)
                ):
                    continue
                plain = _only_assigned(function) if plain is None else plain
                if node.func.id not in plain:
                    continue
                values = _Values()
                for value in assigned.get(node.func.id):
                    _field_values(tree, value, module, values, names=assigned)
                if any(threaded.get(key) == tree.keyword for key in values.classes):
                    call = SpecCall(
                        module.path, node.lineno, module.name, qualname, node.func.id, frozenset()
                    )
                    yield call, values
