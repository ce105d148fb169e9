"""Duplicate filters: which rank counts a gradient, and which group the counted gradient is summed over.

Every rank classifies each of its local gradients by the parameter's roles (:mod:`pgregistry.params`). A parameter
that is not TP-sharded is replicated across its TP group (the expert TP group for experts, ``allreduce is False``)
and only TP rank 0 counts it; one that is not GTP-sharded is likewise counted on GTP-remat rank 0 only; ``shared``
copies are never counted. Dense grads are summed over ``mp`` (TP x GTP x PP), expert grads over
``tp_ep_pp_with_egtp_remat`` (expert TP x EP x expert GTP-remat x PP).

``None`` in the collection is an axis that is off (rank 0 of 1), never "ask the global grid": reading the global
rank for a model whose own grid turned TP or GTP off undercounts the norm (see ``docs/known_bugs.md``). Only an
omitted group (:data:`~pgregistry.collection.UNSET`) reaches the global grid, through :mod:`pgregistry.fallback`,
with a :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs
import torch
from torch.distributed import ProcessGroup

from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, Unset, group_rank, group_size
from pgregistry.fallback import resolve_gtp_remat_group, resolve_process_groups
from pgregistry.params import is_expert_param
from pgregistry.resolver import resolve_collection

__all__ = [
    "StatsGroups",
    "is_counted",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_group_of",
    "set_duplicate_filter_groups",
]


@attrs.frozen(slots=True, kw_only=True)
class StatsGroups:
    """The groups grad statistics need, resolved once; each a ProcessGroup or ``None`` (axis off).

    ``tp``/``expt_tp`` and ``gtp_remat``/``expt_gtp_remat`` decide which rank counts a replicated gradient;
    ``dense_reduce`` (the collection's ``mp``) and ``expert_reduce`` (its ``tp_ep_pp_with_egtp_remat``) are what
    the counted gradients are summed over.
    """

    tp: ProcessGroup | None
    expt_tp: ProcessGroup | None
    gtp_remat: ProcessGroup | None
    expt_gtp_remat: ProcessGroup | None
    dense_reduce: ProcessGroup | None
    expert_reduce: ProcessGroup | None

    @classmethod
    def from_collection(cls, pg_collection: ProcessGroupCollection | None) -> StatsGroups:
        """Resolve the groups of ``pg_collection``.

        ``tp`` must be set (``None`` when TP is off): ``ValueError`` otherwise. An unset ``expt_tp`` is ``tp``
        (expert TP defaults to TP). Unset ``gtp_remat``/``expt_gtp_remat`` resolve through
        :func:`~pgregistry.fallback.resolve_gtp_remat_group`, as the model's layers resolve them. ``mp`` must be
        set, and ``tp_ep_pp_with_egtp_remat``, or ``tp_ep_pp`` where expert GTP is off (the two then hold the same
        ranks, as Megatron-Core's optimizer assumes): ``ValueError`` naming the field otherwise.
        ``pg_collection=None`` is the global grid, with a fallback warning
        (:func:`~pgregistry.resolver.resolve_collection`).
        """
        owner = "StatsGroups.from_collection"
        pg_collection = resolve_collection(pg_collection, owner=owner)
        for name in ("tp", "mp"):
            _require_stats_group(pg_collection, name)
        tp, mp = pg_collection.get("tp"), pg_collection.get("mp")
        expt_tp = pg_collection.get_or("expt_tp", tp)
        expt_gtp_remat = resolve_gtp_remat_group(pg_collection, True, owner=owner)
        expert_reduce = _expert_reduce_group(pg_collection, expt_gtp_remat)
        return cls(
            tp=tp,
            expt_tp=expt_tp,
            gtp_remat=resolve_gtp_remat_group(pg_collection, False, owner=owner),
            expt_gtp_remat=expt_gtp_remat,
            dense_reduce=mp,
            expert_reduce=expert_reduce,
        )


_EXPERT_REDUCE: Final = "tp_ep_pp_with_egtp_remat"


def _require_stats_group(pg_collection: ProcessGroupCollection, name: GroupName) -> None:
    if not pg_collection.is_set(name):
        raise ValueError(
            f"grad statistics need the collection's {name!r} group, which is not set; set it (None when "
            "the axis is off) so a duplicate filter never reads the global grid for it"
        )


def _expert_reduce_group(
    pg_collection: ProcessGroupCollection, expt_gtp_remat: ProcessGroup | None
) -> ProcessGroup | None:
    """The expert model-parallel group: ``tp_ep_pp_with_egtp_remat``; ``tp_ep_pp`` is the same ranks only when
    expert GTP is off, so it stands in for an unset one only then (a collection written before the field)."""
    if pg_collection.is_set(_EXPERT_REDUCE) or group_size(expt_gtp_remat) > 1:
        _require_stats_group(pg_collection, _EXPERT_REDUCE)
        return pg_collection.get(_EXPERT_REDUCE)
    _require_stats_group(pg_collection, "tp_ep_pp")
    return pg_collection.get("tp_ep_pp")


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a second copy of a parameter counted elsewhere (``shared=True``)."""
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: ProcessGroup | None | Unset = UNSET,
    expert_tp_group: ProcessGroup | None | Unset = UNSET,
    *,
    use_global_fallback: bool = True,
) -> bool:
    """Whether this rank counts ``param``'s gradient as far as tensor parallelism goes.

    A TP-sharded parameter (``tensor_model_parallel``) is unique on every rank. Any other is replicated across
    its TP group and counted on rank 0 of it only; that group is ``expert_tp_group`` for an expert parameter
    (``allreduce is False``) and ``tp_group`` otherwise. ``None`` is a TP axis that is off (rank 0). An omitted
    group (:data:`UNSET`) is read from the global grid with a fallback warning when ``use_global_fallback``;
    otherwise it raises ``ValueError``.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    expert = is_expert_param(param)
    field: GroupName = "expt_tp" if expert else "tp"
    return _is_first_replica(
        expert_tp_group if expert else tp_group,
        "expert_tp_group" if expert else "tp_group",
        use_global_fallback,
        lambda: resolve_process_groups(None, (field,), owner="param_is_not_tensor_parallel_duplicate")[field],
    )


def param_is_not_gtp_duplicate(
    param: torch.Tensor,
    gtp_group: ProcessGroup | None | Unset = UNSET,
    expert_gtp_group: ProcessGroup | None | Unset = UNSET,
    *,
    use_global_fallback: bool = True,
) -> bool:
    """Whether this rank counts ``param``'s gradient as far as the GTP-remat axis goes.

    A GTP-sharded parameter (``is_gtp_weight_remat``) is unique per GTP rank. Any other is replicated across the
    GTP-remat group (``expert_gtp_group`` for experts) and counted on its rank 0 only. ``None`` is an axis that
    is off. An omitted group resolves through :func:`~pgregistry.fallback.resolve_gtp_remat_group` (which warns
    when the global GTP group has more than one rank) when ``use_global_fallback``; otherwise ``ValueError``.
    """
    if getattr(param, "is_gtp_weight_remat", False):
        return True
    expert = is_expert_param(param)
    return _is_first_replica(
        expert_gtp_group if expert else gtp_group,
        "expert_gtp_group" if expert else "gtp_group",
        use_global_fallback,
        lambda: resolve_gtp_remat_group(None, expert, owner="param_is_not_gtp_duplicate"),
    )


def _is_first_replica(
    group: ProcessGroup | None | Unset,
    argument: str,
    use_global_fallback: bool,
    global_group: Callable[[], ProcessGroup | None],
) -> bool:
    """Whether this rank is rank 0 of ``group``, over which a parameter is replicated (``None``: the axis is off).

    An omitted ``group`` (:data:`UNSET`, passed as ``argument``) comes from ``global_group()`` when
    ``use_global_fallback``; otherwise it is a ``ValueError``.
    """
    if group is UNSET:
        if not use_global_fallback:
            raise ValueError(
                f"{argument} was not given and use_global_fallback=False; pass the group (None when the axis is "
                "off) or build the filter groups with StatsGroups.from_collection"
            )
        group = global_group()
    return group_rank(group) == 0


def is_counted(param: torch.Tensor, groups: StatsGroups) -> bool:
    """Whether this rank counts ``param``'s gradient: not shared, not a TP duplicate, not a GTP duplicate."""
    return (
        param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param, groups.tp, groups.expt_tp, use_global_fallback=False)
        and param_is_not_gtp_duplicate(
            param, groups.gtp_remat, groups.expt_gtp_remat, use_global_fallback=False
        )
    )


def reduce_group_of(param: torch.Tensor, groups: StatsGroups) -> ProcessGroup | None:
    """The group ``param``'s counted gradient is summed over: expert or dense model-parallel group."""
    return groups.expert_reduce if is_expert_param(param) else groups.dense_reduce


def set_duplicate_filter_groups(optimizer: Any, pg_collection: ProcessGroupCollection) -> StatsGroups:
    """Resolve :class:`StatsGroups` from ``pg_collection`` and attach them as ``optimizer.stats_groups``."""
    groups = StatsGroups.from_collection(pg_collection)
    optimizer.stats_groups = groups
    return groups
