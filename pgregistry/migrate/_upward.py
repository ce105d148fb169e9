"""Threading upward: the read-less functions that call a threaded one get the collection too, so
their callers can pass one.

A function threaded because it reads the grid (``param_is_not_gtp_duplicate``) falls back whenever
its caller has no collection to pass: a caller that reads nothing
(``MegatronOptimizer._filter_grads_for_norm``) gets no parameter of its own, so nobody above it can
hand one down, and ``-W error`` can never be met there. This module decides, once over the whole
tree and before any file is finished, which such callers get the same keyword-only parameter (the
configured name, default None) and pass it on, repeated up the calls until nothing changes. With no
collection passed the default ``None`` flows down to the same fallbacks, so behaviour is the old
one.

Bounded on purpose, so the diff stays one a maintainer merges:

* only a module-level function or a method of a module-level class, called by name somewhere, under
  the tool's threading rules: never a special method, an autograd-style ``forward`` / ``backward``,
  one decorated so that a new parameter breaks it (``@property``, ``@lru_cache``, ...), a hook, a
  function only passed as a value; never one that already names the collection (it has one, or binds
  the name); a nested function's calls count for its outermost function, whose parameter it reads as
  a closure;
* a method is reached through ``self.m(...)`` or ``obj.m(...)`` by its name alone (which class
  ``obj`` is, is not known), so a method name is threaded only when **every** ``def`` of that name
  in the tree is, with the same keyword: a polymorphic call then never meets an override without the
  parameter. One ``def`` that cannot be threaded (``step`` of a learning-rate scheduler next to an
  optimizer's) keeps the whole name out, which is what stops the climb;
* every function threaded reaches a function that reads, through calls that pass the collection.

Read from the facts of the files that call a candidate's name (:mod:`._facts`: each definition's
calls, read where the file was parsed), round by round. Pure: no I/O; the result depends on the tree
alone, not on how a run splits its files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pgregistry.migrate._facts import CallTarget, DefinitionFacts, Key, TreeIndex
from pgregistry.migrate._plan import (
    CALLED_BY_AUTOGRAD,
    FIXED_SIGNATURE,
    add_reexported_names,
    decorator_matches,
)
from pgregistry.migrate._tree import classify_uses

__all__ = ["Upward", "thread_upward"]


@dataclass(frozen=True)
class Upward:
    """What threading upward decided: the functions and the method names given the parameter.

    ``functions``: the functions given the parameter ((module, qualified name)); ``methods``: the
    method names every ``def`` of which has the parameter (name -> keyword), so that a call
    ``obj.m(...)`` may pass it."""

    functions: frozenset[Key] = frozenset()
    methods: Mapping[str, str] = field(default_factory=dict)


def _may_be_threaded(
    definition: DefinitionFacts,
    binds_keyword: bool,
    dropping: frozenset[str],
    passed_the_keyword: frozenset[str],
) -> bool:
    """Whether ``definition`` may be given the parameter: see the module's docstring.

    In a module that ``binds_keyword`` at its top level, none may; nor a function decorated with
    one of ``dropping``, whose wrapper takes no ``**kwargs``; nor one taking ``**kwargs`` whose name
    the tree calls passing the keyword itself (``passed_the_keyword``): it goes into them."""
    name = definition.name
    special = name.startswith("__") and name.endswith("__")
    return not (
        special
        or binds_keyword
        or any(decorator_matches(last, FIXED_SIGNATURE) for last in definition.decorators)
        or not dropping.isdisjoint(definition.decorators)
        or definition.names_keyword
        or definition.calls_locals
        or (definition.takes_keywords and name in passed_the_keyword)
        or (definition.method and name in CALLED_BY_AUTOGRAD)
    )


def _reexport_aliases(keys: Iterable[Key], packages: Mapping[str, bytes]) -> dict[Key, Key]:
    """Each name under which a package re-exports one of the functions ``keys`` -> that function.

    ``packages``: path -> bytes of its ``__init__.py``; ``keys``: module-level functions."""
    found = add_reexported_names({key: "\0".join(key) for key in keys}, packages)
    return {
        alias: (original.split("\0")[0], original.split("\0")[1])
        for alias, original in found.items()
    }


def thread_upward(
    index: TreeIndex,
    contents: Mapping[str, bytes],
    threaded: Mapping[Key, str],
    packages: Mapping[str, bytes],
    name: str,
    dropping: frozenset[str] = frozenset(),
    passed_the_keyword: frozenset[str] = frozenset(),
) -> Upward:
    """Which read-less functions of the tree get the parameter ``name``.

    ``index``: the tree's files' facts; ``contents``: path -> bytes. ``threaded``: the functions and
    methods threaded because they read ((module, qualified name) -> keyword); ``packages``: the
    ``__init__.py`` files, through which packages re-export functions; ``dropping``: the tree's
    decorators whose wrapper takes no ``**kwargs`` (:func:`._tree.keyword_dropping_decorators`);
    ``passed_the_keyword``: the names the tree calls passing the keyword itself
    (:func:`._tree.names_passed_the_keyword`)."""
    seeds = dict(threaded)
    known = {qualname.rpartition(".")[2] for _, qualname in seeds}
    definitions: dict[Key, DefinitionFacts] = {}
    #: The definitions that may be given the parameter (a name defined twice: each its own).
    eligible: set[DefinitionFacts] = set()
    by_callee: dict[str, list[DefinitionFacts]] = {}
    parsed: set[str] = set()
    frontier = set(known)
    while frontier:  # discovery: the files that call a name learned last round, each read once
        read: list[DefinitionFacts] = []
        for facts in index.calling(frontier):
            if facts.path in parsed:
                continue
            parsed.add(facts.path)
            read += facts.definitions
            eligible.update(
                d
                for d in facts.definitions
                if _may_be_threaded(d, facts.binds_keyword, dropping, passed_the_keyword)
                and d.key[1].partition(".")[0] not in facts.rebound
            )
        for definition in read:
            definitions[definition.key] = definition
            for callee in {callee for _, _, callee in definition.calls}:
                by_callee.setdefault(callee, []).append(definition)
        learned = [
            d.name
            for d in read
            if d in eligible and any(callee in known for _, _, callee in d.calls)
        ]
        frontier = set()
        while (
            learned
        ):  # each name learned, then the callers of it among the definitions read so far
            short = learned.pop()
            if short not in known:
                known.add(short)
                frontier.add(short)
                learned += [d.name for d in by_callee.get(short, ()) if d in eligible]
    counts = index.def_lines()
    module_functions = [key for key, d in definitions.items() if not d.method] + [
        k for k in seeds if "." not in k[1]
    ]
    aliases = _reexport_aliases(module_functions, packages)
    chosen = {
        key for key, d in definitions.items() if d in eligible and key not in seeds and d.calls
    }

    def defining_target(kind: str, module: str, callee: str) -> CallTarget:
        """A call's target, a function by the module defining it (not a package re-exporting it)."""
        return (
            ("f", *aliases.get((module, callee), (module, callee)))
            if kind == "f"
            else (kind, module, callee)
        )

    #: Each definition's calls, a function by the module defining it; each call target -> the
    #: definitions that call it.
    calls: dict[Key, set[CallTarget]] = {}
    callers_of: dict[CallTarget, list[Key]] = {}
    for key, definition in definitions.items():
        calls[key] = {defining_target(*call) for call in definition.calls}
        for call in calls[key]:
            callers_of.setdefault(call, []).append(key)

    def methods_threaded_alike(given: set[Key]) -> dict[str, str]:
        """Method names every ``def`` of which is in ``given``, with keyword ``name``.

        "Every" is by count: as many ``def``s of the name in ``given`` as over the whole tree."""
        threaded_defs: dict[str, int] = {}
        other_keyword, of_methods = set(), set()
        for module, qualname in given:
            short = qualname.rpartition(".")[2]
            threaded_defs[short] = threaded_defs.get(short, 0) + 1
            if seeds.get((module, qualname), name) != name:
                other_keyword.add(short)
            if "." in qualname:
                of_methods.add(short)
        return {
            short: name
            for short, count in threaded_defs.items()
            if short in of_methods and short not in other_keyword and count == counts.get(short)
        }

    checked = False
    while True:
        every = set(seeds) | chosen
        methods = methods_threaded_alike(every)
        calling = {
            key
            for key in chosen
            if any(
                (module, callee) in every if kind == "f" else callee in methods
                for kind, module, callee in calls[key]
            )
        }
        # Those whose calls lead to a function that reads: from the seeds down the callers (each
        # once).
        reaching, todo = set(seeds), list(seeds)
        while todo:
            module, qualname = todo.pop()
            short = qualname.rpartition(".")[2]
            targets = [("f", module, short)] if "." not in qualname else []
            targets += [("m", "", short)] if short in methods else []
            for called in targets:
                for caller in callers_of.get(called, ()):
                    if caller in calling and caller not in reaching:
                        reaching.add(caller)
                        todo.append(caller)
        # A method no caller may pass the collection to (another ``def`` of its name is not
        # threaded) gets none, nor one that holds a collection unless another method of its name
        # needs the parameter.
        needed = {k[1].rpartition(".")[2] for k in seeds} | {
            definitions[k].name for k in calling & reaching if not definitions[k].holds
        }
        kept = {
            key
            for key in calling & reaching
            if not definitions[key].method
            or definitions[key].name in methods
            and definitions[key].name in needed
        }
        if kept == chosen and not checked:
            # Only now, for the few names left (a search for thousands would cost more than the
            # rest): a function passed as a value or registered as a hook has no caller that passes
            # it one.
            if kept:
                _, values, hooks = classify_uses(contents, {definitions[key].name for key in kept})
                kept = {key for key in kept if definitions[key].name not in (values | hooks)}
            checked = True
        if kept == chosen:
            return Upward(frozenset(chosen), methods_threaded_alike(set(seeds) | chosen))
        chosen = kept
