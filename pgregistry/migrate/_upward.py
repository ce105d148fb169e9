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

Read with :mod:`ast`, from the files that call a candidate's name (found with regular expressions),
round by round. Pure: no I/O; the result depends on the tree alone, not on how a run splits its
files.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pgregistry._source.scanner import module_name
from pgregistry.migrate._imports import import_bindings
from pgregistry.migrate._plan import (
    CALLED_BY_AUTOGRAD,
    FIXED_SIGNATURE,
    add_reexported_names,
    decorator_matches,
)
from pgregistry.migrate._tree import classify_uses

__all__ = ["Upward", "thread_upward"]

#: A ``def`` line's name (any indentation): every definition of a name in the tree, counted.
_DEFINED = re.compile(rb"(?:\A|(?<=[\r\n]))[ \t]*(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)")

#: A function or method: (module, qualified name in it: ``f`` or ``Class.m``).
Key = tuple[str, str]


@dataclass(frozen=True)
class Upward:
    """What threading upward decided: the functions given the parameter (``functions``: (module,
    qualified name)), and the method names every ``def`` of which has the parameter (``methods``:
    name -> keyword), so that a call ``obj.m(...)`` may pass it."""

    functions: frozenset[Key] = frozenset()
    methods: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Definition:
    key: Key
    name: str
    method: bool
    eligible: bool
    #: A method of a class that names the collection (``self.pg_collection``): it passes the one it
    #: holds, and gets the parameter only so that every method of its name has it.
    holds: bool
    #: ("f", module, name) for a call of a module-level function as its imports resolve it, ("m",
    #: "", name) for a call of a method of some object.
    calls: set[tuple[str, str, str]]


