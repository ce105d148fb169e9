"""What the whole tree says of its functions and collections, learned before any file is planned.

Whether a function may be given a new parameter depends on code in other files: a function whose
only uses are as a value (``partial(f)``, ``callback=f``, ``@f``) or as a hook
(``register_forward_hook(f)``) has no caller that could pass one, and a method of a class with a
base outside the tree is a framework callback unless the tree calls it by name. Which collections
are in scope depends on the tree's own names (``config._pg_collection`` is one where the file
assigns it, or where a class of the tree declares the field; a chain of ``self`` such as
``self.dataset.pg_collection`` only in the classes the tree ties it to). This module finds those
facts, for the names that matter (those of the functions reads are in), with regular expressions
over every file's bytes: one pass per file, no parse, so a run stays linear in the tree's size.
Name-based on purpose: the type of ``obj`` in ``obj.f`` is not known statically, so a method ``f``
of any class counts as called (or passed) when ``obj.f(...)`` (or ``obj.f``) is.

The patterns err on the safe side: a mention in a comment may make a function count as called (then
it is threaded, and only its direct callers pass it a collection) or as passed as a value (then its
reads stay, with the reason). Pure: no I/O.
"""

from __future__ import annotations

import ast
import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pgregistry.migrate._facts import calls_within
from pgregistry.migrate._init_order import classes_setting_late

__all__ = ["TreeFacts", "learn_tree", "names_a_collection", "classify_uses"]

#: Where a dotted name is assigned: ``a.b.c =`` or ``a.b.c: T =`` (not ``==``), and the value's
#: first line.
_ATTRIBUTE_TARGET = re.compile(
    rb"^[ \t]*((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)[ \t]*([^\n]*)", re.M
)
#: A type: ``X``, ``a.X``, ``Optional[X]``, ``X | None``, or a string (a docstring's ``name: what it
#: is`` is none).
_TYPE = (
    rb"(?:[\w.]+(?:\[[^\]\n]*\])?(?:[ \t]*\|[ \t]*[\w.]+(?:\[[^\]\n]*\])?)*|'[^'\n]*'|\"[^\"\n]*\")"
)
#: A field declared in a class body: an annotated name alone on an indented line, with no trailing
#: comma and no closing parenthesis on the next line (a function's last parameter).
_FIELD = re.compile(
    rb"^[ \t]+([A-Za-z_]\w*)[ \t]*:[ \t]*"
    + _TYPE
    + rb"[ \t]*(?:=[^\n]*[^,\s])?[ \t]*$(?!\n[ \t]*\))",
    re.M,
)
#: A class statement: its name and the text of its bases.
_CLASS = re.compile(rb"^[ \t]*class[ \t]+([A-Za-z_]\w*)[ \t]*(?:\(([^)]*)\))?", re.M)
#: A value that is a collection whatever its name.
_BUILDS = re.compile(rb"\b(?:ProcessGroupCollection|use_mpu_process_groups)\s*\(")


