"""Which Megatron-Core the migrated code reads its groups from, as far as the field table depends on it.

Megatron-Core 0.19 added GTP remat: ``get_data_parallel_group(with_context_parallel=True)`` returns the group
spanning the GTP-remat peers (``dp_cp_gtp_remat``) unless ``with_gtp_remat=False``; before, it returned the plain
``dp_cp``. The same call is a different field in the two, so the rewrite must know which one the code runs
against: its own ``megatron/core/parallel_state.py`` (Megatron-LM migrating itself), else the one installed where
this Python imports from, else 0.19's table, said so in the report.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MegatronSource", "megatron_source"]

_PARALLEL_STATE = Path("megatron", "core", "parallel_state.py")
#: The accessor's signature names the flag when the release has GTP remat.
_WITH_GTP_REMAT = re.compile(rb"def get_data_parallel_group\([^)]*\bwith_gtp_remat\b")
#: Its module-level accessors: what the fallback helper may call (:mod:`~pgregistry.migrate._helper_file`).
_ACCESSOR = re.compile(rb"^def ((?:get|is)_\w+)\(", re.M)


@dataclass(frozen=True)
class MegatronSource:
    """Whether the code's Megatron-Core has GTP remat, what says so (a path, or that nothing did), and the
    accessors its ``parallel_state`` defines (none when it was not found)."""

    gtp_remat: bool
    where: str
    accessors: tuple[str, ...] = ()

    def describe(self) -> str:
        grid = "with GTP remat (0.19 on)" if self.gtp_remat else "without GTP remat (before 0.19)"
        return f"field table of a Megatron-Core {grid}: {self.where}"


def megatron_source(root: Path, search: Sequence[str] | None = None) -> MegatronSource:
    """The project's ``megatron/core/parallel_state.py`` under ``root``, else the first on ``search`` (default
    ``sys.path``), read as text (never imported)."""
    entries = [Path(entry or ".") for entry in (sys.path if search is None else search)]
    for base, label in [(root, "the project's"), *((entry, "the installed") for entry in entries)]:
        path = base / _PARALLEL_STATE
        try:
            text = path.read_bytes()
        except OSError:
            continue
        accessors = tuple(name.decode() for name in _ACCESSOR.findall(text))
        return MegatronSource(bool(_WITH_GTP_REMAT.search(text)), f"{label} {path}", accessors)
    return MegatronSource(True, "no megatron/core/parallel_state.py found: Megatron-Core 0.19's assumed")
