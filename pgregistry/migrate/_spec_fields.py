"""Modules built from a spec: ``submodules.linear_proj(...)`` passes the collection when every class the tree may
put in that field takes it.

Megatron-Core builds a layer's parts from a ``ModuleSpec``: ``Attention.__init__`` calls
``submodules.linear_proj(..., tp_group=self.pg_collection.tp)``, where ``submodules`` is a
``SelfAttentionSubmodules`` the layer specs filled (``linear_proj=RowParallelLinear``,
``linear_proj=backend.row_parallel_linear()``, ``ModuleSpec(module=TERowParallelLinear, ...)``). No by-name rule
resolves such a call, so a class whose ``__init__`` the tool threaded (``RowParallelLinear``: its ``gtp_remat``
read) falls back whenever it is built that way, even under a caller holding a collection. Megatron-LM's authors
made the same change by hand later (``pg_collection=self.pg_collection`` in ``Attention.__init__``, every class
of the field taking the keyword).

The rule, decided once over the whole tree: a field ``X`` of a call ``<...>submodules.X(...)`` or
``build_module(<...>submodules.X, ...)`` is passed the keyword when the tree puts at least one class the tool
threads in it (else there is nothing to gain) and every value the tree puts in it is shown to take the keyword
after the rewrite: one the tool threads (its own ``__init__``, or one it inherits unchanged), whose reads then
fall back field by field when the collection lacks one. A class that takes the keyword already is not enough: it
gives the keyword a meaning of its own (Megatron-Core's ``Attention`` asserts the fields it needs), so the
collection in the caller's scope, often one its shim built for other fields, may fail there where ``None`` built
its own. The values are found by the field's name anywhere in the tree (a keyword
``X=``, an assignment ``<...>.X =``, a dataclass field's default), through ``not_none(C)``, ``a if c else b``,
``ModuleSpec(module=C, params={...})`` (params that cannot set the keyword) and a backend's method
``obj.m()`` (every ``def m`` of the tree returning a class). Anything else (a parameter, a ``partial``, a
class outside the tree, a submodules dataclass built positionally or from ``**``) leaves the field's calls as they
are, with the reason in the report. A class a user's own spec names from outside the tree is not seen: see
docs/migrating.md, "Modules built from a spec".

Read with :mod:`ast` from the files that mention a field's name. Pure: no I/O.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pgregistry._source.scanner import module_name
from pgregistry.migrate._upward import import_bindings

__all__ = ["SpecFields", "SpecCallLeft", "decide_spec_fields", "spec_field_of_call"]

#: (module, name) of a class or function.
Key = tuple[str, str]
#: A call of a spec's field: ``submodules.X(`` or ``build_module(<...>submodules.X``.
_SPEC_CALL = re.compile(rb"\bsubmodules\.([A-Za-z_]\w*)\s*[(,)]")


@dataclass(frozen=True)
class SpecCallLeft:
    """A call of a spec's field left without the collection: where it is, the field, and why."""

    path: str
    line: int
    field: str
    reason: str


@dataclass(frozen=True)
class SpecFields:
    """What the rule decided: the fields whose calls pass the collection (field -> keyword), and the calls left
    (a field that holds a threaded class but not only classes shown to take the keyword)."""

    passed: Mapping[str, str] = field(default_factory=dict)
    left: tuple[SpecCallLeft, ...] = ()


def spec_field_of_call(func: list[str], first_argument: list[str] | None) -> str | None:
    """The spec field a call builds: ``X`` of ``<...>.submodules.X(...)`` (``func``: the callee's dotted parts)
    or of ``build_module(<...>.submodules.X, ...)`` (``first_argument``: its first argument's parts); None when
    it is neither."""
    if len(func) >= 2 and func[-2] == "submodules":
        return func[-1]
    if func[-1:] == ["build_module"] and first_argument and first_argument[-2:-1] == ["submodules"]:
        return first_argument[-1]
    return None


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *parts[::-1]] if isinstance(node, ast.Name) else None


@dataclass
class _Module:
    """One parsed file of the tree: its module name, syntax, import bindings and module-level definitions."""

    path: str
    name: str
    tree: ast.Module
    bound: dict[str, str]
    defined: Mapping[str, ast.stmt]


