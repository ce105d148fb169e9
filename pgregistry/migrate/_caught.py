"""Calls a handler around them may catch a fallback warning raised as an error.

The docs ask a test suite to run with ``-W error::pgregistry.ProcessGroupFallbackWarning``, so that
each fallback of a rewritten read raises where it is and names its function. A read inside ``try:
... except Exception:`` (or ``with suppress(Exception):``) has that raise caught there: the code
takes the handler's path, which the original, reading the global state without a warning, did not
take, and the fallback goes unreported (Megatron-Bridge 0.6.2's ``preprocess_packed_batch`` then
loads images on every pipeline stage). Such a read stays as it is. A handler may catch the warning
when it is bare, or names one of its classes (``Exception``, ``Warning``, ...), or something that
is not a class (a variable holding a tuple: not known). A call in a nested function, lambda or class
body does not run in the ``try``. Pure: no I/O.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pgregistry.migrate._facts import last_name

__all__ = ["CAUGHT_REASON", "calls_a_handler_may_catch"]

CAUGHT_REASON = (
    "inside a try (or suppress) whose handler catches warnings: under -W error its fallback "
    "warning would be caught there, taking the handler's path unreported"
)
#: The classes a fallback warning is an instance of (pgregistry's ``ProcessGroupFallbackWarning``
#: and the helper's own derive from ``UserWarning``).
_WARNING_CLASSES = frozenset(
    {"BaseException", "Exception", "Warning", "UserWarning", "ProcessGroupFallbackWarning"}
)
_TRIES = (ast.Try, getattr(ast, "TryStar", ast.Try))  # ``except*`` from Python 3.11
_NOT_RUN_THERE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def calls_a_handler_may_catch(module: ast.Module) -> frozenset[tuple[int, int]]:
    """(line, 1-based column) of each call of ``module`` a handler around it may catch a warning of.

    Inside the body of a ``try`` with such a handler, or of a ``with`` holding ``suppress(...)`` of
    such a class."""
    found: set[tuple[int, int]] = set()
    for node in ast.walk(module):
        if isinstance(node, _TRIES) and any(_may_catch(h.type) for h in node.handlers):
            body = node.body
        elif isinstance(node, ast.With | ast.AsyncWith) and any(
            _suppresses_a_warning(item.context_expr) for item in node.items
        ):
            body = node.body
        else:
            continue
        for statement in body:
            found.update((c.lineno, c.col_offset + 1) for c in _calls_run_in(statement))
    return frozenset(found)


def _calls_run_in(node: ast.AST) -> Iterator[ast.Call]:
    """The calls ``node`` runs itself (not those of a function, lambda or class it defines)."""
    if isinstance(node, ast.Call):
        yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _NOT_RUN_THERE):
            yield from _calls_run_in(child)


def _may_catch(handler: ast.expr | None) -> bool:
    """Whether ``except <handler>`` may catch a fallback warning (bare: it does)."""
    if handler is None:
        return True
    names = handler.elts if isinstance(handler, ast.Tuple) else [handler]
    return any(_may_name_a_warning_class(last_name(n)) for n in names)


def _may_name_a_warning_class(name: str | None) -> bool:
    """Whether a handler's name may be a class of the fallback warning.

    One of them, or not known to be another (not a name, or a lowercase name: a variable that may
    hold ``Exception``). A capitalised name is taken for a class (another exception class cannot be
    a base of ``UserWarning``)."""
    return name is None or name in _WARNING_CLASSES or name[:1].islower()


def _suppresses_a_warning(expression: ast.expr) -> bool:
    return (
        isinstance(expression, ast.Call)
        and last_name(expression.func) == "suppress"
        and any(_may_catch(a) for a in expression.args)
    )
