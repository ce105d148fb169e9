"""Subclasses that inherit a threaded ``__init__``, or forward to it: their instantiations pass the
collection too.

A class whose own ``__init__`` the tool threaded is instantiated with the collection in scope
(:func:`~pgregistry.migrate._plan.collect_threaded_classes`). A subclass that defines no
``__init__`` of its own runs that same ``__init__``, so a call of it may pass the keyword as well,
but only where that is sure: the subclass's first base is the threaded class (Python then finds its
``__init__`` right after the subclass's own namespace, whatever the other bases), and the subclass
has no ``__init__``, no ``__new__``, no decorator and no class keyword (a metaclass) of its own. A
subclass with an ``__init__`` of its own is never given it (that one may not take the keyword).
Followed down the tree until nothing changes (a subclass of such a subclass).

A subclass whose own ``__init__`` reads nothing and reaches the threaded one only through
``super().__init__(...)`` (Megatron-Core's ``TELMHeadColumnParallelLinear`` over
``TEColumnParallelLinear``) is threaded upward, as a read-less function calling a threaded one is
(:mod:`~pgregistry.migrate._upward`): its ``__init__`` gets the keyword-only parameter (default
None) and passes it in its ``super().__init__`` calls, so no collection passed is exactly the old
behaviour. Only where that is sure: the same conditions on the class as above, the first base a
threaded class (own, inherited or forwarded), an ``__init__`` without a decorator that names the
collection nowhere (it has one of its own, or binds the name), whose every ``super().__init__`` call
(one at least, none in a nested function) passes neither ``**`` nor the keyword.

Read with :mod:`ast` from the files whose text names a known class in a ``class`` line. Pure: no
I/O.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pgregistry._source.scanner import module_name
from pgregistry.migrate._imports import attribute_chain, import_bindings
from pgregistry.migrate._plan import add_reexported_names

__all__ = ["Subclasses", "thread_subclasses"]

#: (module, class name).
Key = tuple[str, str]


def _runs_the_base_init(node: ast.ClassDef) -> bool:
    """Whether instantiating ``node`` runs its first base's ``__init__`` with the call's arguments,
    as far as the class itself says: nothing of its own between the call and that ``__init__``."""
    own = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return bool(node.bases) and not (
        node.decorator_list or node.keywords or own & {"__init__", "__new__"}
    )


def _forwards_to_the_base_init(node: ast.ClassDef, keyword: str) -> bool:
    """Whether ``node``'s own ``__init__`` can take ``keyword`` and pass it on through
    ``super().__init__(...)``, its only way to its base's: see the module's docstring."""
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


def _first_base(
    node: ast.ClassDef, module: str, bound: Mapping[str, str], classes: set[str]
) -> Key | None:
    """(module, name) of ``node``'s first base: a class of this module or one the file imports."""
    dotted = attribute_chain(node.bases[0])
    if dotted is None:
        return None
    if len(dotted) == 1 and dotted[0] in classes:
        return module, dotted[0]
    head = bound.get(dotted[0])
    if head is None:
        return None
    qualified = ".".join([head.replace(":", "."), *dotted[1:]])
    owner, _, name = qualified.rpartition(".")
    return (owner, name) if owner else None


@dataclass(frozen=True)
class Subclasses:
    """What :func:`thread_subclasses` found: every class whose instantiation takes the keyword
    ((module, class) -> keyword), and the ``__init__``s given the parameter to pass it on through
    ``super().__init__`` ((module, ``Class.__init__``))."""

    classes: Mapping[Key, str] = field(default_factory=dict)
    forwarding: frozenset[Key] = frozenset()


def thread_subclasses(
    contents: Mapping[str, bytes],
    threaded: Mapping[Key, str],
    packages: Mapping[str, bytes],
    keyword: str,
) -> Subclasses:
    """``threaded`` (classes whose own ``__init__`` takes ``keyword``: (module, class) -> keyword)
    with the module-level classes of the tree ``contents`` (path -> bytes) that inherit one of those
    ``__init__``s unchanged or forward to it (given the parameter); ``packages``: the
    ``__init__.py`` files, through which a base may be named."""
    found = dict(threaded)
    forwarding: set[Key] = set()
    parsed: dict[str, ast.Module | None] = {}
    changed = True
    while changed:
        changed = False
        known = add_reexported_names(found, packages)
        names = sorted({name for _, name in known})
        if not names:
            break
        mention = re.compile(
            rb"\bclass\b[^\n]*\b(?:" + b"|".join(re.escape(n.encode()) for n in names) + rb")\b"
        )
        for path, data in contents.items():
            if not mention.search(data):
                continue
            if path not in parsed:
                try:
                    parsed[path] = ast.parse(data)
                except (
                    SyntaxError,
                    ValueError,
                ):  # the scan refused the run already; read for classes only
                    parsed[path] = None
            tree = parsed[path]
            if tree is None:
                continue
            module = ".".join(module_name(path))
            bound = import_bindings(tree, path.split("/")[:-1])
            classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or (module, node.name) in found:
                    continue
                inherits = _runs_the_base_init(node)
                if not (inherits or _forwards_to_the_base_init(node, keyword)):
                    continue
                base = _first_base(node, module, bound, classes)
                if base is None or known.get(base) != keyword:
                    continue
                found[(module, node.name)] = keyword
                if not inherits:
                    forwarding.add((module, f"{node.name}.__init__"))
                changed = True
    return Subclasses(found, frozenset(forwarding))