class _Tree:
    """The tree's files, parsed on demand, and the facts the rule reads from them."""

    def __init__(self, contents: Mapping[str, bytes], keyword: str) -> None:
        self.contents = contents
        self.keyword = keyword
        self.paths = {".".join(module_name(path)): path for path in contents}
        self.parsed: dict[str, _Module | None] = {}

    def module(self, path: str) -> _Module | None:
        if path not in self.parsed:
            try:
                tree = ast.parse(self.contents[path])
            except (SyntaxError, ValueError):  # the scan refused the run already
                self.parsed[path] = None
                return None
            defined = {
                n.name: n
                for n in tree.body
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            }
            self.parsed[path] = _Module(
                path,
                ".".join(module_name(path)),
                tree,
                import_bindings(tree, path.split("/")[:-1]),
                defined,
            )
        return self.parsed[path]

    def mentioning(self, pattern: re.Pattern[bytes]) -> Iterator[_Module]:
        for path, data in self.contents.items():
            if pattern.search(data):
                found = self.module(path)
                if found is not None:
                    yield found

    def resolve(self, dotted: list[str], where: _Module) -> Key | None:
        """(module, name) ``dotted`` names in ``where``: a module-level definition or an import."""
        if len(dotted) == 1 and dotted[0] in where.defined:
            return where.name, dotted[0]
        head = where.bound.get(dotted[0])
        if head is None:
            return None
        qualified = ".".join([head.replace(":", "."), *dotted[1:]])
        owner, _, name = qualified.rpartition(".")
        return (owner, name) if owner else None

    def definition(self, key: Key, depth: int = 0) -> tuple[ast.stmt, _Module] | None:
        """The ``class`` or ``def`` ``key`` is, followed through the imports of packages that re-export it; None
        when the tree does not hold it."""
        path = self.paths.get(key[0])
        found = self.module(path) if path is not None else None
        if found is None or depth > 8:
            return None
        node = found.defined.get(key[1])
        if node is not None:
            return node, found
        imported = found.bound.get(key[1], "")
        if ":" not in imported:
            return None
        module, _, name = imported.partition(":")
        return self.definition((module, name), depth + 1)

    def takes_keyword(self, key: Key, threaded: Mapping[Key, str]) -> str | None:
        """None when calling ``key`` with the keyword is shown to keep behaviour after the rewrite (the tool
        threads it: its reads fall back field by field), else why not."""
        if threaded.get(key) == self.keyword:
            return None
        label = ".".join(key)
        if self.definition(key) is None:
            return f"{label} is not in the tree"
        if self._declares_keyword(key, threaded):
            return (
                f"{label} takes {self.keyword} already, with a meaning of its own (given a collection"
                " without the fields it reads, it may fail where it built its own)"
            )
        return f"{label} does not take {self.keyword}"

    def _declares_keyword(self, key: Key, threaded: Mapping[Key, str], depth: int = 0) -> bool:
        """Whether ``key``'s ``__init__`` (its own or the one it inherits in the tree) or ``def`` has the
        keyword as a parameter a call can name."""
        found = self.definition(key)
        if found is None or depth > 8:
            return False
        node, where = found
        if isinstance(node, ast.ClassDef):
            init = next(
                (
                    m
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and m.name == "__init__"
                ),
                None,
            )
            if init is None:
                base = _dotted(node.bases[0]) if node.bases else None
                inherited = self.resolve(base, where) if base is not None else None
                return inherited is not None and self._declares_keyword(
                    inherited, threaded, depth + 1
                )
            node = init
        return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            a.arg == self.keyword for a in (*node.args.args, *node.args.kwonlyargs)
        )


@dataclass
class _Values:
    """What the tree puts in one field: the classes (with where each is put) and the first reason a value is not
    a class the rule can name."""

    classes: dict[Key, str] = field(default_factory=dict)
    unknown: str = ""


def _field_values(
    tree: _Tree, value: ast.expr, where: _Module, found: _Values, depth: int = 0
) -> None:
    """Add the classes ``value`` (in ``where``) may be to ``found``."""
    spot = f"{where.path}:{value.lineno}"
    if isinstance(value, ast.Constant) and value.value is None:
        return
    if isinstance(value, ast.IfExp):
        _field_values(tree, value.body, where, found, depth)
        _field_values(tree, value.orelse, where, found, depth)
        return
    if isinstance(value, ast.Call):
        callee = _dotted(value.func) or []
        if callee[-1:] == ["not_none"] and len(value.args) == 1 and not value.keywords:
            _field_values(tree, value.args[0], where, found, depth)
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
    dotted = _dotted(value)
    key = tree.resolve(dotted, where) if dotted is not None else None
    if key is None:
        found.unknown = found.unknown or f"a value that names no class of the tree ({spot})"
    else:
        found.classes.setdefault(key, spot)


def _module_spec_values(
    tree: _Tree, spec: ast.Call, where: _Module, found: _Values, depth: int
) -> None:
    """The class of ``ModuleSpec(module=C, params={...}, ...)``: its params must be a literal dict without the
    keyword (``build_module`` passes both: a duplicate keyword is a TypeError)."""
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
    """The classes every ``def method`` of the tree returns (a backend's ``row_parallel_linear()``)."""
    defining = re.compile(rb"\bdef[ \t]+" + re.escape(method.encode()) + rb"\b")
    returned = False
    for module in tree.mentioning(defining):
        for node in ast.walk(module.tree):
            if not (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method
            ):
                continue
            values = [r.value for r in ast.walk(node) if isinstance(r, ast.Return)]
            if not values and _abstract(node):
                continue  # an abstract method: its overrides are the tree's other defs
            for value in values:
                returned = True
                if value is None:
                    found.unknown = found.unknown or f"{method}() returns nothing ({spot})"
                else:
                    _field_values(tree, value, module, found, depth + 1)
    if not returned:
        found.unknown = found.unknown or f"no def {method} of the tree returns a class ({spot})"


