"""The process groups an optimizer runs on, validated before anything is built on them.

:func:`setup_process_groups_for_optimizer` takes the model's
:class:`~pgregistry.collection.ProcessGroupCollection` and checks, in Megatron-Core's order, that
every group it needs was provided: ``dp`` always; ``dp_cp``, which may default to ``dp`` only when
context parallelism is off; ``expt_dp`` (``None`` when the model has no experts); ``intra_dist_opt``
for a distributed optimizer; ``mp`` and ``tp_ep_pp``; and the grad-statistics groups. A missing
group raises ``ValueError`` naming it and saying how to provide it, so a model on its own grid never
silently optimises on another grid's groups. The optimizers take the result alone: one source of
truth for their groups.

Without a collection it uses the one attached to the model, else the global grid with a
:class:`~pgregistry.fallback.ProcessGroupFallbackWarning` (the deprecated path). It reads only what
the model needs (:func:`optimizer_collection`): the expert fields of a model without experts are
never read from the global grid, as Megatron-LM's own
``test_get_megatron_optimizer_with_custom_process_groups`` sets ``expt_dp`` and ``tp_ep_pp`` to
``None`` and gives no ``expt_tp``; a field filled from the global grid never contradicts one the
collection sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pgregistry._runtime.agreement import any_rank_has
from pgregistry._runtime.resolve import (
    Params,
    fill_unset_fields,
    normalise_params,
    resolve_pg_collection,
)
from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, Unset, group_size
from pgregistry.grad_stats._classification import holds_experts
from pgregistry.grad_stats._filters import EXPERT_STATS_FIELDS, STATS_FALLBACK, StatsGroups

__all__ = [
    "OptimizerProcessGroups",
    "check_instance_holds_stats_groups",
    "optimizer_collection",
    "optimizer_process_groups",
    "setup_process_groups_for_optimizer",
]

Group = ProcessGroup | None
"""A validated group: a ProcessGroup or ``None`` (the axis is off)."""


@attrs.frozen(slots=True, kw_only=True)
class OptimizerProcessGroups:
    """The groups an optimizer uses, validated by :func:`setup_process_groups_for_optimizer`.

    Made by that function, not by hand: the optimizers' constructors take it so that a group
    they run on has passed Megatron-Core's checks once, in Megatron-Core's order. Each field is a
    ``ProcessGroup`` or ``None`` (the axis is off); ``intra_dist_opt`` is
    :data:`~pgregistry.collection.UNSET` when no distributed optimizer was asked for and the
    collection did not set it.

    Attributes:
        dp: Data parallelism (without CP).
        dp_cp: Data x context parallelism: where dense grads are reduced.
        intra_dp_cp: The part of ``dp_cp`` one distributed-optimizer instance shards over.
        expt_dp: Expert data parallelism: where expert grads are reduced.
        intra_expt_dp: The part of ``expt_dp`` one distributed-optimizer instance shards over.
        inter_dist_opt: Across distributed-optimizer instances.
        intra_dist_opt: The group one distributed-optimizer instance spans.
        mp: The dense model-parallel group (the dense grad-norm group).
        tp_ep_pp: The expert model-parallel group (the expert grad-norm group).
        stats: Which rank counts a grad and where the counted grads are summed.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> from pgregistry.optim import MixedPrecisionOptimizer, inner_factory
        >>> pg_collection = build(ParallelLayout(num_ranks=2))
        >>> groups = setup_process_groups_for_optimizer(pg_collection, model)
        >>> params = model.parameters()
        >>> inner = inner_factory("adamw", lr=1e-3)
        >>> optimizer = MixedPrecisionOptimizer(params, groups, inner=inner)
        >>> optimizer.step()  # Adam's first step: lr against each grad's sign
        >>> model.weight.detach()
        tensor([[-0.0010, -0.0010]])
    """

    dp: Group
    dp_cp: Group
    intra_dp_cp: Group
    expt_dp: Group
    intra_expt_dp: Group
    inter_dist_opt: Group
    intra_dist_opt: ProcessGroup | None | Unset
    mp: Group
    tp_ep_pp: Group
    stats: StatsGroups
    """Which rank counts a grad and where counted grads are summed (grad statistics' groups)."""


def setup_process_groups_for_optimizer(
    pg_collection: ProcessGroupCollection | None = None,
    model_chunks: nn.Module | Sequence[nn.Module] = (),
    *,
    use_distributed_optimizer: bool = False,
) -> OptimizerProcessGroups:
    """The groups an optimizer over ``model_chunks`` needs from ``pg_collection``, validated.

    The checks are Megatron-Core's, in its order (:func:`optimizer_process_groups`).

    Args:
        pg_collection: the collection (default: the one attached to ``model_chunks``, else the
            global grid with a fallback warning).
        model_chunks: the model, or its chunks (their ``config.context_parallel_size`` may tell that
            context parallelism is off).
        use_distributed_optimizer: require ``intra_dist_opt`` too.

    Returns:
        The :class:`OptimizerProcessGroups`.

    Raises:
        TypeError: ``pg_collection`` neither a collection nor ``None``.
        ValueError: a group the optimizer needs unset (named); a collection that disagrees with the
            model's attached one, that this rank is not a member of, or that was destroyed.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> from pgregistry.collection import group_size
        >>> from pgregistry.optim import ShardedOptimizer, inner_factory
        >>> pg, params = build(ParallelLayout(num_ranks=2)), model.parameters()
        >>> groups = setup_process_groups_for_optimizer(pg, model, use_distributed_optimizer=True)
        >>> group_size(groups.intra_dist_opt)  # the ranks the optimizer's state is sharded over
        2
        >>> optimizer = ShardedOptimizer(params, groups, inner=inner_factory("adam", lr=1e-3))
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    params = normalise_params(chunks) if chunks else None
    collection = optimizer_collection(
        pg_collection, params, owner="setup_process_groups_for_optimizer", collective=False
    )
    return optimizer_process_groups(
        collection, chunks, use_distributed_optimizer=use_distributed_optimizer
    )


def optimizer_collection(
    pg_collection: ProcessGroupCollection | None,
    params: Params | None,
    *,
    owner: str,
    collective: bool = True,
) -> ProcessGroupCollection:
    """The collection an optimizer over ``params`` runs on, resolved at the door.

    The grad-statistics fields the model needs are filled
    (:func:`pgregistry._runtime.resolve.fill_unset_fields`).

    The expert fields are needed when the model holds an expert parameter or an unclassified
    parameter of a marked expert module, or when no model is given; otherwise an UNSET one is
    ``None`` (off), never read from the global grid. ``collective`` (an optimizer build) asks every
    rank of the model's ``mp`` group (each TP and pipeline rank of a replica: one MAX all-reduce),
    so that a stage without experts decides as the others do; otherwise (a validation on one rank)
    this rank's chunks decide.
    """
    chunks = params.chunks if params is not None else ()
    collection = resolve_pg_collection(pg_collection, chunks, owner=owner)
    if params is None:
        experts = True
    else:
        experts = holds_experts(params)
        if collective:
            experts = any_rank_has(experts, collection.get_or("mp", None))
    unneeded = () if experts else EXPERT_STATS_FIELDS
    return fill_unset_fields(collection, STATS_FALLBACK, owner, unneeded=unneeded)


def optimizer_process_groups(
    collection: ProcessGroupCollection,
    model_chunks: Sequence[nn.Module] = (),
    *,
    use_distributed_optimizer: bool = False,
) -> OptimizerProcessGroups:
    """The groups of a resolved ``collection`` an optimizer needs, checked in Megatron-Core's order.

    Checks: ``dp`` set; ``dp_cp`` set, or context parallelism known to be off (the collection's
    ``cp`` is ``None`` or one rank, or the first chunk's ``config.context_parallel_size`` is 1), in
    which case it is ``dp``; ``expt_dp`` set (``None`` allowed); ``intra_dist_opt`` set when
    ``use_distributed_optimizer``; ``intra_dp_cp`` and ``intra_expt_dp`` set when ``inter_dist_opt``
    spans several optimizer instances (they default to ``dp_cp`` and ``expt_dp`` for one instance);
    ``mp`` and ``tp_ep_pp`` set (``None`` allowed); and the grad-statistics groups
    (:class:`~pgregistry.grad_stats.StatsGroups`). Each failure raises ``ValueError`` naming the
    group.
    """
    groups = _validate_data_parallel(
        collection, model_chunks, distributed_optimizer=use_distributed_optimizer
    )
    for name in ("mp", "tp_ep_pp"):
        _require_group(collection, name, "set it to None if the model does not need it")
    return OptimizerProcessGroups(
        **groups,
        mp=collection.get("mp"),
        tp_ep_pp=collection.get("tp_ep_pp"),
        stats=StatsGroups.from_collection(collection),
    )


def _validate_data_parallel(
    pg_collection: ProcessGroupCollection,
    model_chunks: Sequence[nn.Module],
    *,
    distributed_optimizer: bool,
) -> dict[str, Any]:
    """The data-parallel groups of ``pg_collection``, checked in Megatron-Core's order."""
    if not pg_collection.is_set("dp"):
        raise ValueError(
            "dp process group is required but not set in pg_collection (None when DP is off)"
        )
    dp = pg_collection.get("dp")
    if pg_collection.is_set("dp_cp"):
        dp_cp = pg_collection.get("dp_cp")
    else:
        cp_size = _context_parallel_size(pg_collection, model_chunks)
        if cp_size != 1:
            known = "unknown" if cp_size is None else str(cp_size)
            raise ValueError(
                "dp_cp process group is required: it is not set in pg_collection "
                f"and the context-parallel size is {known}; dp_cp defaults to dp "
                "only when context parallelism is known to be off (set cp, or dp_cp)"
            )
        dp_cp = dp
    _require_group(pg_collection, "expt_dp", "set it to None if the model has no experts")
    expt_dp = pg_collection.get("expt_dp")
    if distributed_optimizer:
        _require_group(
            pg_collection,
            "intra_dist_opt",
            "the distributed optimizer shards its state over this group (one "
            "optimizer instance); set it (None for a single-rank instance)",
            when="when use_distributed_optimizer=True",
        )
    intra_dist_opt = pg_collection.get_or("intra_dist_opt", UNSET)
    inter_dist_opt = pg_collection.get_or("inter_dist_opt", None)
    if group_size(inter_dist_opt) > 1:
        missing = [
            name for name in ("intra_dp_cp", "intra_expt_dp") if not pg_collection.is_set(name)
        ]
        if missing:
            raise ValueError(
                f"{' and '.join(missing)} process group(s) are required when "
                f"inter_dist_opt spans {group_size(inter_dist_opt)} "
                "distributed-optimizer instances, but not set in pg_collection"
            )
    return {
        "dp": dp,
        "dp_cp": dp_cp,
        "intra_dp_cp": pg_collection.get_or("intra_dp_cp", dp_cp),
        "expt_dp": expt_dp,
        "intra_expt_dp": pg_collection.get_or("intra_expt_dp", expt_dp),
        "inter_dist_opt": inter_dist_opt,
        "intra_dist_opt": intra_dist_opt,
    }


def _require_group(
    pg_collection: ProcessGroupCollection, name: GroupName, how: str, *, when: str = ""
) -> None:
    if not pg_collection.is_set(name):
        condition = f" {when}" if when else ""
        raise ValueError(
            f"{name} process group is required{condition} but not set in pg_collection: {how}"
        )


def _context_parallel_size(
    pg_collection: ProcessGroupCollection, model_chunks: Sequence[nn.Module]
) -> int | None:
    """The CP size from the collection's ``cp``, else the first chunk's config; or ``None``."""
    if pg_collection.is_set("cp"):
        return group_size(pg_collection.get("cp"))
    size = (
        getattr(getattr(model_chunks[0], "config", None), "context_parallel_size", None)
        if model_chunks
        else None
    )
    return int(size) if size is not None else None


def check_instance_holds_stats_groups(groups: OptimizerProcessGroups) -> None:
    """Refuse an ``intra_dist_opt`` that lacks a rank of this rank's statistics groups.

    ``ValueError`` on every rank of ``intra_dist_opt`` and of ``mp`` when, on any of them,
    ``intra_dist_opt`` lacks a rank of this rank's statistics groups (``mp``, the expert
    model-parallel group).

    A sharded optimizer reduces its statistics over ``intra_dist_opt``, the ranks of one optimizer
    instance (Megatron-Core's is every rank of the instance, TP x PP x DP x CP). One that holds only
    the data-parallel ranks (Megatron-LM's
    ``test_get_megatron_optimizer_with_custom_process_groups`` gives it ``dp_cp``'s ranks) leaves
    out the TP peers: a TP-replicated grad, counted on TP rank 0 only, is missing from TP rank 1's
    norm, and the ranks clip by different norms. Two MAX all-reduces (over ``intra_dist_opt``, then
    ``mp``) carry the verdict.
    """
    instance = groups.intra_dist_opt
    assert not isinstance(instance, Unset)  # a sharded build requires it
    held = set(_ranks_of_group(instance))
    missing = {
        name: ranks
        for name, group in (
            ("mp", groups.stats.dense_reduce),
            ("expert", groups.stats.expert_reduce),
        )
        if not set(ranks := _ranks_of_group(group)) <= held
    }
    local = bool(missing)
    anywhere = any_rank_has(any_rank_has(local, instance), groups.mp)
    if not anywhere:
        return
    if missing:
        lacking = ", ".join(
            f"this rank's {name} group {list(ranks)}" for name, ranks in missing.items()
        )
        where = f"on rank {dist.get_rank()} it holds {sorted(held)}, not {lacking}"
    else:
        where = "on another rank of this optimizer instance it does not"
    raise ValueError(
        "intra_dist_opt must hold every rank of the statistics groups a sharded optimizer reduces "
        f"over it, but {where}: give intra_dist_opt every rank of one optimizer instance (TP x PP "
        "x DP x CP, as Megatron-Core's; Megatron-LM's custom-process-group test gives it dp_cp's "
        "ranks, right only at TP 1 and PP 1), or build the collection with pgregistry.build"
    )


def _ranks_of_group(group: ProcessGroup | None) -> list[int]:
    return [dist.get_rank()] if group is None else list(dist.get_process_group_ranks(group))
