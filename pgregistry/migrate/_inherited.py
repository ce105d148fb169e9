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

Read from the facts (:mod:`._facts`) of the files whose text names a known class in a ``class``
line. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pgregistry.migrate._facts import Key, TreeIndex, resolve_dotted_name
from pgregistry.migrate._plan import add_reexported_names

__all__ = ["Subclasses", "thread_subclasses"]


@dataclass(frozen=True)
class Subclasses:
    """What :func:`thread_subclasses` found: the classes that take the keyword, what forwards it.

    ``classes``: every class whose instantiation takes the keyword ((module, class) -> keyword);
    ``forwarding``: the ``__init__``s given the parameter to pass it on through ``super().__init__``
    ((module, ``Class.__init__``))."""

    classes: Mapping[Key, str] = field(default_factory=dict)
    forwarding: frozenset[Key] = frozenset()


def thread_subclasses(
    index: TreeIndex,
    threaded: Mapping[Key, str],
    packages: Mapping[str, bytes],
    keyword: str,
    passed_the_keyword: frozenset[str] = frozenset(),
) -> Subclasses:
    """``threaded`` with the tree's classes that inherit one of its ``__init__``s or forward to it.

    ``threaded``: classes whose own ``__init__`` takes ``keyword`` ((module, class) -> keyword).
    Added are the module-level classes of the tree (``index``: its files' facts) that inherit one of
    those ``__init__``s unchanged or forward to it (given the parameter); ``packages``: the
    ``__init__.py`` files, through which a base may be named. An ``__init__`` that takes
    ``**kwargs`` does not forward where the tree instantiates its class passing the keyword itself
    (``passed_the_keyword``): the keyword went into them."""
    found = dict(threaded)
    forwarding: set[Key] = set()
    changed = True
    while changed:
        changed = False
        known = add_reexported_names(found, packages)
        names = {name for _, name in known}
        if not names:
            break
        for facts in index.naming_on_a_class_line(names):
            classes = {c.name for c in facts.classes}
            for cls in facts.classes:
                forwards = cls.forwards and not (
                    cls.takes_keywords and cls.name in passed_the_keyword
                )
                if (facts.module, cls.name) in found or not (cls.inherits or forwards):
                    continue
                base = (
                    resolve_dotted_name(cls.first_base, facts.module, facts.bound, classes)
                    if cls.first_base is not None
                    else None
                )
                if base is None or known.get(base) != keyword:
                    continue
                found[(facts.module, cls.name)] = keyword
                if not cls.inherits:
                    forwarding.add((facts.module, f"{cls.name}.__init__"))
                changed = True
    return Subclasses(found, frozenset(forwarding))
