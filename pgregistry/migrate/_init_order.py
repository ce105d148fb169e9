"""Classes whose ``__init__`` sets a collection attribute after code that may call a method.

A method reads ``self.pg_collection`` as set where the class's ``__init__`` assigns it by a
top-level statement (:mod:`._plan`). Code that runs before that statement may call such a method,
and the rewritten read then raises ``AttributeError`` where the original read the global state:

- a ``super().__init__(...)`` above it whose base ``__init__`` calls a method the class (or a
  subclass) overrides, or a base outside the tree, whose ``__init__`` the tool cannot read (but for
  ``object``, ``torch.nn.Module`` and the plain bases of :data:`QUIET_OUTSIDE`, whose ``__init__``
  calls no method of ``self``);
- ``self`` handed to anything above it (``helper(self)``, ``Base.__init__(self)``, ``f = self``), a
  method of the class's family loaded (``self.built``: a property; ``f = self.build``), or any
  ``super()`` other than ``super().__init__``;
- a subclass of the tree whose ``__init__`` runs such code before its top-level
  ``super().__init__(...)``, or never calls it at top level (the base's assignment may not run);
- a ``__setattr__`` / ``__getattr__`` / ``__getattribute__`` in the family (every attribute access
  may run code).

A call of a method of ``self`` above the assignment is :mod:`._plan`'s own test (it is local). The
family is the class, its bases and its subclasses, by name, across the tree (as the tool decides
methods, :mod:`._tree`): a subclass outside the tree is not seen. Pure: no I/O.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Mapping

from pgregistry.migrate._facts import last_name

__all__ = ["QUIET_OUTSIDE", "classes_setting_late"]

#: Bases outside the tree (by last name) whose ``__init__`` calls no method of ``self``:
#: ``torch.nn.Module`` sets its own attributes only, the others have none that runs code.
QUIET_OUTSIDE = frozenset({"object", "Module", "ABC", "Generic", "Protocol"})
#: Special methods that run code on every attribute access or store.
_ATTRIBUTE_HOOKS = frozenset({"__setattr__", "__getattr__", "__getattribute__"})
#: Calls that hold the frame's locals (``self`` among them) when made without arguments.
_FRAME_READERS = frozenset({"locals", "vars", "dir"})
_CLASS_LINE = re.compile(rb"^[ \t]*class[ \t]+([A-Za-z_]\w*)", re.M)


class _Family:
    """The tree's classes by name, and what a class's construction may run before an assignment."""

    def __init__(self, classes: Mapping[str, list[ast.ClassDef]]) -> None:
        self.classes = classes
        self.quiet: dict[tuple[str, frozenset[str]], bool] = {}

    def bases_of(self, name: str) -> set[str]:
        return {b for node in self.classes.get(name, []) for b in _base_names(node)}

    def subclasses_of(self, name: str) -> set[str]:
        return {
            c for c, nodes in self.classes.items() if any(name in _base_names(n) for n in nodes)
        }

    def names_around(self, name: str, *, up: bool) -> set[str]:
        """``name``'s bases (``up``) or subclasses, transitively, by name."""
        return _names_reached({name}, self.bases_of if up else self.subclasses_of) - {name}

    def supers_quiet(self, owner: str, methods: frozenset[str]) -> bool:
        """Whether ``owner``'s ``super().__init__`` calls no method of the instance.

        It does not where every base of it or of its subclasses (which follow it in a subclass's
        method resolution order) is quiet."""
        below = {owner} | self.names_around(owner, up=False)
        bases = {b for name in below for b in self.bases_of(name)} - below
        return all(self.is_quiet(b, methods) for b in bases)

    def is_quiet(self, name: str, methods: frozenset[str]) -> bool:
        """Whether constructing base ``name`` (its ``__init__``, or its bases') calls no method."""
        if name not in self.classes:
            return name in QUIET_OUTSIDE
        if (name, methods) in self.quiet:
            return self.quiet[name, methods]
        self.quiet[name, methods] = False  # a cycle of bases: not known quiet
        quiet = True
        for node in self.classes[name]:
            bases_quiet = all(self.is_quiet(b, methods) for b in _base_names(node))
            init = _init_of(node)
            quiet = quiet and not node.decorator_list and bases_quiet
            if init is not None and quiet:
                quiet = not _may_call_back(init.body, _self_name(init), methods, bases_quiet)
        self.quiet[name, methods] = quiet
        return quiet