@dataclass(frozen=True)
class TreeFacts:
    """Facts about the tree a file's plan needs.

    ``state_modules``: the ratchet's configured ``parallel_state`` modules (a read on a bare name no
    import binds, a configured alias such as ``ps``, is taken as the scanner resolved it);
    ``modules``: the tree's own module names; ``called``: names called somewhere (``f(`` or
    ``.f(``); ``values``: names referenced as values and never called; ``hooks``: names passed to a
    torch hook registration (``register_*hook``); ``collections``: (path, dotted expression) of each
    assignment of a collection to an attribute (``config._pg_collection = ...``); ``fields``: the
    collection attributes a class body declares (``_pg_collection: Optional[ProcessGroupCollection]
    = None``)."""

    state_modules: tuple[str, ...] = ("parallel_state", "mpu")
    modules: frozenset[str] = frozenset()
    called: frozenset[str] = frozenset()
    values: frozenset[str] = frozenset()
    hooks: frozenset[str] = frozenset()
    collections: frozenset[tuple[str, str]] = frozenset()
    fields: frozenset[str] = frozenset()
    ties: frozenset[tuple[str, str]] = frozenset()
    bases: frozenset[tuple[str, str]] = frozenset()
    #: The names of the tree's decorators whose wrapper takes no ``**kwargs``
    #: (:func:`keyword_dropping_decorators`).
    dropping: frozenset[str] = frozenset()
    #: The names the tree calls passing the collection's keyword itself (``f(x, pg_collection=c)``,
    #: ``obj.m(pg_collection=c)``; :func:`names_passed_the_keyword`): a function of such a name
    #: that takes ``**kwargs`` gets it there, where a new parameter would take it.
    passed_the_keyword: frozenset[str] = frozenset()
    #: The classes whose ``__init__`` assigns a collection attribute after code that may call a
    #: method reading it (:func:`~pgregistry.migrate._init_order.classes_setting_late`).
    set_late: frozenset[str] = frozenset()

    def ties_class(self, chain: str, cls: str) -> bool:
        """Whether a ``self.<a>.<b>`` ``chain`` is in scope in the methods of class ``cls``.

        It is when the tree ties it to ``cls`` or to a class ``cls`` derives from (``ties``: (chain,
        class) where the class's own methods assign the chain, or assign ``self.<a>`` an instance of
        a class of the tree that declares or assigns ``<b>``; ``bases``: (class, base) by name). A
        chain with another head, or of one attribute, is not tied: True."""
        if not chain.startswith("self.") or chain.count(".") < 2:
            return True
        tied = {c for t, c in self.ties if t == chain}
        seen, todo = set(), [cls]
        while todo:
            name = todo.pop()
            if name in tied:
                return True
            seen.add(name)
            todo.extend(b for c, b in self.bases if c == name and b not in seen)
        return False

    def collections_of(self, path: str, *, own: bool = False) -> frozenset[str]:
        """The expressions that hold a collection in file ``path``.

        Those it assigns one to, and (unless ``own``) those of other files whose attribute a class
        declares as a field (an instance of that class has it)."""
        return frozenset(
            e
            for p, e in self.collections
            if p == path or not own and e.rpartition(".")[2] in self.fields
        )

    def is_state_module(self, dotted: str) -> str | None:
        """The configured ``parallel_state`` module ``dotted`` is, None when it is none.

        The ratchet's rule: the name itself or a ``.``-suffix of it."""
        return next(
            (m for m in self.state_modules if dotted == m or dotted.endswith("." + m)), None
        )


def names_a_collection(identifier: str, collection: str) -> bool:
    """Whether ``identifier`` names a collection by the configured name ``collection``.

    It does when it is that name or holds it as a ``_``-separated part (``_pg_collection``,
    ``model_pg_collection``; not ``pg_collections``)."""
    return re.search(rf"(?:^|_){re.escape(collection)}(?:_|$)", identifier) is not None


def _lines_with(data: bytes, words: re.Pattern[bytes]) -> list[tuple[int, int]]:
    """The (start, end) offsets of the distinct lines of ``data`` where ``words`` matches.

    The anchored patterns below are tried on those only (a pattern anchored at every line start
    would try each line of every file)."""
    spans: list[tuple[int, int]] = []
    for match in words.finditer(data):
        if spans and match.start() < spans[-1][1]:
            continue
        start = data.rfind(b"\n", 0, match.start()) + 1
        end = data.find(b"\n", match.end())
        spans.append((start, end if end >= 0 else len(data)))
    return spans


def _indent_width(data: bytes, start: int) -> int:
    """The indentation of the line starting at ``start``."""
    at = start
    while at < len(data) and data[at : at + 1] in (b" ", b"\t"):
        at += 1
    return at - start


def _enclosing_class(data: bytes, start: int) -> str | None:
    """The name of the innermost class whose body holds the line starting at ``start``.

    Read back through the lines of smaller indentation (blank and comment lines aside); None when it
    is in none."""
    level = _indent_width(data, start)
    while level and start > 0:
        start = data.rfind(b"\n", 0, start - 1) + 1
        indent = _indent_width(data, start)
        if indent >= level or data[start + indent : start + indent + 1] in (b"\n", b"#", b""):
            continue
        level = indent
        found = _CLASS.match(data, start)
        if found is not None:
            return found.group(1).decode()
    return None