def _has_fixed_signature_decorator(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        expression = decorator.func if isinstance(decorator, ast.Call) else decorator
        last = (
            expression.attr
            if isinstance(expression, ast.Attribute)
            else getattr(expression, "id", "")
        )
        if decorator_matches(last, FIXED_SIGNATURE):
            return True
    return False


def _call_target(
    call: ast.Call, module: str, functions: set[str], bound: Mapping[str, str], name: str
) -> tuple[str, str, str] | None:
    """What ``call`` calls: a module-level function (resolved through the file's imports), or a
    method by name (never ``super().m(...)``: the base may be a class outside the tree)."""
    if any(k.arg is None or k.arg == name for k in call.keywords):
        return None  # ``**kwargs`` or the keyword given: the caller passes nothing of its own
    func = call.func
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        dotted = [func.id, *parts[::-1]]
        if len(dotted) == 1:
            if dotted[0] in functions:
                return "f", module, dotted[0]
            imported = bound.get(dotted[0], "")
            if ":" not in imported:
                return None
            return ("f", *imported.split(":"))  # type: ignore[return-value]
        head = bound.get(dotted[0])
        if head is not None:
            qualified = ".".join([head.replace(":", "."), *dotted[1:]])
            return "f", qualified.rpartition(".")[0], dotted[-1]
        return "m", "", dotted[-1]
    if parts and not (isinstance(func, ast.Call) and getattr(func.func, "id", "") == "super"):
        return "m", "", parts[0]
    return None


def _definitions_with_calls(path: str, data: bytes, name: str) -> list[_Definition]:
    """File ``path``'s module-level functions and top-level classes' methods, with their calls."""
    package = path.split("/")[:-1]
    module = ".".join(module_name(path))
    tree = ast.parse(data)
    bound = import_bindings(tree, package)
    functions = {
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    binds_the_name = (
        name in bound
        or name in functions
        or any(
            isinstance(t, ast.Name) and t.id == name
            for n in tree.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
    )
    starts = [0, *(m.end() for m in re.finditer(rb"\r\n|\r|\n", data))]
    found = []

    def definition_text(node: ast.stmt) -> bytes:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        last = node.end_lineno or node.lineno
        return data[starts[first - 1] : starts[last] if last < len(starts) else None]

    #: (definition, qualified name, whether a method, whether its class names the collection: holds
    #: one)
    defs: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str, bool, bool]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append((node, node.name, False, False))
        elif isinstance(node, ast.ClassDef):
            holds = name.encode() in definition_text(node)
            defs += [
                (member, f"{node.name}.{member.name}", True, holds)
                for member in node.body
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
    for node, qualname, method, holds in defs:
        special = node.name.startswith("__") and node.name.endswith("__")
        eligible = not (
            special
            or binds_the_name
            or _has_fixed_signature_decorator(node)
            or name.encode() in definition_text(node)
            or (method and node.name in CALLED_BY_AUTOGRAD)
        )
        calls = {
            t
            for c in ast.walk(node)
            if isinstance(c, ast.Call)
            for t in [_call_target(c, module, functions, bound, name)]
            if t is not None
        }
        found.append(_Definition((module, qualname), node.name, method, eligible, holds, calls))
    return found


def _calls_of(names: Iterable[str]) -> re.Pattern[bytes]:
    return re.compile(
        rb"\b(?:" + b"|".join(re.escape(n.encode()) for n in sorted(names)) + rb")\s*\("
    )


def _reexport_aliases(keys: Iterable[Key], packages: Mapping[str, bytes]) -> dict[Key, Key]:
    """Each name a package (``packages``: path -> bytes of its ``__init__.py``) re-exports one of
    the module-level functions ``keys`` under -> that function."""
    found = add_reexported_names({key: "\0".join(key) for key in keys}, packages)
    return {
        alias: (original.split("\0")[0], original.split("\0")[1])
        for alias, original in found.items()
    }


def thread_upward(
    contents: Mapping[str, bytes],
    threaded: Mapping[Key, str],
    packages: Mapping[str, bytes],
    name: str,
) -> Upward:
    """Which read-less functions of the tree ``contents`` (path -> bytes) get the parameter
    ``name``. ``threaded``: the functions and methods threaded because they read ((module, qualified
    name) -> keyword); ``packages``: the ``__init__.py`` files, through which packages re-export
    functions."""
    seeds = dict(threaded)
    known = {qualname.rpartition(".")[2] for _, qualname in seeds}
    definitions: dict[Key, _Definition] = {}
    by_callee: dict[str, list[_Definition]] = {}
    parsed: set[str] = set()
    frontier = set(known)
    while frontier:  # discovery: the files that call a name learned last round, each read once
        pattern = _calls_of(frontier)
        read: list[_Definition] = []
        for path, data in contents.items():
            if path in parsed or not pattern.search(data):
                continue
            parsed.add(path)
            try:
                read += _definitions_with_calls(path, data, name)
            except (
                SyntaxError,
                ValueError,
            ):  # the scan refused the run already; a file read for calls only
                continue
        for definition in read:
            definitions[definition.key] = definition
            for callee in {callee for _, _, callee in definition.calls}:
                by_callee.setdefault(callee, []).append(definition)
        learned = [
            d.name for d in read if d.eligible and any(callee in known for _, _, callee in d.calls)
        ]
        frontier = set()
        while (
            learned
        ):  # each name learned, then the callers of it among the definitions read so far
            short = learned.pop()
            if short not in known:
                known.add(short)
                frontier.add(short)
                learned += [d.name for d in by_callee.get(short, ()) if d.eligible]
    counts: dict[str, int] = {}
    for data in contents.values():
        for defined in _DEFINED.findall(data):
            counts[defined.decode()] = counts.get(defined.decode(), 0) + 1
    module_functions = [key for key, d in definitions.items() if not d.method] + [
        k for k in seeds if "." not in k[1]
    ]
    aliases = _reexport_aliases(module_functions, packages)
    chosen = {key for key, d in definitions.items() if d.eligible and key not in seeds and d.calls}

    def defining_target(kind: str, module: str, callee: str) -> tuple[str, str, str]:
        """A call's target, a function by the module defining it (not a package re-exporting it)."""
        return (
            ("f", *aliases.get((module, callee), (module, callee)))
            if kind == "f"
            else (kind, module, callee)
        )

    #: Each call target -> the definitions that call it.
    callers_of: dict[tuple[str, str, str], list[Key]] = {}
    for key, definition in definitions.items():
        definition.calls = {defining_target(*call) for call in definition.calls}
        for call in definition.calls:
            callers_of.setdefault(call, []).append(key)

    def methods_threaded_alike(given: set[Key]) -> dict[str, str]:
        """Method names every ``def`` of which (by count, over the whole tree) is in ``given``, with
        keyword ``name``."""
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
                for kind, module, callee in definitions[key].calls
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
