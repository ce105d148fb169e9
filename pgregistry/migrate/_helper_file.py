"""The fallback helper module ``pgregistry migrate --target megatron`` writes in the migrated tree.

Its text is :mod:`~pgregistry.migrate._fallback_helper`'s (a real module of this package, tested as
such) with the table of accessors written for the code's Megatron-Core release
(:func:`helper_text`). Where it goes: the module the user names, else ``_process_group_fallback`` in
the top package of the rewritten files (:func:`default_module`). A file already there is rewritten
only when this tool wrote it (:data:`MARKER`); any other is refused (:class:`HelperConflict`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from pgregistry._source.fields import fallback_table
from pgregistry.migrate._style import DEFAULT_WIDTH

__all__ = [
    "DEFAULT_NAME",
    "MARKER",
    "HelperConflict",
    "default_module",
    "helper_path",
    "helper_text",
    "table_text",
]

#: The module's name in the top package when the user names none.
DEFAULT_NAME = "_process_group_fallback"
#: The phrase that says this tool wrote a file (in the helper's docstring).
MARKER = b"Written by `pgregistry migrate` (do not edit"
_TEMPLATE = Path(__file__).with_name("_fallback_helper.py")
_TABLE = re.compile(r"(?<=# fmt: off\n).*?(?=# fmt: on\n)", re.S)
#: What the copy in a tree ends with: Megatron-Core's parallel_state imported where the rewritten
#: files imported it before, so the order modules load in is kept; last, so a module that
#: parallel_state imports, and that imports this one in turn, finds every function defined.
_AT_IMPORT = """

# Imported where the rewritten files imported it before (the order modules load in is kept);
# last, so that a module it imports, and that imports this one in turn, finds every function here.
try:
    from megatron.core import parallel_state
except ImportError:  # imported again (raising then) when a read falls back
    parallel_state = None
"""


class HelperConflict(ValueError):
    """The helper module's path holds a file this tool did not write."""


def _python_literal(value: object) -> str:
    """``value`` (a string, bool, tuple or dict of those) as Python, double-quoted like black."""
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_python_literal, value)) + ")"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items())
            + "}"
        )
    return repr(value)


def table_text(table: Mapping[tuple[str, str], tuple[str, dict[str, bool]]]) -> str:
    """The helper's ``FALLBACKS`` assignment for ``table``, an entry a line where it fits.

    An entry that does not fit is split as black splits it (the value's parts on one indented line,
    else one a line)."""
    lines = ["FALLBACKS: dict[tuple[str, str], tuple[str, dict[str, bool]]] = {"]
    for key, (accessor, keywords) in table.items():
        head = f"    {_python_literal(key)}: "
        one = f"{head}{_python_literal((accessor, keywords))},"
        inner = f"        {_python_literal(accessor)}, {_python_literal(keywords)}"
        if len(one) <= DEFAULT_WIDTH:
            lines.append(one)
        elif len(inner) <= DEFAULT_WIDTH:
            lines += [f"{head}(", inner, "    ),"]
        else:
            lines += [f"{head}(", f"        {_python_literal(accessor)},"]
            lines += [f"        {_python_literal(keywords)},", "    ),"]
    return "\n".join([*lines, "}"]) + "\n"


def helper_text(accessors: Iterable[str] = (), *, gtp_remat: bool = True) -> bytes:
    """The helper module's text, with the table of the release that defines ``accessors``.

    The template's text, importing ``parallel_state`` when it is imported; with none known, the
    template's own table (Megatron-Core 0.19's)."""
    text = _TEMPLATE.read_text(encoding="utf-8") + _AT_IMPORT
    names = list(accessors)
    if names:
        table = table_text(fallback_table(names, gtp_remat=gtp_remat))
        text = _TABLE.sub(lambda _: table, text, count=1)
    return text.encode("utf-8")


#: A top directory that is the import root of a ``src`` layout, not a package.
_SOURCE_ROOT = "src"


def helper_path(module: str, is_directory: Callable[[str], bool]) -> str:
    """The project path of ``module``: ``a.b.c`` -> ``a/b/c.py``, or ``src/a/b/c.py``.

    The ``src`` one in a ``src`` layout: where only ``src/a/b`` ``is_directory``."""
    path = module.replace(".", "/") + ".py"
    parent = path.rpartition("/")[0]
    if parent and not is_directory(parent) and is_directory(f"{_SOURCE_ROOT}/{parent}"):
        return f"{_SOURCE_ROOT}/{path}"
    return path


def default_module(paths: Iterable[str], is_package: Callable[[str], bool]) -> str:
    """``<top package>._process_group_fallback``, the top package holding all of ``paths``.

    The top package is the outermost directory holding every one of ``paths`` that ``is_package``
    (it has an ``__init__.py``; ``megatron/core`` for files of ``megatron/core/`` in a tree where
    ``megatron`` is a namespace package), named from the project root (from ``src/`` in a ``src``
    layout); the module is at the project root when there is none."""
    common: list[str] | None = None
    for path in paths:
        parts = path.split("/")[:-1]
        if common is None:
            common = parts
        else:
            same = 0
            while same < min(len(common), len(parts)) and common[same] == parts[same]:
                same += 1
            common = common[:same]
    top = common or []
    skipped = 1 if top[:1] == [_SOURCE_ROOT] and not is_package(_SOURCE_ROOT) else 0
    for end in range(skipped + 1, len(top) + 1):
        if is_package("/".join(top[:end])):
            return ".".join([*top[skipped:end], DEFAULT_NAME])
    return DEFAULT_NAME