def _collection_assignments(
    data: bytes, collection: str
) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """The expressions ``data`` assigns a collection to, its collection fields, class attributes.

    As (the dotted expressions, with at least one ``.``, ``data`` assigns a collection to: by name,
    see :func:`names_a_collection`, or by value, ``ProcessGroupCollection(...)``; the collection
    fields its class bodies declare; (class, attribute) of each collection attribute a class
    declares or its methods assign to ``self``, and (class, ``self.<a>.<b>``) of each deeper chain
    its methods assign)."""
    assigned, fields, owned = set(), set(), set()
    for start, end in _lines_with(
        data, re.compile(re.escape(collection.encode()) + rb"|" + _BUILDS.pattern)
    ):
        target = _ATTRIBUTE_TARGET.match(data, start, end)
        if target is not None and (
            names_a_collection(target.group(1).decode().rpartition(".")[2], collection)
            or _BUILDS.search(target.group(2))
        ):
            dotted = target.group(1).decode()
            assigned.add(dotted)
            cls = _enclosing_class(data, start) if dotted.startswith("self.") else None
            if cls is not None:
                owned.add((cls, dotted.removeprefix("self.") if dotted.count(".") == 1 else dotted))
        declared = _FIELD.match(data, start)  # its lookahead reads the next line
        if declared is not None and names_a_collection(declared.group(1).decode(), collection):
            fields.add(declared.group(1).decode())
            cls = _enclosing_class(data, start)
            if cls is not None:
                owned.add((cls, declared.group(1).decode()))
    return assigned, fields, owned


def _classes_tying_chains(
    contents: Mapping[str, bytes], owned: set[tuple[str, str]]
) -> set[tuple[str, str]]:
    """(``self.<a>.<b>`` chain, class) for each class the tree ties such an assigned chain to.

    Tied: its methods assign the chain, or assign ``self.<a> = X(...)`` where class ``X`` declares
    or assigns ``<b>`` (``owned``: see :func:`_collection_assignments`)."""
    chains = {chain for _, chain in owned if chain.count(".") >= 2}
    ties = {(chain, cls) for cls, chain in owned if chain in chains}
    holders = {
        attribute: {c for c, a in owned if a == attribute}
        for attribute in {chain.rpartition(".")[2] for chain in chains if chain.count(".") == 2}
    }
    steps = {chain.split(".")[1] for chain in chains if chain.count(".") == 2}
    if not steps:
        return ties
    built = re.compile(
        rb"\bself\.("
        + b"|".join(re.escape(s.encode()) for s in sorted(steps))
        + rb")[ \t]*(?::[^=\n]*)?=[ \t]*(?:[\w.]+\.)?([A-Za-z_]\w*)[ \t]*\("
    )
    for data in contents.values():
        for match in built.finditer(data):
            cls = _enclosing_class(data, data.rfind(b"\n", 0, match.start()) + 1)
            step, made = match.group(1).decode(), match.group(2).decode()
            for chain in chains:
                if (
                    cls is not None
                    and chain.split(".")[1] == step
                    and made in holders[chain.rpartition(".")[2]]
                ):
                    ties.add((chain, cls))
    return ties


def _class_bases(data: bytes) -> set[tuple[str, str]]:
    """(class, base) of the classes ``data`` defines, bases by last name (``a.B`` -> ``B``)."""
    found = set()
    for start, _ in _lines_with(data, re.compile(rb"\bclass\b")):
        statement = _CLASS.match(data, start)
        for base in (statement.group(2) or b"").split(b",") if statement is not None else ():
            name = base.strip().rpartition(b".")[2]
            if statement is not None and re.fullmatch(rb"[A-Za-z_]\w*", name):
                found.add((statement.group(1).decode(), name.decode()))
    return found


def _mention_pattern(names: Iterable[str]) -> re.Pattern[bytes]:
    """A mention of one of ``names``.

    The lookahead on their first letters spares trying each at every word.
    """
    first = b"".join(sorted({re.escape(n[:1].encode()) for n in names}))
    alternatives = b"|".join(re.escape(n.encode()) for n in sorted(names, key=len, reverse=True))
    return re.compile(rb"\b(?=[" + first + rb"])(?:" + alternatives + rb")\b")


_CALL_AFTER = re.compile(rb"[ \t]*\(")
_NOT_VALUE_AFTER = re.compile(rb"[ \t]*[\w(.\[=]")
_REGISTRATION = re.compile(rb"\bregister_(?:\w+_)?hook[ \t]*\(")
#: What precedes a value (before the dotted chain it ends): an argument, an element, an assigned,
#: default or returned value, a decorator.
_VALUE_BEFORE = (b"(", b"[", b",", b"=", b":", b"@", b"return", b"yield")


def _word_end(text: bytes, at: int) -> int:
    """Where the identifier ending at ``at`` in ``text`` starts."""
    while at > 0 and (text[at - 1 : at].isalnum() or text[at - 1 : at] == b"_"):
        at -= 1
    return at


