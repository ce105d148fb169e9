"""Names a ``match`` statement's patterns bind, which libcst's scopes (1.9) do not record.

``case ps:``, ``case [*ps]``, ``case {**ps}``, ``case Point(x=ps)`` and ``case _ as ps`` bind ``ps``
in the function (or module) holding the ``match``, as an assignment does: a read
``ps.get_tensor_model_parallel_rank()`` after it is called on the subject, not on the
``parallel_state`` the module imported as ``ps``. libcst resolves such a name to the import, so the
plan asks here first. Pure: no I/O.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

__all__ = ["match_capture_owner", "match_captures"]

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _names_bound_by(pattern: ast.pattern) -> Iterator[str]:
    """The names ``pattern`` and the patterns inside it bind."""
    for node in ast.walk(pattern):
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name is not None:
            yield node.name
        elif isinstance(node, ast.MatchMapping) and node.rest is not None:
            yield node.rest


def _captures_by_scope(
    node: ast.AST, owner: ast.AST | None
) -> Iterator[tuple[str, ast.AST | None]]:
    """(name, the function binding it; None: the module) of each capture under ``node``.

    A capture in a class body binds a class attribute, which no method sees: not yielded."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _FUNCTIONS):
            yield from _captures_by_scope(child, child)
        elif isinstance(child, ast.ClassDef):
            for name, scope in _captures_by_scope(child, child):
                if not isinstance(scope, ast.ClassDef):
                    yield name, scope
        else:
            if isinstance(child, ast.match_case):
                yield from ((name, owner) for name in _names_bound_by(child.pattern))
            yield from _captures_by_scope(child, owner)


def match_captures(syntax: ast.Module) -> list[tuple[str, ast.AST | None]]:
    """(name, the function binding it; None: the module) of each capture in the file ``syntax``.

    Found once per file (a walk per read would grow with the square of its size)."""
    if not any(isinstance(node, ast.Match) for node in ast.walk(syntax)):
        return []
    return list(_captures_by_scope(syntax, None))


def match_capture_owner(
    captures: list[tuple[str, ast.AST | None]], name: str, line: int
) -> str | None:
    """Where a ``match`` captures ``name`` so that a read on ``line`` may see it, or None.

    ``captures``: :func:`match_captures` of the file. ``"the module"`` for a capture at module
    level (it binds a global), else the name of the function whose local it is, one that holds
    ``line`` (the read, or a closure reading it)."""
    for captured, scope in captures:
        if captured != name:
            continue
        if scope is None:
            return "the module"
        if isinstance(scope, _FUNCTIONS):
            end = scope.end_lineno if scope.end_lineno is not None else scope.lineno
            if scope.lineno <= line <= end:
                return scope.name
    return None
