"""What a module's imports bind: the names its module-level imports make, read with :mod:`ast`.

For the files' facts (:mod:`~pgregistry.migrate._facts`, through which the rules decided between
the phases resolve a call or a base class); a relative import's absolute module is the scanner's
(:func:`~pgregistry._source.scanner.absolute_module`). Pure: no I/O.
"""

from __future__ import annotations

import ast

from pgregistry._source.scanner import absolute_module

__all__ = ["import_bindings"]


def import_bindings(tree: ast.Module, package: list[str]) -> dict[str, str]:
    """The module-level import bindings of ``tree``.

    Bound name -> the module or ``module:name`` it stands for.
    """
    bound: dict[str, str] = {}
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.partition(".")[0]] = (
                    alias.name if alias.asname else alias.name.partition(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node.module, node.level, package)
            bound.update(
                {a.asname or a.name: f"{module}:{a.name}" for a in node.names if a.name != "*"}
            )
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return bound