class _Use(enum.Enum):
    """How a mention of a function's name uses it."""

    CALL = "call"
    VALUE = "value"
    OTHER = "other"
    """Its ``def``, an attribute of it, a word in prose, a keyword argument's name."""


def _kind_of_use(data: bytes, start: int, end: int) -> _Use:
    """How the mention at ``data[start:end]`` uses the name (:class:`_Use`)."""
    before = data[max(0, start - 120) : start]
    stripped = before.rstrip(b" \t")
    word = stripped[_word_end(stripped, len(stripped)) :]
    if word in (b"def", b"class") and len(stripped) < len(before):
        return _Use.OTHER
    if _CALL_AFTER.match(data, end):
        return _Use.CALL
    at = len(before)
    while (
        at > 0 and before[at - 1 : at] == b"."
    ):  # the chain the name ends: ``self.f``, ``module.f``
        at = _word_end(before, at - 1)
    if before[:at].rstrip(b" \t").endswith(_VALUE_BEFORE) and not _NOT_VALUE_AFTER.match(data, end):
        return _Use.VALUE
    return _Use.OTHER


def _hook_argument_names(data: bytes, names: re.Pattern[bytes]) -> set[str]:
    """The names among the arguments of torch hook registrations in ``data`` (not called there)."""
    found = set()
    for registration in _REGISTRATION.finditer(data):
        depth, at = 1, registration.end()
        while depth and at < len(data) and at - registration.end() < 2000:
            depth += {40: 1, 41: -1}.get(data[at], 0)
            at += 1
        for match in names.finditer(data, registration.end(), at):
            if not _CALL_AFTER.match(data, match.end()):
                found.add(match.group().decode())
    return found


def classify_uses(
    contents: Mapping[str, bytes], names: Iterable[str]
) -> tuple[set[str], set[str], set[str]]:
    """Which of ``names`` (not empty) the tree ``contents`` calls, only references, or hooks.

    Those called somewhere in the tree, those referenced as values and never called, and those
    passed to a torch hook registration."""
    called: set[str] = set()
    values: set[str] = set()
    hooks: set[str] = set()
    mention = _mention_pattern(names)
    for data in contents.values():
        for match in mention.finditer(data):
            use = _kind_of_use(data, match.start(), match.end())
            if use is not _Use.OTHER:
                (called if use is _Use.CALL else values).add(match.group().decode())
        if b"register_" in data:
            hooks |= _hook_argument_names(data, mention)
    return called, values - called, hooks


def _keyword_pattern(collection: str) -> re.Pattern[bytes]:
    """A keyword argument, or a default, of name ``collection``: ``pg_collection=``.

    Not ``==``, nor an attribute's ``self.pg_collection =``."""
    return re.compile(rb"(?<![.\w])" + re.escape(collection.encode()) + rb"[ \t]*=(?!=)")


def names_passed_the_keyword(contents: Mapping[str, bytes], collection: str) -> frozenset[str]:
    """The names the tree ``contents`` calls passing keyword ``collection`` itself.

    A call's last name (``f`` of ``f(...)`` and of ``obj.f(...)``), read with :mod:`ast` from the
    files whose text holds ``collection=``."""
    pattern = _keyword_pattern(collection)
    names: set[str] = set()
    for data in contents.values():
        tree = _parse_or_none(data) if pattern.search(data) else None
        for node in calls_within(tree) if tree is not None else ():
            if any(k.arg == collection for k in node.keywords):
                function = node.func
                if isinstance(function, (ast.Name, ast.Attribute)):
                    names.add(function.id if isinstance(function, ast.Name) else function.attr)
    return frozenset(names)


#: A decorator line's dotted name.
_DECORATOR = re.compile(rb"^[ \t]*@[ \t]*([A-Za-z_][\w.]*)", re.M)
_FUNCTION_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_NESTED = (*_FUNCTION_DEFS, ast.Lambda)


def _drops_keywords(node: ast.stmt) -> bool:
    """Whether decorator ``node`` may call what it wraps without a keyword its caller passed.

    ``node``: a module-level ``def`` or ``class``. A function's wrappers are its innermost nested
    functions (a decorator factory's middle layer is none): each must take ``**kwargs``. A class's
    ``__call__`` must. A function with no nested one (``return fn``, a registry) passes the call
    through untouched."""
    if isinstance(node, ast.ClassDef):
        call = next(
            (m for m in node.body if isinstance(m, _FUNCTION_DEFS) and m.name == "__call__"), None
        )
        return call is not None and call.args.kwarg is None
    if not isinstance(node, _FUNCTION_DEFS):
        return False
    nested = [n for n in ast.walk(node) if isinstance(n, _NESTED) and n is not node]
    wrappers = [
        n for n in nested if not any(isinstance(m, _NESTED) and m is not n for m in ast.walk(n))
    ]
    return any(wrapper.args.kwarg is None for wrapper in wrappers)


