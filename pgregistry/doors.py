"""The doors ``pgregistry migrate`` writes: the collection a rewritten function was given, else the global grid,
with a :class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the function.

A function the tool threaded a collection into resolves it once, at the top of its body
(``pg_collection = resolve_megatron_collection(pg_collection, owner="pkg.mod.f", fields=("tp",))``), or inline
at a read that only runs as a fallback, so a caller that passes its groups never warns. Under
``-W error::pgregistry.ProcessGroupFallbackWarning`` each call that still relies on the global grid raises,
naming the function whose callers pass nothing yet.

Imports no torch and no Megatron-Core at module load: the generated code imports this module in files that
may load before either is configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pgregistry._resolve import resolve
from pgregistry.fallback import warn_fallback

if TYPE_CHECKING:
    from pgregistry.collection import ProcessGroupCollection

__all__ = ["resolve_collection", "resolve_megatron_collection"]


def resolve_megatron_collection(pg_collection: Any, *, owner: str, fields: Sequence[str] | None = None) -> Any:
    """``pg_collection`` when given; else, with the warning naming ``owner``, Megatron-Core's
    ``ProcessGroupCollection.use_mpu_process_groups(fields)``: exactly the groups ``parallel_state`` holds.

    ``fields`` (the ones the function reads) keeps the fallback from reading groups the function never needed
    (some assert when they were not initialised)."""
    if pg_collection is not None:
        return pg_collection
    warn_fallback(owner, "pg_collection")
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection

    return MegatronCollection.use_mpu_process_groups(None if fields is None else list(fields))


def resolve_collection(pg_collection: ProcessGroupCollection | None, *, owner: str) -> ProcessGroupCollection:
    """``pg_collection`` when given; else pgregistry's global grid, with the warning naming ``owner``
    (``RuntimeError`` when none is initialised); checked usable either way."""
    return resolve(pg_collection, owner=owner)
