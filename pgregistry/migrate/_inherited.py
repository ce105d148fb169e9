"""Subclasses that inherit a threaded ``__init__``: their instantiations pass the collection too.

A class whose own ``__init__`` the tool threaded is instantiated with the collection in scope
(:func:`~pgregistry.migrate._plan.collect_threaded_classes`). A subclass that defines no
``__init__`` of its own runs that same ``__init__``, so a call of it may pass the keyword as well,
but only where that is sure: the subclass's first base is the threaded class (Python then finds its
``__init__`` right after the subclass's own namespace, whatever the other bases), and the subclass
has no ``__init__``, no ``__new__``, no decorator and no class keyword (a metaclass) of its own. A
subclass with an ``__init__`` of its own is never given it (that one may not take the keyword).
Followed down the tree until nothing changes (a subclass of such a subclass).

Read with :mod:`ast` from the files whose text names a known class in a ``class`` line. Pure: no
I/O.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

from pgregistry._source.scanner import module_name
from pgregistry.migrate._plan import add_reexported_names
from pgregistry.migrate._upward import import_bindings

__all__ = ["add_inheriting_subclasses"]

#: (module, class name).
Key = tuple[str, str]


def _runs_the_base_init(node: ast.ClassDef) -> bool:
    """Whether instantiating ``node`` runs its first base's ``__init__`` with the call's arguments,
    as far as the class itself says: nothing of its own between the call and that ``__init__``."""
    own = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return bool(node.bases) and not (
        node.decorator_list or node.keywords or own & {"__init__", "__new__"}
    )


def _first_base(
    node: ast.ClassDef, module: str, bound: Mapping[str, str], classes: set[str]
) -> Key | None:
    """(module, name) of ``node``'s first base: a class of this module or one the file imports."""
    base = node.bases[0]
    parts: list[str] = []
    while isinstance(base, ast.Attribute):
        parts.append(base.attr)
        base = base.value
    if not isinstance(base, ast.Name):
        return None
    dotted = [base.id, *parts[::-1]]
    if len(dotted) == 1 and dotted[0] in classes:
        return module, dotted[0]
    head = bound.get(dotted[0])
    if head is None:
        return None
    qualified = ".".join([head.replace(":", "."), *dotted[1:]])
    owner, _, name = qualified.rpartition(".")
    return (owner, name) if owner else None


def add_inheriting_subclasses(
    contents: Mapping[str, bytes], threaded: Mapping[Key, str], packages: Mapping[str, bytes]
) -> dict[Key, str]:
    """``threaded`` (classes whose own ``__init__`` takes the keyword: (module, class) -> keyword)
    with the module-level classes of the tree ``contents`` (path -> bytes) that inherit one of those
    ``__init__``s unchanged; ``packages``: the ``__init__.py`` files, through which a base may be
    named."""
    found = dict(threaded)
    parsed: dict[str, ast.Module | None] = {}
    changed = True
    while changed:
        changed = False
        known = add_reexported_names(found, packages)
        names = sorted({name for _, name in known})
        if not names:
            return found
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
                base = (
                    _first_base(node, module, bound, classes) if _runs_the_base_init(node) else None
                )
                keyword = known.get(base) if base is not None else None
                if keyword is not None:
                    found[(module, node.name)] = keyword
                    changed = True
    return found