#: A module-level ``def`` or ``class`` line, and the name it defines.
_TOP_LEVEL_DEFINITION = re.compile(rb"^(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_]\w*)", re.M)
#: A line that starts at the margin with code (not a comment or a closing bracket).
_AT_THE_MARGIN = re.compile(rb"^[^\s#)\]}]", re.M)


def _parse_or_none(data: bytes) -> ast.Module | None:
    try:
        return ast.parse(data)
    except (SyntaxError, ValueError):  # a slice cut too short, or a file the scan refused
        return None


def _first_statement(data: bytes) -> ast.stmt | None:
    module = _parse_or_none(data)
    return module.body[0] if module is not None and module.body else None


def keyword_dropping_decorators(contents: Mapping[str, bytes]) -> frozenset[str]:
    """The names of the tree's decorators that may drop a keyword a call of what they wrap passes.

    A function given the collection's parameter, so that its callers pass it, must reach it through
    every decorator: ``def once(fn): def wrapper(x): return fn(x)`` raises ``TypeError: wrapper()
    got an unexpected keyword argument 'pg_collection'`` at each call. Found by name: the last
    dotted name of every ``@decorator`` of the tree that a module-level ``def`` or ``class`` of the
    tree defines and :func:`_drops_keywords` says may drop it. Only each such definition is
    parsed."""
    used = {
        found.rpartition(b".")[2]
        for data in contents.values()
        for found in _DECORATOR.findall(data)
    }
    if not used:
        return frozenset()
    dropping: set[str] = set()
    for data in contents.values():
        for found in _TOP_LEVEL_DEFINITION.finditer(data):
            if found.group(1) not in used:
                continue
            # Its block alone: up to the next line that starts at the margin (not a comment or a
            # closing bracket); the whole file where that slice does not parse.
            block_end = _AT_THE_MARGIN.search(data, found.end())
            node = _first_statement(data[found.start() : block_end.start() if block_end else None])
            if node is None:
                node = next(
                    (
                        n
                        for n in (_parse_or_none(data) or ast.Module([], [])).body
                        if getattr(n, "name", None) == found.group(1).decode()
                    ),
                    None,
                )
            if node is not None and _drops_keywords(node):
                dropping.add(found.group(1).decode())
    return frozenset(dropping)


def learn_tree(
    contents: Mapping[str, bytes],
    functions: Iterable[str],
    collection: str,
    *,
    state_modules: tuple[str, ...] = ("parallel_state", "mpu"),
    modules: frozenset[str] = frozenset(),
) -> TreeFacts:
    """The :class:`TreeFacts` of the tree whose files are ``contents`` (path -> bytes).

    About the functions named ``functions`` (those reads are in); ``collection``: the collection's
    configured name."""
    called: set[str] = set()
    values: set[str] = set()
    hooks: set[str] = set()
    collections: set[tuple[str, str]] = set()
    fields: set[str] = set()
    owned: set[tuple[str, str]] = set()
    named = {
        n for n in functions if not (n.startswith("__") and n.endswith("__"))
    }  # Python calls those
    for path, data in contents.items():
        if (
            collection.encode() in data
            or b"ProcessGroupCollection" in data
            or b"use_mpu_process_groups" in data
        ):
            assigned, declared, classes = _collection_assignments(data, collection)
            collections |= {(path, expression) for expression in assigned}
            fields |= declared
            owned |= classes
    if named:
        called, values, hooks = classify_uses(contents, named)
    ties = _classes_tying_chains(contents, owned)
    bases = {pair for data in contents.values() for pair in _class_bases(data)} if owned else set()
    return TreeFacts(
        state_modules=state_modules,
        modules=modules,
        called=frozenset(called),
        values=frozenset(values - called),
        hooks=frozenset(hooks),
        collections=frozenset(collections),
        fields=frozenset(fields),
        ties=frozenset(ties),
        bases=frozenset(bases) if ties else frozenset(),
        set_late=classes_setting_late(contents, owned, bases),
        dropping=keyword_dropping_decorators(contents),
        passed_the_keyword=names_passed_the_keyword(contents, collection),
    )
