"""What the rules decided between the two phases read of each file, read once where it is parsed.

Threading upward (:mod:`~pgregistry.migrate._upward`), the subclass rule
(:mod:`~pgregistry.migrate._inherited`) and the spec-field rule
(:mod:`~pgregistry.migrate._spec_fields`) decide over the whole tree, after every file is planned.
Each file's facts they read (its definitions with their calls, its classes with their first bases,
its import bindings, its calls of a spec's field, and the words its text calls, defines or puts on
a ``class`` line) are small picklable records (:func:`read_file_facts`), read by the first phase's
workers on every core from each file's :mod:`ast` tree (a file with reads: the one its planning
parses; the others, taken from a queue: parsed for this), so nothing is parsed between the phases,
where one core works and the other waits. The :class:`TreeIndex` over them is the one place a dotted
name is resolved through a module's own definitions and imports (:func:`resolve_dotted_name`).

The words are read with the regular expressions the rules searched each file for (a name called:
``name(``; defined: ``def name``; named on a ``class`` line; declared: ``name:`` at the start of an
indented line), so a rule passes over the same files as it did when it searched their text (a name
next to a non-ASCII letter aside: ``éf(`` is not a call of ``f``). Pure: no I/O.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from pgregistry._source.scanner import absolute_module, attribute_chain, module_name
from pgregistry.migrate._imports import import_bindings

__all__ = [
    "CallTarget",
    "DefinitionFacts",
    "FileFacts",
    "Key",
    "SpecCall",
    "TopLevel",
    "TreeIndex",
    "calls_within",
    "functions_by_qualname",
    "last_name",
    "read_file_facts",
    "resolve_dotted_name",
    "spec_field_of_call",
]

#: (module, name) of a module-level function or class, or (module, ``Class.method``).
Key = tuple[str, str]
#: What a call calls: ("f", module, name) for a module-level function as the file's imports resolve
#: it, ("m", "", name) for a method of some object.
CallTarget = tuple[str, str, str]

#: A call of one name: ``name(`` (a method's ``obj.name(`` too); the name is the whole word.
_CALLED = re.compile(rb"(?<![\w\x80-\xff])([A-Za-z_\x80-\xff][\w\x80-\xff]*)\s*\(")
#: A name after ``def`` anywhere in the text (a method's definitions are looked for where it is).
_DEF = re.compile(rb"def[ \t]+([A-Za-z_]\w*)")
#: What may stand before ``def`` on a ``def`` line.
_DEF_LINE_HEAD = re.compile(rb"[ \t]*(?:async[ \t]+)?")
#: The rest of a line from a ``class`` keyword on (the bases a subclass names).
_CLASS_LINE = re.compile(rb"\bclass\b([^\n]*)")
_WORD = re.compile(rb"\w+")
#: A name at the start of an indented line before a colon (a field a class declares).
_DECLARED = re.compile(rb"^[ \t]+([A-Za-z_]\w*)[ \t]*:", re.M)
#: A call of a spec's field: ``submodules.X(`` or ``build_module(<...>submodules.X``.
_SPEC_CALL = re.compile(rb"submodules\.([A-Za-z_]\w*)\s*[(,)]")  # a literal first: searched fast

#: A dotted name in the text (``a.b.c``, written without spaces around its dots).
_DOTTED = re.compile(rb"[A-Za-z_][\w.]*\.[\w.]*")

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def resolve_dotted_name(
    dotted: Sequence[str], module: str, bound: Mapping[str, str], local: Collection[str]
) -> Key | None:
    """(module, name) that ``dotted`` names in ``module``; None when neither way holds it.

    The name is one of the module's own ``local`` definitions, or found through its imports
    (``bound``: :func:`~pgregistry.migrate._imports.import_bindings`)."""
    if len(dotted) == 1 and dotted[0] in local:
        return module, dotted[0]
    head = bound.get(dotted[0])
    if head is None:
        return None
    qualified = ".".join([head.replace(":", "."), *dotted[1:]])
    owner, _, name = qualified.rpartition(".")
    return (owner, name) if owner else None


def spec_field_of_call(func: list[str], first_argument: list[str] | None) -> str | None:
    """The spec field a call builds: ``X`` of ``<...>.submodules.X``; None when it builds none.

    The call is either ``<...>.submodules.X(...)`` (``func``: the callee's dotted parts) or
    ``build_module(<...>.submodules.X, ...)`` (``first_argument``: its first argument's parts)."""
    if len(func) >= 2 and func[-2] == "submodules":
        return func[-1]
    if func[-1:] == ["build_module"] and first_argument and first_argument[-2:-1] == ["submodules"]:
        return first_argument[-1]
    return None


@dataclass(frozen=True)
class DefinitionFacts:
    """A module-level function or a method of a module-level class, as threading upward reads it.

    It holds its decorators' last names, whether its text (or its class's: ``holds``) names the
    keyword, and what it calls (a nested function's calls count for it)."""

    key: Key
    name: str
    method: bool
    decorators: tuple[str, ...]
    names_keyword: bool
    holds: bool
    calls: frozenset[CallTarget]
    #: Whether it (or a function nested in it) calls ``locals()``: a new parameter would show there.
    calls_locals: bool = False
    #: Whether it takes ``**kwargs``, where a caller's keyword of the collection's name goes.
    takes_keywords: bool = False


@dataclass(frozen=True)
class TopLevel:
    """A module-level ``def`` or ``class``: the parameters a call can name, and a class's base.

    The parameters of a class are its first own ``__init__``'s (None for a class without one). For a
    class: its first base's dotted name, and whether an instantiation runs that base's ``__init__``
    unchanged (``inherits``) or through an own ``__init__`` that only forwards to it (``forwards``:
    see :mod:`._inherited`)."""

    name: str
    is_class: bool
    parameters: tuple[str, ...] | None
    first_base: tuple[str, ...] | None = None
    inherits: bool = False
    forwards: bool = False
    #: Whether its own ``__init__`` takes ``**kwargs`` (a class).
    takes_keywords: bool = False


@dataclass(frozen=True)
class SpecCall:
    """A call of a spec's field: where, in which function, the field, and its annotated classes.

    The function is (module, qualified name); the classes are those its ``submodules`` is annotated
    with (empty: not known, any class declaring the field)."""

    path: str
    line: int
    module: str
    function: str
    field: str
    annotated: frozenset[str]


@dataclass(frozen=True)
class FileFacts:
    """One file's facts (see the module's docstring)."""

    path: str
    module: str
    bound: Mapping[str, str]
    #: Module-level definitions by name (the last of a name).
    defined: Mapping[str, TopLevel]
    #: Module-level functions' names.
    functions: frozenset[str]
    #: Module-level classes, in order (a name defined twice: both).
    classes: tuple[TopLevel, ...]
    #: Whether the module binds the keyword at its top level (an import, a function, an assignment).
    binds_keyword: bool
    definitions: tuple[DefinitionFacts, ...]
    spec_calls: tuple[SpecCall, ...]
    #: How often each name is defined on a ``def`` line.
    def_lines: Mapping[str, int]
    called: frozenset[bytes]
    def_words: frozenset[bytes]
    class_line_words: frozenset[bytes]
    declared_words: frozenset[bytes]
    #: Module-level ``def`` / ``class`` names bound more than once (:func:`names_bound_twice`).
    rebound: frozenset[str] = frozenset()
    #: The names of modules this file reaches, as ``module:name`` (``module:*`` for ``import *``):
    #: see :func:`names_reached`.
    reached: frozenset[str] = frozenset()


def _def_names(data: bytes) -> tuple[frozenset[bytes], dict[str, int]]:
    """The names after ``def`` in ``data``, and how often each is defined on a ``def`` line.

    A ``def`` line has any indentation; a line ends as Python's do. A search for the literal
    ``def``, the line's start found back to the previous match only (linear in the file however long
    its lines): a pattern anchored at every line start would be tried at every byte."""
    words: set[bytes] = set()
    lines: Counter[str] = Counter()
    line = searched = 0
    for found in _DEF.finditer(data):
        words.add(found.group(1))
        start = found.start()
        line = max(
            line, data.rfind(b"\n", searched, start) + 1, data.rfind(b"\r", searched, start) + 1
        )
        searched = start
        if _DEF_LINE_HEAD.fullmatch(data, line, start):
            lines[found.group(1).decode()] += 1
    return frozenset(words), dict(lines)


def calls_within(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node`` (itself included): :func:`ast.walk` for calls only, in another order.

    Two fifths faster on megatron/core, where it is most of the facts' time."""
    stack = [node]
    while stack:
        inner = stack.pop()
        if type(inner) is ast.Call:
            yield inner
        for name in inner._fields:
            value = getattr(inner, name, None)
            if type(value) is list:
                stack += [item for item in value if isinstance(item, ast.AST)]
            elif isinstance(value, ast.AST):
                stack.append(value)


def _reads_the_frame(call: ast.Call) -> bool:
    """Whether ``call`` returns its caller's locals: ``locals()``, ``vars()`` or ``dir()`` alone."""
    function = call.func
    return type(function) is ast.Name and (
        function.id == "locals"
        or function.id in ("vars", "dir")
        and not call.args
        and not call.keywords
    )


def _parameter_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in (*node.args.args, *node.args.kwonlyargs))


def last_name(node: ast.expr) -> str | None:
    """The last name of a dotted name, None for another form.

    ``nn.Module`` -> ``Module``; ``Generic[T]`` -> ``Generic``; ``builtins.Exception`` ->
    ``Exception``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _decorator_last_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    names = []
    for decorator in node.decorator_list:
        expression = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.append(
            expression.attr
            if isinstance(expression, ast.Attribute)
            else getattr(expression, "id", "")
        )
    return tuple(names)


def runs_the_base_init(node: ast.ClassDef) -> bool:
    """Whether instantiating ``node`` runs its first base's ``__init__`` with the call's arguments.

    As far as the class itself says: nothing of its own between the call and that ``__init__``."""
    own = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return bool(node.bases) and not (
        node.decorator_list or node.keywords or own & {"__init__", "__new__"}
    )


def forwards_to_the_base_init(node: ast.ClassDef, keyword: str) -> bool:
    """Whether ``node``'s own ``__init__`` can take ``keyword`` and pass it on to its base's.

    It passes it through ``super().__init__(...)``, its only way to its base's: see
    :mod:`._inherited`."""
    own = {m.name: m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = own.get("__init__")
    if (
        not node.bases
        or node.decorator_list
        or node.keywords
        or "__new__" in own
        or not isinstance(init, ast.FunctionDef)
        or init.decorator_list
    ):
        return False
    named = (
        getattr(n, "id", None) or getattr(n, "arg", None) or getattr(n, "attr", None)
        for n in ast.walk(init)
    )
    if any(isinstance(word, str) and keyword in word for word in named):
        return False
    calls = [n for n in ast.walk(init) if _calls_super_init(n, node.name)]
    nested = [
        n
        for scope in ast.walk(init)
        if scope is not init
        and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        for n in ast.walk(scope)
        if _calls_super_init(n, node.name)
    ]
    return (
        bool(calls)
        and not nested
        and all(k.arg is not None for c in calls if isinstance(c, ast.Call) for k in c.keywords)
    )


def _calls_super_init(node: ast.AST, cls: str) -> bool:
    """Whether ``node`` is ``super().__init__(...)`` or ``super(cls, self).__init__(...)``."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__init__"
        and isinstance(node.func.value, ast.Call)
        and getattr(node.func.value.func, "id", None) == "super"
    ):
        return False
    arguments = node.func.value.args
    return not arguments or getattr(arguments[0], "id", None) == cls


def _top_level(node: ast.stmt, keyword: str) -> TopLevel | None:
    if isinstance(node, _FUNCTIONS):
        return TopLevel(node.name, False, _parameter_names(node))
    if not isinstance(node, ast.ClassDef):
        return None
    init = next((m for m in node.body if isinstance(m, _FUNCTIONS) and m.name == "__init__"), None)
    base = attribute_chain(node.bases[0]) if node.bases else None
    return TopLevel(
        node.name,
        True,
        _parameter_names(init) if init is not None else None,
        tuple(base) if base is not None else None,
        runs_the_base_init(node),
        forwards_to_the_base_init(node, keyword),
        init is not None and init.args.kwarg is not None,
    )


def _call_target(
    call: ast.Call, module: str, functions: frozenset[str], bound: Mapping[str, str], keyword: str
) -> CallTarget | None:
    """What ``call`` calls: a module-level function or a method by name.

    The function is resolved through the file's imports; the method is never ``super().m(...)``: the
    base may be a class outside the tree."""
    if any(k.arg is None or k.arg == keyword for k in call.keywords):
        return None  # ``**kwargs`` or the keyword given: the caller passes nothing of its own
    func = call.func
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        dotted = [func.id, *parts[::-1]]
        found = resolve_dotted_name(dotted, module, bound, functions)
        if found is not None:
            return "f", *found
        return None if len(dotted) == 1 or dotted[0] in bound else ("m", "", dotted[-1])
    if parts and not (isinstance(func, ast.Call) and getattr(func.func, "id", "") == "super"):
        return "m", "", parts[0]
    return None


def _definitions_with_calls(
    tree: ast.Module,
    data: bytes,
    module: str,
    functions: frozenset[str],
    bound: Mapping[str, str],
    keyword: str,
) -> Iterator[DefinitionFacts]:
    """The module-level functions and top-level classes' methods of ``tree``, with their calls."""
    starts = [0, *(m.end() for m in re.finditer(rb"\r\n|\r|\n", data))]
    name = keyword.encode()

    def definition_text(node: ast.stmt) -> bytes:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        last = node.end_lineno or node.lineno
        return data[starts[first - 1] : starts[last] if last < len(starts) else None]

    for top in tree.body:
        if isinstance(top, _FUNCTIONS):
            members = [(top, top.name, False, False)]
        elif isinstance(top, ast.ClassDef):
            holds = name in definition_text(top)
            members = [
                (member, f"{top.name}.{member.name}", True, holds)
                for member in top.body
                if isinstance(member, _FUNCTIONS)
            ]
        else:
            continue
        for node, qualname, method, holds in members:
            within = list(calls_within(node))
            calls = frozenset(
                target
                for call in within
                for target in [_call_target(call, module, functions, bound, keyword)]
                if target is not None
            )
            yield DefinitionFacts(
                (module, qualname),
                node.name,
                method,
                _decorator_last_names(node),
                name in definition_text(node),
                holds,
                calls,
                any(_reads_the_frame(c) for c in within),
                node.args.kwarg is not None,
            )


def functions_by_qualname(
    module: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The module-level functions and the methods of module-level classes of ``module``.

    With their qualified names (those the plan can name)."""
    for top in module.body:
        if isinstance(top, _FUNCTIONS):
            yield top.name, top
        elif isinstance(top, ast.ClassDef):
            for member in top.body:
                if isinstance(member, _FUNCTIONS):
                    yield f"{top.name}.{member.name}", member


def _annotation_names(annotation: ast.expr | None) -> frozenset[str]:
    """The last names in ``annotation``.

    An annotation such as ``MLPSubmodules``, ``Optional[a.MLPSubmodules]``, or a string."""
    if annotation is None:
        return frozenset()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return frozenset(re.findall(r"[A-Za-z_]\w*", annotation.value))
    return frozenset(
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(annotation)
        if isinstance(n, (ast.Name, ast.Attribute))
    )


def _spec_calls(path: str, module: str, tree: ast.Module, keyword: str) -> Iterator[SpecCall]:
    """The calls of a spec's field in ``tree`` that pass neither the keyword nor ``**``.

    Only those in the module-level functions and methods of ``tree``: those the plan can name its
    function for."""
    for qualname, function in functions_by_qualname(tree):
        arguments = function.args
        parameters = {
            a.arg: a.annotation
            for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
        }
        for node in ast.walk(function):
            if not isinstance(node, ast.Call) or any(
                k.arg in (None, keyword) for k in node.keywords
            ):
                continue
            first = attribute_chain(node.args[0]) if node.args else None
            callee = attribute_chain(node.func) or [""]
            name = spec_field_of_call(callee, first)
            if name is None:
                continue
            receiver = callee[:-1] if callee[-2:-1] == ["submodules"] else (first or [])[:-1]
            annotated = (
                _annotation_names(parameters.get("submodules"))
                if receiver == ["submodules"]
                else frozenset()
            )
            yield SpecCall(path, node.lineno, module, qualname, name, annotated)


def _statements_within(
    body: Sequence[ast.AST], enter_definitions: bool = True
) -> Iterator[ast.stmt]:
    """The statements of ``body`` and of every block in them (functions', ``except``'s, ``case``'s).

    Expressions are not entered: a tenth of the nodes :func:`ast.walk` visits. Without
    ``enter_definitions``, a ``def``'s or ``class``'s body is not either (the module's own code)."""
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            yield node
        if not enter_definitions and isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, name, None)
            if type(inner) is list:
                stack += inner


def _names_assigned(targets: Sequence[ast.expr]) -> Iterator[str]:
    """The names assignment ``targets`` bind: ``f``, ``a, *f``; not ``f.warned`` or ``f[0]``."""
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from _names_assigned(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _names_assigned([target.value])


def names_bound_twice(tree: ast.Module) -> frozenset[str]:
    """The ``def`` and ``class`` names ``tree``'s module-level code binds more than once.

    In its blocks too (``if HAVE_TE: def f(x, ...) else: def f(x)``, ``try: from te import f
    except ImportError: def f(...)``, ``def f(...)`` then ``f = wrap(f)``): a call of such a name
    may reach another binding than the ``def`` given the parameter, one that takes no
    ``pg_collection``, so none of them is given it."""
    counts: Counter[str] = Counter()
    defined: set[str] = set()
    for node in _statements_within(tree.body, enter_definitions=False):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            counts[node.name] += 1
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            counts.update(a.asname or a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and not (
            isinstance(node.value, ast.Constant) and node.value.value is None
        ):  # ``TEFusedMLP = None`` without TE: calling it fails with or without a keyword
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            counts.update(_names_assigned(targets))
    return frozenset(name for name in defined if counts[name] > 1)


def names_reached(
    tree: ast.Module, data: bytes, module: str, package: list[str], bound: Mapping[str, str]
) -> frozenset[str]:
    """The names of modules ``tree`` (of bytes ``data``) reaches, as ``module:name``.

    Those its imports name, in a function too (``from m import x``; ``m:*`` for ``from m import
    *``), the attributes it reads of a module its module-level imports bind (``m.x``; ``a.b.m.x``
    after ``import a.b.m``: ``a:b``, ``a.b:m`` and ``a.b.m:x``; found in the text, written without
    spaces or a line break around a dot, a comment's counting too), and the names its own
    ``__all__`` lists (``module:x``). An import the rewrite of a file leaves unused stays where one
    of these reaches it: removing it would break ``from m import x`` elsewhere."""
    reached = {
        f"{absolute_module(node.module, node.level, package)}:{alias.name}"
        for node in _statements_within(tree.body)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    for found in set(_DOTTED.findall(data)) if bound else ():
        head, *rest = (part.decode() for part in found.split(b".") if part)
        module_bound = bound.get(head)
        if module_bound is not None:
            parts = [*module_bound.replace(":", ".").split("."), *rest]
            reached.update(f"{'.'.join(parts[:end])}:{parts[end]}" for end in range(1, len(parts)))
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                reached.update(
                    f"{module}:{n.value}"
                    for n in ast.walk(node.value)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                )
    return frozenset(reached)


def read_file_facts(path: str, data: bytes, tree: ast.Module, keyword: str) -> FileFacts:
    """The facts of file ``path`` for the collection's parameter name ``keyword``.

    ``data``: its bytes, parsed as ``tree``."""
    module = ".".join(module_name(path))
    package = path.split("/")[:-1]
    bound = import_bindings(tree, package)
    tops = [top for top in (_top_level(node, keyword) for node in tree.body) if top is not None]
    functions = frozenset(top.name for top in tops if not top.is_class)
    binds_keyword = (
        keyword in bound
        or keyword in functions
        or any(
            isinstance(t, ast.Name) and t.id == keyword
            for n in tree.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
    )
    def_words, def_lines = _def_names(data)
    return FileFacts(
        path,
        module,
        bound,
        {top.name: top for top in tops},
        functions,
        tuple(top for top in tops if top.is_class),
        binds_keyword,
        tuple(_definitions_with_calls(tree, data, module, functions, bound, keyword)),
        tuple(_spec_calls(path, module, tree, keyword)) if _SPEC_CALL.search(data) else (),
        def_lines,
        frozenset(_CALLED.findall(data)),
        def_words,
        frozenset(word for rest in _CLASS_LINE.findall(data) for word in _WORD.findall(rest)),
        frozenset(_DECLARED.findall(data)),
        rebound=names_bound_twice(tree),
        reached=names_reached(tree, data, module, package, bound),
    )


class TreeIndex:
    """Every file's facts, by path and by module.

    ``facts``: path -> :class:`FileFacts`, in the tree's order; None for a file that does not parse,
    which the scan refused already."""

    def __init__(self, facts: Mapping[str, FileFacts | None]) -> None:
        self.files = {path: found for path, found in facts.items() if found is not None}
        self.by_module = {found.module: found for found in self.files.values()}

    def definition(self, key: Key, depth: int = 0) -> tuple[TopLevel, FileFacts] | None:
        """The module-level ``class`` or ``def`` ``key`` is; None when the tree does not hold it.

        Followed through the imports of packages that re-export it."""
        found = self.by_module.get(key[0])
        if found is None or depth > 8:
            return None
        top = found.defined.get(key[1])
        if top is not None:
            return top, found
        imported = found.bound.get(key[1], "")
        if ":" not in imported:
            return None
        module, _, name = imported.partition(":")
        return self.definition((module, name), depth + 1)

    def calling(self, names: Collection[str]) -> Iterator[FileFacts]:
        """The files whose text calls one of ``names`` (``name(``)."""
        words = {name.encode() for name in names}
        return (found for found in self.files.values() if not words.isdisjoint(found.called))

    def defining(self, method: str) -> Iterator[FileFacts]:
        """The files whose text has ``def method``."""
        word = method.encode()
        return (found for found in self.files.values() if word in found.def_words)

    def naming_on_a_class_line(self, names: Collection[str]) -> Iterator[FileFacts]:
        """The files with a ``class`` line naming one of ``names`` after the keyword."""
        words = {name.encode() for name in names}
        return (
            found for found in self.files.values() if not words.isdisjoint(found.class_line_words)
        )

    def def_lines(self) -> Counter[str]:
        """How often each name is defined on a ``def`` line, over the whole tree."""
        counts: Counter[str] = Counter()
        for found in self.files.values():
            counts.update(found.def_lines)
        return counts
