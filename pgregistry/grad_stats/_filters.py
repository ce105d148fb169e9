"""Duplicate filters: which rank counts a gradient, and which group the counted one is summed over.

Every rank classifies each of its local gradients by the parameter's roles
(:mod:`pgregistry.params`). A parameter that is not TP-sharded is replicated across its TP group
(the expert TP group for experts, ``allreduce is False``) and only TP rank 0 counts it; one that is
not GTP-sharded is likewise counted on GTP-remat rank 0 only; ``shared`` copies are never counted.
Dense grads are summed over ``mp`` (TP x GTP x PP), expert grads over ``tp_ep_pp_with_egtp_remat``
(expert TP x EP x expert GTP-remat x PP).

``None`` in the collection is an axis that is off (rank 0 of 1), never "ask the global grid":
reading the global rank for a model whose own grid turned TP or GTP off undercounts the norm (see
``docs/known_bugs.md``). Only an omitted group (:data:`~pgregistry.collection.UNSET`) reaches the
global grid, at the entry point's door (:mod:`pgregistry._runtime.resolve`), with a
:class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.
"""

from __future__ import annotations

from typing import Final

import attrs
import torch
from torch.distributed import ProcessGroup

from pgregistry._runtime.resolve import resolve_pg_collection
from pgregistry.collection import GroupName, ProcessGroupCollection, group_rank, group_size
from pgregistry.params import is_expert_param

__all__ = [
    "EXPERT_STATS_FIELDS",
    "STATS_FALLBACK",
    "StatsGroups",
    "is_counted",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_group_of",
]

STATS_FALLBACK: Final[tuple[GroupName, ...]] = ("ep", "expt_tp", "gtp_remat", "expt_gtp_remat")
"""The fields grad statistics read from the global grid (with a warning) when the collection leaves
them UNSET; ``tp`` and ``mp`` must be set."""

EXPERT_STATS_FIELDS: Final[tuple[GroupName, ...]] = ("ep", "expt_tp", "expt_gtp_remat")
"""The fields of :data:`STATS_FALLBACK` only expert parameters read.

A model without experts needs none of them.
"""

_EXPERT_REDUCE: Final = "tp_ep_pp_with_egtp_remat"


@attrs.frozen(slots=True, kw_only=True)
class StatsGroups:
    """The groups grad statistics need, and the collection they come from.

    Each group is a ProcessGroup or ``None`` (axis off); DTensor grads are matched to the
    collection's fields.

    Attributes:
        collection: the resolved collection.
        tp: with ``expt_tp``, decides which rank counts a gradient replicated over TP.
        expt_tp: the expert TP group.
        gtp_remat: with ``expt_gtp_remat``, decides which rank counts a gradient replicated over GTP
            remat.
        expt_gtp_remat: the expert GTP-remat group.
        dense_reduce: the collection's ``mp``: what counted dense gradients are summed over.
        expert_reduce: the collection's ``tp_ep_pp_with_egtp_remat``: what counted expert gradients
            are summed over.
    """

    collection: ProcessGroupCollection
    tp: ProcessGroup | None
    expt_tp: ProcessGroup | None
    gtp_remat: ProcessGroup | None
    expt_gtp_remat: ProcessGroup | None
    dense_reduce: ProcessGroup | None
    expert_reduce: ProcessGroup | None

    @classmethod
    def from_collection(cls, collection: ProcessGroupCollection) -> StatsGroups:
        """The groups of a resolved ``collection`` (:data:`STATS_FALLBACK` fields set at the door).

        Args:
            collection: a collection with ``tp``, ``mp``, ``expt_tp``, ``gtp_remat`` and
                ``expt_gtp_remat`` set (``None`` when the axis is off), and
                ``tp_ep_pp_with_egtp_remat``, or ``tp_ep_pp`` where expert GTP is off (the two then
                hold the same ranks, as Megatron-Core's optimizer assumes; a collection from a
                Megatron-Core release without the GTP fields has only ``tp_ep_pp``).

        Returns:
            The groups the duplicate filters and the reductions read, taken once.

        Raises:
            ValueError: ``tp``, ``mp`` or the expert reduction group is not set, naming the field.
            AttributeError: another of the fields above is not set, naming it.

        Example:
            >>> from pgregistry.collection import ProcessGroupCollection
            >>> fields = ("tp", "mp", "expt_tp", "tp_ep_pp", "gtp_remat", "expt_gtp_remat")
            >>> every_axis_off = ProcessGroupCollection(**dict.fromkeys(fields))
            >>> groups = StatsGroups.from_collection(every_axis_off)
            >>> groups.dense_reduce is None, groups.expert_reduce is None
            (True, True)
        """
        for name in ("tp", "mp"):
            _require_stats_group(collection, name)
        expt_gtp_remat = collection.get("expt_gtp_remat")
        return cls(
            collection=collection,
            tp=collection.get("tp"),
            expt_tp=collection.get("expt_tp"),
            gtp_remat=collection.get("gtp_remat"),
            expt_gtp_remat=expt_gtp_remat,
            dense_reduce=collection.get("mp"),
            expert_reduce=_expert_reduce_group(collection, expt_gtp_remat),
        )


def _require_stats_group(collection: ProcessGroupCollection, name: GroupName) -> None:
    if not collection.is_set(name):
        raise ValueError(
            f"grad statistics need the collection's {name!r} group, which is not set; set it "
            "(None when the axis is off) so a duplicate filter never reads the global grid for it"
        )


