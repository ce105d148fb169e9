"""Unused imports the rewrite keeps for the error they raise where their package is missing.

Without Megatron-Core installed, ``from megatron.core import parallel_state`` raises
``ModuleNotFoundError`` where it runs: at import for a module-level one, at each call for one in a
function, whether or not the read that used it runs (a fallback helper given a group, a branch not
taken). The rewritten reads no longer use the name, and the fallback helper's own import of
``parallel_state`` is guarded (it serves files that import it lazily too), so dropping the import
let the module import, or the call return, where it failed. Such an import stays, marked
``# noqa: F401`` (linters take it for unused), unless an import of the same package that stays
fails first at the same point: an earlier one of its block, or one among the imports of that package
right after it (nothing else runs between them). An import of the migrated tree itself (relative,
or of one of its modules) cannot be missing where the file is: it goes. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

import libcst as cst

from pgregistry.migrate._plan import bound_name, import_module_text

__all__ = ["binds_any", "imports_kept_for_their_error", "in_tree", "with_noqa_marker"]

#: The marker that tells linters (ruff, flake8) an unused import is meant.
_NOQA = "# noqa: F401"
#: How many leading parts of a module's name name the package whose absence it fails on:
#: ``megatron.core`` (``megatron`` is a namespace package that Megatron-Bridge shares).
_PACKAGE_PARTS = 2


def in_tree(module: str, modules: AbstractSet[str]) -> bool:
    """Whether ``module`` (absolute, or relative: ``.x``) is of the migrated tree's ``modules``.

    A module of the tree, a package above one (``megatron`` of ``megatron.core.x``) or a module
    below one; ``src.`` of a ``src`` layout's names left out."""
    if module.startswith("."):
        return True
    for held in modules:
        name = held.removeprefix("src.")
        if module == name or name.startswith(module + ".") or module.startswith(name + "."):
            return True
    return False


def _fails_alike(dropped: str, kept: str) -> bool:
    """Whether importing ``kept`` fails as importing ``dropped`` does where its package is missing.

    Both are in the package the first two parts of ``dropped`` name (one part for a module of
    one)."""
    package = ".".join(dropped.split(".")[:_PACKAGE_PARTS])
    return kept == package or kept.startswith(package + ".")


def _import_units(
    statement: cst.CSTNode, unused: AbstractSet[str]
) -> list[tuple[str, bool]] | None:
    """(module, whether the rewrite drops it) of each module ``statement`` imports, in order.

    None when ``statement`` is not a line of imports only. A ``from`` import is one (dropped when
    every name it binds is unused; never a star import), an ``import a, b`` one a name."""
    if not isinstance(statement, cst.SimpleStatementLine) or not all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    ):
        return None
    units: list[tuple[str, bool]] = []
    for small in statement.body:
        if isinstance(small, cst.ImportFrom):
            dropped = not isinstance(small.names, cst.ImportStar) and all(
                bound_name(alias) in unused for alias in small.names
            )
            units.append((import_module_text(small), dropped))
        elif isinstance(small, cst.Import):
            units += [(alias.evaluated_name, bound_name(alias) in unused) for alias in small.names]
    return units


def binds_any(statement: cst.SimpleStatementLine, names: AbstractSet[str]) -> bool:
    """Whether ``statement``'s imports bind one of ``names`` (one left unused, in a ``try``)."""
    return any(
        bound_name(alias) in names
        for small in statement.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
        and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    )


def imports_kept_for_their_error(
    block: Sequence[cst.CSTNode], unused: AbstractSet[str], of_tree: Callable[[str], bool]
) -> set[int]:
    """The ids of ``block``'s import statements that stay though the rewrite left them unused.

    Of a run of such imports of one package, only the first: it fails first.

    ``block``: the statements of one body (a module's, a function's, a branch's) outside any
    ``try`` / ``with`` (whose imports all stay); ``unused``: the names the rewrite left unread;
    ``of_tree``: whether a module is of the migrated tree (:func:`in_tree`)."""
    kept: list[str] = []  # modules the statements so far import and keep
    waiting: list[tuple[int, str]] = []  # dropped imports not yet followed by one failing alike
    stay: set[int] = set()
    for statement in block:
        units = _import_units(statement, unused)
        if units is None:  # something else runs: an import waiting would fail after it
            stay.update(at for at, _ in waiting)
            waiting = []
            continue
        for module, dropped in units:
            if dropped:
                earlier = [*kept, *(waiting_module for _, waiting_module in waiting)]
                if not of_tree(module) and not any(_fails_alike(module, e) for e in earlier):
                    waiting.append((id(statement), module))
                continue
            kept.append(module)
            stay.update(
                at for at, waiting_module in waiting if not _fails_alike(waiting_module, module)
            )
            waiting = []
    return stay | {at for at, _ in waiting}


#: A ``noqa`` directive naming its codes (``noqa: E402`` after a ``#``), up to the last code.
_NOQA_CODES = re.compile(r"#\s*noqa:\s*[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*", re.I)


def _with_marker(comment: cst.Comment | None) -> cst.Comment:
    """``comment`` with the marker added: after the codes of a ``noqa`` naming others (E402).

    Kept as it is where it holds a bare ``# noqa`` or one naming F401 already."""
    if comment is None:
        return cst.Comment(_NOQA)
    codes = _NOQA_CODES.search(comment.value)
    if codes is not None and "F401" not in codes.group().upper():
        end = codes.end()
        return cst.Comment(f"{comment.value[:end]}, F401{comment.value[end:]}")
    if "noqa" in comment.value.lower():
        return comment
    return cst.Comment(f"{comment.value}  {_NOQA}")


def _with_marked_line(line: cst.TrailingWhitespace) -> cst.TrailingWhitespace:
    whitespace = line.whitespace if line.comment is not None else cst.SimpleWhitespace("  ")
    return line.with_changes(whitespace=whitespace, comment=_with_marker(line.comment))


def with_noqa_marker(statement: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """``statement`` (an import kept for its error) with ``# noqa: F401`` on its first line.

    The first line of a parenthesised ``from m import (`` is where flake8 and ruff look for it."""
    small = statement.body[0]
    if (
        len(statement.body) == 1
        and isinstance(small, cst.ImportFrom)
        and isinstance(small.lpar, cst.LeftParen)
        and isinstance(small.lpar.whitespace_after, cst.ParenthesizedWhitespace)
    ):
        after = small.lpar.whitespace_after
        lpar = small.lpar.with_changes(
            whitespace_after=after.with_changes(first_line=_with_marked_line(after.first_line))
        )
        return statement.with_changes(body=[small.with_changes(lpar=lpar)])
    return statement.with_changes(
        trailing_whitespace=_with_marked_line(statement.trailing_whitespace)
    )