def classes_setting_late(
    contents: Mapping[str, bytes],
    owned: Iterable[tuple[str, str]],
    bases: Iterable[tuple[str, str]],
) -> frozenset[str]:
    """The classes of ``owned`` whose ``__init__``'s collection attribute a method may read unset.

    ``owned``: (class, attribute) of each collection attribute a class's methods assign to ``self``
    (:func:`~pgregistry.migrate._tree._collection_assignments`); ``bases``: (class, base) of the
    tree's classes, by last name, from their ``class`` lines. Only the files that define a class of
    an owner's family are parsed."""
    attributes: dict[str, set[str]] = {}
    for cls, attribute in owned:
        if "." not in attribute:
            attributes.setdefault(cls, set()).add(attribute)
    if not attributes:
        return frozenset()
    up: dict[str, set[str]] = {}
    down: dict[str, set[str]] = {}
    for cls, base in bases:
        up.setdefault(cls, set()).add(base)
        down.setdefault(base, set()).add(cls)
    # The owners' subclasses, and every base of those (a subclass's other bases come after the
    # owner in its method resolution order: the owner's ``super().__init__`` may reach them).
    wanted = _names_reached(
        _names_reached(set(attributes), lambda n: down.get(n, set())), lambda n: up.get(n, set())
    )
    family = _Family(_classes_named(contents, wanted))
    late: set[str] = set()
    for owner, assigned in attributes.items():
        descendants = family.names_around(owner, up=False)
        members = {owner} | family.names_around(owner, up=True) | descendants
        methods = frozenset(
            m.name
            for name in members
            for node in family.classes.get(name, [])
            for m in node.body
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
        if (
            methods & _ATTRIBUTE_HOOKS
            or any(
                _sets_late(n, assigned, family.supers_quiet(owner, methods), methods)
                for n in family.classes.get(owner, [])
            )
            or any(
                _subclass_runs_first(node, methods, {owner} | descendants)
                for name in descendants
                for node in family.classes.get(name, [])
            )
        ):
            late.add(owner)
    return frozenset(late)


def _classes_named(contents: Mapping[str, bytes], names: set[str]) -> dict[str, list[ast.ClassDef]]:
    """The classes of ``names`` by name, from the files whose ``class`` lines define one."""
    classes: dict[str, list[ast.ClassDef]] = {}
    for data in contents.values():
        if not any(n.decode() in names for n in _CLASS_LINE.findall(data)):
            continue
        try:
            module = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(module):
            if isinstance(node, ast.ClassDef) and node.name in names:
                classes.setdefault(node.name, []).append(node)
    return classes


def _names_reached(names: set[str], step: Callable[[str], set[str]]) -> set[str]:
    """``names`` and every name ``step`` gives from one of them, transitively."""
    found = set(names)
    todo = list(names)
    while todo:
        for other in step(todo.pop()):
            if other not in found:
                found.add(other)
                todo.append(other)
    return found


def _sets_late(
    node: ast.ClassDef, assigned: set[str], quiet_super: bool, methods: frozenset[str]
) -> bool:
    """Whether code above ``node.__init__``'s top-level assignment of ``assigned`` may call one.

    A method of the instance, the statement's value included (``quiet_super``: whether
    ``super().__init__`` may not); False where it has none (:mod:`._plan` reads the attribute with
    ``getattr`` then)."""
    init = _init_of(node)
    if init is None:
        return False
    self_name = _self_name(init)
    for index, statement in enumerate(init.body):
        if _assigns_self(statement, self_name, assigned):
            return _may_call_back(init.body[: index + 1], self_name, methods, quiet_super)
    return False


def _subclass_runs_first(node: ast.ClassDef, methods: frozenset[str], owners: set[str]) -> bool:
    """Whether subclass ``node``'s own ``__init__`` may call back a method before its base's runs.

    It may where code above its first top-level ``super().__init__(...)`` or ``A.__init__(self,
    ...)`` statement does (``A`` one of ``owners``: the owner or a class between it and ``node``),
    or where it has none (the owner's ``__init__``, and its assignment, may never run)."""
    init = _init_of(node)
    if init is None:
        return False
    self_name = _self_name(init)
    for index, statement in enumerate(init.body):
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        arguments = [*call.args, *call.keywords]
        explicit = (
            call.func.attr == "__init__"
            and isinstance(call.func.value, (ast.Name, ast.Attribute))
            and last_name(call.func.value) in owners
            and bool(call.args)
            and _is_name(call.args[0], self_name)
        )
        if explicit:
            arguments = arguments[1:]
        if explicit or _is_super_init(call.func):
            return _may_call_back([*init.body[:index], *arguments], self_name, methods, False)
    return True


def _may_call_back(
    nodes: Iterable[ast.AST], self_name: str | None, methods: frozenset[str], quiet_super: bool
) -> bool:
    """Whether running ``nodes`` may call a method of ``self``.

    ``self`` used but as an attribute's object, in ``super(C, self)``, ``type(self)`` or
    ``isinstance(self, ...)``; a call of ``self.<m>``; a load of one of ``methods`` (a property, a
    bound method); ``super()`` but in ``super().__init__`` with ``quiet_super``; ``locals()``,
    ``vars()``, ``dir()`` (they hold ``self``), ``eval`` or ``exec``."""
    for root in nodes:
        harmless = 0
        for sub in ast.walk(root):
            if isinstance(sub, ast.Attribute) and _is_name(sub.value, self_name):
                harmless += 1
                if isinstance(sub.ctx, ast.Load) and sub.attr in methods:
                    return True
            elif isinstance(sub, ast.Call):
                if isinstance(sub.func, ast.Attribute) and _is_name(sub.func.value, self_name):
                    return True
                callee = sub.func.id if isinstance(sub.func, ast.Name) else ""
                if callee == "super" and not (quiet_super and _super_init_call(root, sub)):
                    return True
                if callee in _FRAME_READERS and not sub.args or callee in ("eval", "exec"):
                    return True
                if callee in ("super", "type", "isinstance"):
                    harmless += sum(_is_name(a, self_name) for a in sub.args)
        if sum(_is_name(sub, self_name) for sub in ast.walk(root)) > harmless:
            return True  # ``self`` handed on
    return False


def _super_init_call(root: ast.AST, super_call: ast.Call) -> bool:
    """Whether ``super_call`` (``super()``) is the object of a ``super().__init__`` in ``root``."""
    return any(
        isinstance(sub, ast.Attribute) and sub.value is super_call and sub.attr == "__init__"
        for sub in ast.walk(root)
    )


def _is_super_init(func: ast.expr) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "__init__"
        and isinstance(func.value, ast.Call)
        and _is_name(func.value.func, "super")
    )


def _assigns_self(statement: ast.stmt, self_name: str | None, attributes: set[str]) -> bool:
    targets = (
        statement.targets
        if isinstance(statement, ast.Assign)
        else [statement.target]
        if isinstance(statement, ast.AnnAssign)
        else []
    )
    return any(
        isinstance(t, ast.Attribute) and _is_name(t.value, self_name) and t.attr in attributes
        for t in targets
    )


def _is_name(node: ast.AST, name: str | None) -> bool:
    return isinstance(node, ast.Name) and name is not None and node.id == name


def _init_of(node: ast.ClassDef) -> ast.FunctionDef | None:
    return next(
        (m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None
    )


def _self_name(function: ast.FunctionDef) -> str | None:
    params = [*function.args.posonlyargs, *function.args.args]
    return params[0].arg if params else None


def _base_names(node: ast.ClassDef) -> set[str]:
    """The last names of ``node``'s bases (``?``, not known quiet, for a base of another form)."""
    return {last_name(base) or "?" for base in node.bases}
