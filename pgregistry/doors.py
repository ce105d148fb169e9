"""What code that ``pgregistry migrate --target pgregistry`` rewrote calls: each read of the global state became,
in place, ``pg_group`` / ``pg_rank`` / ``pg_size`` / ``pg_read`` of the collection in scope and a field: the
collection's field when it sets it, else pgregistry's global grid, with a
:class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the function that read (taken from its frame).

Under ``-W error::pgregistry.ProcessGroupFallbackWarning`` each read that still relies on the global grid
raises, naming the function whose callers pass nothing yet. The same four functions, falling back to
Megatron-Core's ``parallel_state``, are what ``--target megatron`` writes into the migrated tree
(:mod:`pgregistry.migrate._fallback_helper`).

``resolve_megatron_collection`` and ``resolve_collection`` resolve a whole collection at once (what earlier
versions of the tool wrote at the top of a function); kept for code migrated then.

Imports no torch and no Megatron-Core at module load: the generated code imports this module in files that
may load before either is configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry._source.fields import GTP_REMAT_DP
from pgregistry.collection import check_field_names, group_size
from pgregistry.fallback import warn_fallback
from pgregistry.migrate._fallback_helper import reader, value

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.collection import ProcessGroupCollection

__all__ = ["pg_group", "pg_rank", "pg_read", "pg_size", "resolve_collection", "resolve_megatron_collection"]


def _read_field(pg_collection: ProcessGroupCollection | None, field: str, kind: str) -> Any:
    owner, _ = reader(3)  # the function that called pg_*
    if field != GTP_REMAT_DP:
        names = cast(Any, check_field_names([field]))  # ValueError naming an unknown field
        return value(getattr(resolve_pg_collection(pg_collection, owner=owner, fallback=names), field), kind)
    resolved = resolve_pg_collection(pg_collection, owner=owner, fallback=("gtp_remat", "dp"))
    if group_size(cast("ProcessGroup | None", resolved.gtp_remat)) != 1:  # resolved: set
        raise ValueError(
            f"{owner} reads the data-parallel group with GTP remat and without CP, which no field of pgregistry's "
            "collection holds (its gtp_remat spans several ranks); read dp (with_gtp_remat=False) or dp_cp_gtp_remat"
        )
    return value(resolved.dp, kind)


def pg_read(pg_collection: ProcessGroupCollection | None, field: str, kind: str) -> Any:
    """``kind`` of the group ``field``: the collection's, else the global grid's with the warning.

    ``kind`` is ``src_rank``, ``first_rank``, ``last_rank``, ``next_rank``, ``prev_rank``,
    ``global_ranks``, ``first_stage``, ``last_stage``, or ``group`` / ``rank`` / ``size``;
    ``RuntimeError`` when there is no collection and no global grid. ``None`` (an axis that is off)
    is this rank alone.
    """
    return _read_field(pg_collection, field, kind)


def pg_group(pg_collection: ProcessGroupCollection | None, field: str) -> Any:
    """The group ``field`` (see :func:`pg_read`)."""
    return _read_field(pg_collection, field, "group")


def pg_rank(pg_collection: ProcessGroupCollection | None, field: str) -> int:
    """This rank in the group ``field`` (see :func:`pg_read`)."""
    return int(_read_field(pg_collection, field, "rank"))


def pg_size(pg_collection: ProcessGroupCollection | None, field: str) -> int:
    """The size of the group ``field`` (see :func:`pg_read`)."""
    return int(_read_field(pg_collection, field, "size"))


def resolve_megatron_collection(pg_collection: Any, *, owner: str, fields: Sequence[str] | None = None) -> Any:
    """``pg_collection`` when given; else Megatron-Core's, with the warning naming ``owner``.

    Megatron-Core's is ``ProcessGroupCollection.use_mpu_process_groups(fields)``: exactly the groups
    ``parallel_state`` holds.

    ``fields`` (the ones the function reads) keeps the fallback from reading groups the function never needed
    (some assert when they were not initialised)."""
    if pg_collection is not None:
        return pg_collection
    warn_fallback(owner, "pg_collection")
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection

    return MegatronCollection.use_mpu_process_groups(None if fields is None else list(fields))


def resolve_collection(pg_collection: ProcessGroupCollection | None, *, owner: str) -> ProcessGroupCollection:
    """``pg_collection`` when given; else the global grid, with the warning naming ``owner``.

    ``RuntimeError`` when none is initialised; checked usable either way.
    """
    return resolve_pg_collection(pg_collection, owner=owner)