def _abstract(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``node``'s body is only a docstring, ``...`` or ``pass`` (an abstract method's)."""
    return all(
        isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
        for s in node.body
    )


def _spec_calls(tree: _Tree) -> dict[str, list[tuple[str, int]]]:
    """Each field some function of the tree builds from a spec -> where ((path, line) of each call that passes
    neither the keyword nor ``**``)."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for module in tree.mentioning(_SPEC_CALL):
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            first = _dotted(node.args[0]) if node.args else None
            name = spec_field_of_call(_dotted(node.func) or [""], first)
            if name is not None and not any(k.arg in (None, tree.keyword) for k in node.keywords):
                calls.setdefault(name, []).append((module.path, node.lineno))
    return calls


def _values_of_fields(tree: _Tree, names: set[str]) -> dict[str, _Values]:
    """What the tree puts in each field of ``names``: keywords ``X=``, assignments ``<...>.X =`` (not
    ``self.X =``: the part a module built from the field), dataclass
    defaults ``X: T = v``; a submodules class (one declaring a field of ``names``) built positionally or from
    ``**`` makes its fields unknown."""
    values = {name: _Values() for name in names}
    if not names:
        return values
    alternatives = b"|".join(re.escape(n.encode()) for n in sorted(names))
    mention = re.compile(rb"\b(?:" + alternatives + rb")\b")
    declaring: dict[str, set[str]] = {}  # class name -> the fields of ``names`` it declares
    modules = list(tree.mentioning(mention))
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.keyword) and node.arg in names:
                _field_values(tree, node.value, module, values[node.arg])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and target.attr in names
                        and node.value
                        and _dotted(target.value) != ["self"]  # a module's own part, built here
                    ):
                        _field_values(tree, node.value, module, values[target.attr])
            elif isinstance(node, ast.ClassDef):
                for member in node.body:
                    if (
                        isinstance(member, ast.AnnAssign)
                        and isinstance(member.target, ast.Name)
                        and member.target.id in names
                    ):
                        declaring.setdefault(node.name, set()).add(member.target.id)
                        if member.value is not None:
                            _field_values(tree, member.value, module, values[member.target.id])
    if declaring:
        builds = re.compile(
            rb"\b(?:" + b"|".join(re.escape(c.encode()) for c in declaring) + rb")\("
        )
        for module in tree.mentioning(builds):
            for node in ast.walk(module.tree):
                callee = _dotted(node.func) if isinstance(node, ast.Call) else None
                if not callee or callee[-1] not in declaring:
                    continue
                assert isinstance(node, ast.Call)
                if node.args or any(k.arg is None for k in node.keywords):
                    for name in declaring[callee[-1]]:
                        values[name].unknown = values[name].unknown or (
                            f"{callee[-1]} built positionally or from ** ({module.path}:{node.lineno})"
                        )
    return values


def decide_spec_fields(
    contents: Mapping[str, bytes], threaded_classes: Mapping[Key, str], keyword: str
) -> SpecFields:
    """Which spec fields of the tree ``contents`` (path -> bytes) pass ``keyword``. ``threaded_classes``: the
    classes whose ``__init__`` takes it after the rewrite ((module, class) -> keyword, subclasses inheriting it
    and names packages re-export included)."""
    tree = _Tree(contents, keyword)
    calls = _spec_calls(tree)
    passed: dict[str, str] = {}
    left: list[SpecCallLeft] = []
    for name, values in sorted(_values_of_fields(tree, set(calls)).items()):
        if not any(threaded_classes.get(key) == keyword for key in values.classes):
            continue  # no class of the field reads through the keyword: nothing to pass
        reason = values.unknown
        if not reason:
            refusals = [
                f"{why} ({spot})"
                for key, spot in sorted(values.classes.items())
                for why in [tree.takes_keyword(key, threaded_classes)]
                if why is not None
            ]
            reason = refusals[0] if refusals else ""
        if not reason:
            passed[name] = keyword
            continue
        message = (
            f"a module built from a spec's field {name}: not every class there is shown to take "
            f"{keyword}: {reason}"
        )
        left += [SpecCallLeft(path, line, name, message) for path, line in calls[name]]
    return SpecFields(passed, tuple(sorted(left, key=lambda c: (c.path, c.line))))
