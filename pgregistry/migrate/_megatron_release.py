"""Which Megatron-Core migrated code reads its groups from, as far as the field table depends on it.

Megatron-Core 0.19 added GTP remat: ``get_data_parallel_group(with_context_parallel=True)`` returns
the group spanning the GTP-remat peers (``dp_cp_gtp_remat``) unless ``with_gtp_remat=False``;
before, it returned the plain ``dp_cp``. The same call is a different field in the two, so the
rewrite must know which one the code runs against: its own ``megatron/core/parallel_state.py``
(Megatron-LM migrating itself), else the one installed where this Python imports from, else 0.19's
table, said so in the report.

The same release's ``ProcessGroupCollection.use_mpu_process_groups`` (its
``process_groups_config.py``, next to ``parallel_state.py``) says which getter, with which keywords,
a shim reads each field with (:func:`shim_getters`): a shim dissolved into field reads falls back to
exactly that (:mod:`._shims`).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pgregistry._source.files import read_regular_file
from pgregistry.migrate._virtual_stages import has_virtual_stage_form

__all__ = [
    "MegatronSource",
    "ShimGetters",
    "find_installed_shim_getters",
    "megatron_source",
    "shim_getters",
]

_PARALLEL_STATE = Path("megatron", "core", "parallel_state.py")
_PROCESS_GROUPS_CONFIG = Path("megatron", "core", "process_groups_config.py")
#: Field -> (the ``parallel_state`` getter ``use_mpu_process_groups`` calls for it, its keyword
#: arguments).
ShimGetters = dict[str, tuple[str, dict[str, object]]]
#: The accessor's signature names the flag when the release has GTP remat.
_WITH_GTP_REMAT = re.compile(rb"def get_data_parallel_group\([^)]*\bwith_gtp_remat\b")
#: Its module-level accessors: what the fallback helper may call
#: (:mod:`~pgregistry.migrate._helper_file`).
_ACCESSOR = re.compile(rb"^def ((?:get|is)_\w+)\(", re.M)


@dataclass(frozen=True)
class MegatronSource:
    """Whether the code's Megatron-Core has GTP remat, what says so, and its accessors.

    What says so is a path, or that nothing did; the accessors are those its ``parallel_state``
    defines (none when it was not found)."""

    gtp_remat: bool
    where: str
    accessors: tuple[str, ...] = ()
    #: :func:`shim_getters` of the release's ``process_groups_config.py`` (None: not found).
    shims: ShimGetters | None = None
    #: Whether its pipeline-stage accessors are the form the fallback helper reproduces for
    #: ``ignore_virtual=False`` (:mod:`._virtual_stages`; nothing found: 0.19's, which is).
    virtual_stages: bool = True

    def describe(self) -> str:
        grid = "with GTP remat (0.19 on)" if self.gtp_remat else "without GTP remat (before 0.19)"
        return f"field table of a Megatron-Core {grid}: {self.where}"


def megatron_source(root: Path, search: Sequence[str] | None = None) -> MegatronSource:
    """The project's ``megatron/core/parallel_state.py``, else the first one on ``search``.

    The project's is under ``root``; ``search`` defaults to ``sys.path``. Read as text, never
    imported."""
    entries = [Path(entry or ".") for entry in (sys.path if search is None else search)]
    for base, label in [(root, "the project's"), *((entry, "the installed") for entry in entries)]:
        path = base / _PARALLEL_STATE
        try:
            text, _ = read_regular_file(path)  # a FIFO there is passed over, not waited on
        except OSError:
            continue
        accessors = tuple(name.decode() for name in _ACCESSOR.findall(text))
        return MegatronSource(
            bool(_WITH_GTP_REMAT.search(text)),
            f"{label} {path}",
            accessors,
            _shims_beside(base),
            has_virtual_stage_form(text),
        )
    return MegatronSource(
        True, "no megatron/core/parallel_state.py found: Megatron-Core 0.19's assumed"
    )


def _shims_beside(base: Path) -> ShimGetters | None:
    try:
        return shim_getters(read_regular_file(base / _PROCESS_GROUPS_CONFIG)[0])
    except (OSError, SyntaxError, ValueError):
        return None


def find_installed_shim_getters() -> ShimGetters | None:
    """:func:`shim_getters` of the first ``megatron/core/process_groups_config.py`` on ``sys.path``.

    None when there is none."""
    for entry in sys.path:
        found = _shims_beside(Path(entry or "."))
        if found is not None:
            return found
    return None


def shim_getters(text: bytes) -> ShimGetters:
    """What ``use_mpu_process_groups`` in ``text`` (a ``process_groups_config.py``) calls per field.

    The entries of its ``pg_to_func`` table of the form ``partial(parallel_state.<getter>,
    <keyword>=<literal>...)`` (one that is anything else, ``lambda: None``, is not listed). Read as
    text, never imported."""
    found: ShimGetters = {}
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "use_mpu_process_groups"):
            continue
        for statement in ast.walk(node):
            if not (
                isinstance(statement, ast.Assign)
                and isinstance(statement.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "pg_to_func" for t in statement.targets)
            ):
                continue
            for key, value in zip(statement.value.keys, statement.value.values, strict=True):
                getter = _partial_getter(value)
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and getter is not None
                ):
                    found[key.value] = getter
    return found


def _partial_getter(node: ast.expr) -> tuple[str, dict[str, object]] | None:
    """(getter, keywords) of ``partial(parallel_state.<getter>, k=<literal>, ...)``.

    None for another form.
    """
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "partial"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Attribute)
    ):
        return None
    keywords: dict[str, object] = {}
    for keyword in node.keywords:
        if keyword.arg is None or not isinstance(keyword.value, ast.Constant):
            return None
        keywords[keyword.arg] = keyword.value.value
    return node.args[0].attr, keywords
