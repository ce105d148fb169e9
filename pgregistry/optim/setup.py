"""The process groups an optimizer or DDP wrapper runs on, validated before anything is built on them.

:func:`setup_process_groups_for_optimizer` and :func:`setup_process_groups_for_ddp` take the model's
:class:`~pgregistry.collection.ProcessGroupCollection` and check, in Megatron-Core's order, that every group
they need was provided: ``dp`` always; ``dp_cp``, which may default to ``dp`` only when context parallelism is off;
``expt_dp`` (``None`` when the model has no experts); ``intra_dist_opt`` for a distributed optimizer; ``mp`` and
``tp_ep_pp`` for an optimizer, ``tp``, ``pp`` and ``ep`` for DDP. A missing group raises ``ValueError`` naming it
and saying how to provide it, so a model on its own grid never silently optimises on another grid's groups.

Without a collection both use the one attached to the model, else the global grid with a
:class:`~pgregistry.fallback.ProcessGroupFallbackWarning` (:func:`pgregistry.resolver.resolve_collection`; the
deprecated path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, Unset, group_size
from pgregistry.fallback import is_global_grid
from pgregistry.resolver import resolve_collection

__all__ = [
    "DDPProcessGroups",
    "OptimizerProcessGroups",
    "setup_process_groups_for_ddp",
    "setup_process_groups_for_optimizer",
]

Group = ProcessGroup | None
"""A validated group: a ProcessGroup or ``None`` (the axis is off)."""



@attrs.frozen(slots=True, kw_only=True)
class DataParallelGroups:
    """The data-parallel groups both an optimizer and a data-parallel wrapper use, checked in Megatron-Core's
    order by both setup functions."""

    dp: Group
    dp_cp: Group
    intra_dp_cp: Group
    expt_dp: Group
    intra_expt_dp: Group
    inter_dist_opt: Group


@attrs.frozen(slots=True, kw_only=True)
class OptimizerProcessGroups(DataParallelGroups):
    """The groups an optimizer uses, validated by :func:`setup_process_groups_for_optimizer`.

    ``intra_dist_opt`` is :data:`~pgregistry.collection.UNSET` when no distributed optimizer was asked for and
    the collection did not set it. The gloo groups are ``None`` unless ``use_gloo`` read them from the global
    grid.
    """

    intra_dist_opt: ProcessGroup | None | Unset
    mp: Group
    tp_ep_pp: Group
    intra_dp_cp_gloo: Group
    intra_expt_dp_gloo: Group


@attrs.frozen(slots=True, kw_only=True)
class DDPProcessGroups(DataParallelGroups):
    """The groups a data-parallel wrapper uses, validated by :func:`setup_process_groups_for_ddp`."""

    tp: Group
    pp: Group
    ep: Group


def setup_process_groups_for_optimizer(
    pg_collection: ProcessGroupCollection | None = None,
    model_chunks: nn.Module | Sequence[nn.Module] = (),
    *,
    use_distributed_optimizer: bool = False,
    use_gloo: bool = False,
) -> OptimizerProcessGroups:
    """Validate and return the groups an optimizer over ``model_chunks`` needs from ``pg_collection``.

    Checks, in order: ``dp`` set; ``dp_cp`` set, or context parallelism known to be off (the collection's ``cp``
    is ``None`` or one rank, or the first chunk's ``config.context_parallel_size`` is 1), in which case it is
    ``dp``; ``expt_dp`` set (``None`` allowed); ``intra_dist_opt`` set when ``use_distributed_optimizer``;
    ``intra_dp_cp`` and ``intra_expt_dp`` set when ``inter_dist_opt`` spans several optimizer instances (they
    default to ``dp_cp`` and ``expt_dp`` for one instance); ``mp`` and ``tp_ep_pp`` set (``None`` allowed);
    ``use_gloo`` only on the global grid. Each failure raises ``ValueError`` naming the group.

    ``pg_collection`` defaults to the collection attached to ``model_chunks``, else the global grid with a
    warning (:func:`~pgregistry.resolver.resolve_collection`). ``use_gloo`` needs the global grid, built with
    gloo data-parallel groups.
    """
    owner = "setup_process_groups_for_optimizer"
    collection = resolve_collection(pg_collection, model_chunks, owner=owner)
    groups = _validated_data_parallel(collection, model_chunks, distributed_optimizer=use_distributed_optimizer)
    for name in ("mp", "tp_ep_pp"):
        _require(collection, name, "set it to None if the model does not need it")
    if use_gloo and not is_global_grid(collection):
        raise ValueError(
            "gloo process groups are read from the global grid only, and this model's collection is another one; "
            "pass use_gloo=False (build a gloo layout with pgregistry.build(..., backend='gloo') if CPU-side groups "
            "are needed)"
        )
    return OptimizerProcessGroups(
        **groups,
        mp=collection.get("mp"),
        tp_ep_pp=collection.get("tp_ep_pp"),
        intra_dp_cp_gloo=_gloo_group(groups["intra_dp_cp"], "intra_dp_cp", use_gloo),
        intra_expt_dp_gloo=_gloo_group(groups["intra_expt_dp"], "intra_expt_dp", use_gloo),
    )


def setup_process_groups_for_ddp(
    pg_collection: ProcessGroupCollection | None = None,
    model_chunks: nn.Module | Sequence[nn.Module] = (),
) -> DDPProcessGroups:
    """Validate and return the groups a DDP wrapper of ``model_chunks`` needs from ``pg_collection``.

    The data-parallel checks of :func:`setup_process_groups_for_optimizer` (``dp``, ``dp_cp``, ``expt_dp``,
    the optimizer-instance groups), then ``tp``, ``pp`` and ``ep`` must all be set (``None`` allowed).
    ``pg_collection`` defaults to the collection attached to ``model_chunks``, else the global grid with a
    warning (:func:`~pgregistry.resolver.resolve_collection`).
    """
    pg_collection = resolve_collection(pg_collection, model_chunks, owner="setup_process_groups_for_ddp")
    groups = _validated_data_parallel(pg_collection, model_chunks, distributed_optimizer=False)
    groups.pop("intra_dist_opt")
    missing = [name for name in ("tp", "pp", "ep") if not pg_collection.is_set(name)]
    if missing:
        raise ValueError(
            f"tp, pp and ep process groups are required for DDP but {missing} not set in pg_collection; set each "
            "(None when the axis is off)"
        )
    return DDPProcessGroups(
        **groups, tp=pg_collection.get("tp"), pp=pg_collection.get("pp"), ep=pg_collection.get("ep")
    )


def _validated_data_parallel(
    pg_collection: ProcessGroupCollection,
    model_chunks: nn.Module | Sequence[nn.Module],
    *,
    distributed_optimizer: bool,
) -> dict[str, Any]:
    """The data-parallel groups of ``pg_collection``, checked in Megatron-Core's order."""
    if not pg_collection.is_set("dp"):
        raise ValueError("dp process group is required but not set in pg_collection (None when DP is off)")
    dp = pg_collection.get("dp")
    if pg_collection.is_set("dp_cp"):
        dp_cp = pg_collection.get("dp_cp")
    else:
        cp_size = _context_parallel_size(pg_collection, model_chunks)
        if cp_size != 1:
            known = "unknown" if cp_size is None else str(cp_size)
            raise ValueError(
                f"dp_cp process group is required: it is not set in pg_collection and the context-parallel size "
                f"is {known}; dp_cp defaults to dp only when context parallelism is known to be off (set cp, or "
                "dp_cp)"
            )
        dp_cp = dp
    _require(pg_collection, "expt_dp", "set it to None if the model has no experts")
    expt_dp = pg_collection.get("expt_dp")
    if distributed_optimizer:
        _require(
            pg_collection,
            "intra_dist_opt",
            "the distributed optimizer shards its state over this group (one optimizer instance); set it (None "
            "for a single-rank instance)",
            when="when use_distributed_optimizer=True",
        )
    intra_dist_opt = pg_collection.get("intra_dist_opt") if pg_collection.is_set("intra_dist_opt") else UNSET
    inter_dist_opt = pg_collection.get("inter_dist_opt") if pg_collection.is_set("inter_dist_opt") else None
    if group_size(inter_dist_opt) > 1:
        missing = [name for name in ("intra_dp_cp", "intra_expt_dp") if not pg_collection.is_set(name)]
        if missing:
            raise ValueError(
                f"{' and '.join(missing)} process group(s) are required when inter_dist_opt spans "
                f"{group_size(inter_dist_opt)} distributed-optimizer instances, but not set in pg_collection"
            )
    return {
        "dp": dp,
        "dp_cp": dp_cp,
        "intra_dp_cp": pg_collection.get("intra_dp_cp") if pg_collection.is_set("intra_dp_cp") else dp_cp,
        "expt_dp": expt_dp,
        "intra_expt_dp": pg_collection.get("intra_expt_dp") if pg_collection.is_set("intra_expt_dp") else expt_dp,
        "inter_dist_opt": inter_dist_opt,
        "intra_dist_opt": intra_dist_opt,
    }


def _require(pg_collection: ProcessGroupCollection, name: GroupName, how: str, *, when: str = "") -> None:
    if not pg_collection.is_set(name):
        condition = f" {when}" if when else ""
        raise ValueError(f"{name} process group is required{condition} but not set in pg_collection: {how}")


def _context_parallel_size(
    pg_collection: ProcessGroupCollection, model_chunks: nn.Module | Sequence[nn.Module]
) -> int | None:
    """The CP size from the collection's ``cp``, else the first chunk's config; ``None`` when unknown."""
    if pg_collection.is_set("cp"):
        return group_size(pg_collection.get("cp"))
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    size = getattr(getattr(chunks[0], "config", None), "context_parallel_size", None) if chunks else None
    return int(size) if size is not None else None


def _gloo_group(group: Group, name: str, use_gloo: bool) -> Group:
    """``group`` as the gloo group of ``name`` when asked for, which requires it to be a gloo group."""
    if not use_gloo:
        return None
    if group is not None and "gloo" not in str(dist.get_backend(group)):
        raise ValueError(
            f"use_gloo=True needs a gloo {name} group, but the global grid's is a {dist.get_backend(group)} group; "
            "build the global grid with backend='gloo' or pass use_gloo=False"
        )
    return group
