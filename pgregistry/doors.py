"""What code that ``pgregistry migrate --target pgregistry`` rewrote calls: each read of the global
state became, in place, ``pg_group`` / ``pg_rank`` / ``pg_size`` / ``pg_read`` of the collection in
scope and a field: the collection's field when it sets it, else pgregistry's global grid, with a
:class:`~pgregistry.fallback.ProcessGroupFallbackWarning` naming the function that read (taken from
its frame).

Under ``-W error::pgregistry.ProcessGroupFallbackWarning`` each read that still relies on the global
grid raises, naming the function whose callers pass nothing yet. The same four functions, falling
back to Megatron-Core's ``parallel_state``, are what ``--target megatron`` writes into the migrated
tree (:mod:`pgregistry.migrate._fallback_helper`).

``resolve_megatron_collection`` and ``resolve_collection`` resolve a whole collection at once (what
earlier versions of the tool wrote at the top of a function); kept for code migrated then.

Imports no torch and no Megatron-Core at module load: the generated code imports this module in
files that may load before either is configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry._source.fields import GTP_REMAT_DP
from pgregistry.collection import NOT_MEMBER, check_field_names, group_size
from pgregistry.fallback import warn_fallback
from pgregistry.migrate._fallback_helper import reader_and_frame, value_of_kind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pgregistry.collection import ProcessGroupCollection

__all__ = [
    "pg_group",
    "pg_rank",
    "pg_read",
    "pg_size",
    "resolve_collection",
    "resolve_megatron_collection",
]


def _read_field(pg_collection: ProcessGroupCollection | None, field: str, kind: str) -> Any:
    owner, _ = reader_and_frame(3)  # the function that called pg_*
    if field != GTP_REMAT_DP:
        names = cast(Any, check_field_names([field]))  # ValueError naming an unknown field
        group = getattr(resolve_pg_collection(pg_collection, owner=owner, fallback=names), field)
        if group is NOT_MEMBER and kind != "group":
            # value_of_kind read NOT_MEMBER as a group: AttributeError: ... no attribute 'rank'
            raise ValueError(
                f"{owner} reads the {kind} of the {field!r} group, but this rank belongs to no "
                f"{field!r} group (NOT_MEMBER: a pipeline stage holding no embedding is in no "
                f"embedding group); test pg_group(pg_collection, {field!r}) is NOT_MEMBER first, "
                "where Megatron-Core's code tests is_rank_in_embedding_group()"
            )
        return value_of_kind(group, kind)
    resolved = resolve_pg_collection(pg_collection, owner=owner, fallback=("gtp_remat", "dp"))
    if group_size(cast("ProcessGroup | None", resolved.gtp_remat)) != 1:  # resolved: set
        raise ValueError(
            f"{owner} reads the data-parallel group with GTP remat and without CP, "
            "which no field of pgregistry's collection holds (its gtp_remat spans "
            "several ranks); read dp (with_gtp_remat=False) or dp_cp_gtp_remat"
        )
    return value_of_kind(resolved.dp, kind)


def pg_read(pg_collection: ProcessGroupCollection | None, field: str, kind: str) -> Any:
    """``kind`` of the group ``field``: the collection's, else the global grid's with the warning.

    The warning (:class:`~pgregistry.fallback.ProcessGroupFallbackWarning`) names the function that
    called. ``None`` (an axis that is off) is this rank alone.

    Args:
        pg_collection: the collection in scope, or ``None``.
        field: a collection field (``"tp"``, ``"dp_cp"``, ...).
        kind: ``src_rank``, ``first_rank``, ``last_rank``, ``next_rank``, ``prev_rank``,
            ``global_ranks``, ``first_stage``, ``last_stage``, or ``group`` / ``rank`` / ``size``.

    Returns:
        What ``kind`` names, of that group.

    Raises:
        ValueError: an unknown field (with a close match); the data-parallel group with GTP remat
            and without CP when GTP remat spans several ranks (no field holds it); a ``kind`` other
            than ``group`` of a field this rank is in no group of (``NOT_MEMBER``: ``embd`` on a
            middle pipeline stage).
        RuntimeError: no collection and no global grid.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from pgregistry import ParallelLayout, build
        >>> pg_collection = build(ParallelLayout(num_ranks=2, tp=2))
        >>> # was parallel_state.get_tensor_model_parallel_src_rank()
        >>> pg_read(pg_collection, "tp", "src_rank")
        0

    An axis that is off is this rank alone; a field this rank is in no group of refuses all but
    ``group``:

        >>> from pgregistry.collection import NOT_MEMBER, ProcessGroupCollection
        >>> pp_off = ProcessGroupCollection(pp=None)
        >>> [pg_read(pp_off, "pp", kind) for kind in ("rank", "size", "first_stage", "last_stage")]
        [0, 1, True, True]
        >>> middle_stage = ProcessGroupCollection(embd=NOT_MEMBER)
        >>> pg_read(middle_stage, "embd", "group") is NOT_MEMBER
        True
        >>> pg_read(middle_stage, "embd", "rank")
        Traceback (most recent call last):
        ValueError: ... but this rank belongs to no 'embd' group (NOT_MEMBER: ...
    """
    return _read_field(pg_collection, field, kind)


def pg_group(pg_collection: ProcessGroupCollection | None, field: str) -> Any:
    """The group ``field`` of the collection, else of the global grid with the warning.

    Args:
        pg_collection: the collection in scope, or ``None``.
        field: a collection field.

    Returns:
        The group, as :func:`pg_read` with ``kind="group"`` gives it.

    Raises:
        ValueError: as :func:`pg_read`.
        RuntimeError: as :func:`pg_read`.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> pg_collection = build(ParallelLayout(num_ranks=2, tp=2))
        >>> # was parallel_state.get_tensor_model_parallel_group()
        >>> torch.distributed.get_process_group_ranks(pg_group(pg_collection, "tp"))
        [0, 1]
    """
    return _read_field(pg_collection, field, "group")


def pg_rank(pg_collection: ProcessGroupCollection | None, field: str) -> int:
    """This rank in the group ``field`` of the collection, else of the global grid with the warning.

    Args:
        pg_collection: the collection in scope, or ``None``.
        field: a collection field.

    Returns:
        The rank, as :func:`pg_read` with ``kind="rank"`` gives it.

    Raises:
        ValueError: as :func:`pg_read`.
        RuntimeError: as :func:`pg_read`.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> pg_collection = build(ParallelLayout(num_ranks=2, tp=2))
        >>> # was parallel_state.get_tensor_model_parallel_rank()
        >>> pg_rank(pg_collection, "tp") == torch.distributed.get_rank()
        True
    """
    return int(_read_field(pg_collection, field, "rank"))


def pg_size(pg_collection: ProcessGroupCollection | None, field: str) -> int:
    """The size of the group ``field`` of the collection, else of the global grid with the warning.

    Args:
        pg_collection: the collection in scope, or ``None``.
        field: a collection field.

    Returns:
        The size, as :func:`pg_read` with ``kind="size"`` gives it.

    Raises:
        ValueError: as :func:`pg_read`.
        RuntimeError: as :func:`pg_read`.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> from pgregistry import ParallelLayout, build
        >>> pg_collection = build(ParallelLayout(num_ranks=2, tp=2))
        >>> # was parallel_state.get_tensor_model_parallel_world_size()
        >>> pg_size(pg_collection, "tp")
        2
    """
    return int(_read_field(pg_collection, field, "size"))


def resolve_megatron_collection(
    pg_collection: Any, *, owner: str, fields: Sequence[str] | None = None
) -> Any:
    """``pg_collection`` when given; else Megatron-Core's, with the warning naming ``owner``.

    Megatron-Core's is ``ProcessGroupCollection.use_mpu_process_groups(fields)``: exactly the groups
    ``parallel_state`` holds. Kept for code an earlier version of the tool migrated.

    Args:
        pg_collection: the collection in scope, or ``None``.
        owner: the function that reads, named in the warning.
        fields: the fields the function reads, so the fallback reads no group the function never
            needed (some assert when they were not initialised).

    Returns:
        The collection given, or Megatron-Core's.

    Example:
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> pg = ProcessGroupCollection(tp=None)
        >>> resolve_megatron_collection(pg, owner="my_layer", fields=["tp"]) is pg
        True
    """
    if pg_collection is not None:
        return pg_collection
    warn_fallback(owner, "pg_collection")
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection

    return MegatronCollection.use_mpu_process_groups(None if fields is None else list(fields))


def resolve_collection(
    pg_collection: ProcessGroupCollection | None, *, owner: str
) -> ProcessGroupCollection:
    """``pg_collection`` when given; else the global grid, with the warning naming ``owner``.

    Kept for code an earlier version of the tool migrated. The collection is checked usable either
    way.

    Args:
        pg_collection: the collection in scope, or ``None``.
        owner: the function that reads, named in the warning.

    Returns:
        The collection.

    Raises:
        RuntimeError: no collection given and no global grid.
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a collection this rank is not a member of, or destroyed.

    Example:
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> pg = ProcessGroupCollection(tp=None)
        >>> resolve_collection(pg, owner="my_layer") is pg
        True
    """
    return resolve_pg_collection(pg_collection, owner=owner)