def _expert_reduce_group(
    collection: ProcessGroupCollection, expt_gtp_remat: ProcessGroup | None
) -> ProcessGroup | None:
    """The expert model-parallel group: ``tp_ep_pp_with_egtp_remat``.

    ``tp_ep_pp`` is the same ranks only when expert GTP is off, so it stands in for an unset one
    only then."""
    if collection.is_set(_EXPERT_REDUCE) or group_size(expt_gtp_remat) > 1:
        _require_stats_group(collection, _EXPERT_REDUCE)
        return collection.get(_EXPERT_REDUCE)
    _require_stats_group(collection, "tp_ep_pp")
    return collection.get("tp_ep_pp")


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a second copy of a parameter counted elsewhere (``shared=True``).

    Args:
        param: the parameter.

    Returns:
        Whether its gradient is counted as far as sharing goes.

    Example:
        >>> import torch
        >>> from pgregistry.params import mark_shared
        >>> param_is_not_shared(torch.zeros(2)), param_is_not_shared(mark_shared(torch.zeros(2)))
        (True, False)
    """
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, pg_collection: ProcessGroupCollection | None = None
) -> bool:
    """Whether this rank counts ``param``'s gradient as far as tensor parallelism goes.

    A TP-sharded parameter (``tensor_model_parallel``) is unique on every rank. Any other is
    replicated across its TP group and counted on rank 0 of it only; that group is ``expt_tp`` for
    an expert parameter (``allreduce is False``) and ``tp`` otherwise.

    Args:
        param: the parameter.
        pg_collection: the collection (default: the global grid, with a fallback warning, as for an
            UNSET field).

    Returns:
        ``True`` when this rank counts it.

    Raises:
        RuntimeError: no collection given and no global grid.
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a collection this rank is not a member of, or destroyed.

    Example:
        >>> import torch
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> tp_off = ProcessGroupCollection(tp=None, expt_tp=None)  # this rank alone is rank 0
        >>> param_is_not_tensor_parallel_duplicate(torch.zeros(2), tp_off)
        True
    """
    collection = resolve_pg_collection(
        pg_collection, owner="param_is_not_tensor_parallel_duplicate", fallback=("tp", "expt_tp")
    )
    groups = {True: collection.get("expt_tp"), False: collection.get("tp")}
    return _not_tp_duplicate(param, groups[is_expert_param(param)])


def param_is_not_gtp_duplicate(
    param: torch.Tensor, pg_collection: ProcessGroupCollection | None = None
) -> bool:
    """Whether this rank counts ``param``'s gradient as far as the GTP-remat axis goes.

    A GTP-sharded parameter (``is_gtp_weight_remat``) is unique per GTP rank. Any other is
    replicated across the GTP-remat group (``expt_gtp_remat`` for experts) and counted on its rank 0
    only.

    Args:
        param: the parameter.
        pg_collection: the collection (default: the global grid, with a fallback warning, as for an
            UNSET field).

    Returns:
        ``True`` when this rank counts it.

    Raises:
        RuntimeError: no collection given and no global grid.
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a collection this rank is not a member of, or destroyed.

    Example:
        >>> import torch
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> gtp_off = ProcessGroupCollection(gtp_remat=None, expt_gtp_remat=None)
        >>> param_is_not_gtp_duplicate(torch.zeros(2), gtp_off)
        True
    """
    owner = "param_is_not_gtp_duplicate"
    collection = resolve_pg_collection(
        pg_collection, owner=owner, fallback=("gtp_remat", "expt_gtp_remat")
    )
    groups = {True: collection.get("expt_gtp_remat"), False: collection.get("gtp_remat")}
    return _not_gtp_duplicate(param, groups[is_expert_param(param)])


def _not_tp_duplicate(param: torch.Tensor, tp_group: ProcessGroup | None) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) or group_rank(tp_group) == 0


def _not_gtp_duplicate(param: torch.Tensor, gtp_group: ProcessGroup | None) -> bool:
    return bool(getattr(param, "is_gtp_weight_remat", False)) or group_rank(gtp_group) == 0


def is_counted(param: torch.Tensor, groups: StatsGroups) -> bool:
    """Whether this rank counts ``param``'s gradient: not shared, not a TP or a GTP duplicate.

    Args:
        param: the parameter.
        groups: the statistics groups.

    Returns:
        ``True`` when this rank counts it.

    Example:
        >>> import torch
        >>> from pgregistry.collection import ProcessGroupCollection
        >>> from pgregistry.params import mark_shared
        >>> fields = ("tp", "mp", "expt_tp", "tp_ep_pp", "gtp_remat", "expt_gtp_remat")
        >>> groups = StatsGroups.from_collection(ProcessGroupCollection(**dict.fromkeys(fields)))
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> tied_copy = mark_shared(torch.nn.Parameter(torch.zeros(2)))
        >>> is_counted(weight, groups), is_counted(tied_copy, groups)
        (True, False)
    """
    return param_is_not_shared(param) and all(role_verdicts(param, groups))


def role_verdicts(param: torch.Tensor, groups: StatsGroups) -> tuple[bool, bool]:
    """Whether this rank counts ``param``'s grad as far as TP and GTP go, by its roles."""
    expert = is_expert_param(param)
    return (
        _not_tp_duplicate(param, groups.expt_tp if expert else groups.tp),
        _not_gtp_duplicate(param, groups.expt_gtp_remat if expert else groups.gtp_remat),
    )


def reduce_group_of(param: torch.Tensor, groups: StatsGroups) -> ProcessGroup | None:
    """The group ``param``'s counted gradient is summed over.

    Args:
        param: the parameter.
        groups: the statistics groups.

    Returns:
        ``groups.expert_reduce`` for a routed-expert parameter, else ``groups.dense_reduce``.
    """
    return groups.expert_reduce if is_expert_param(param) else groups.dense_reduce
