"""``build_optimizer``: a model's chained dense + expert optimizer, wired to the model's collection.

The builder is where expert grads filtered with the dense TP group (Megatron-LM PR 6470) could come
back, so it does every step from the collection: refuse unclassified expert parameters (the xorl
1/sqrt(ep) undercount), validate the groups the optimizer needs once
(:func:`~pgregistry.optim._setup.optimizer_process_groups`, Megatron-Core's order, each missing
group named), split dense from routed-expert parameters, and give both children those groups, dense
and expert TP groups included (:class:`~pgregistry.grad_stats.StatsGroups`). The collection is
resolved once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from pgregistry._runtime.agreement import any_rank_has_each
from pgregistry._runtime.resolve import normalise_model
from pgregistry.collection import ProcessGroupCollection
from pgregistry.grad_stats._classification import require_classified_experts
from pgregistry.optim._base import FlatOptimizer, InnerFactory, ParamNameFn
from pgregistry.optim._chained import ChainedOptimizer
from pgregistry.optim._flat_step import ElementwiseRule
from pgregistry.optim._mixed_precision import MixedPrecisionOptimizer
from pgregistry.optim._options import (
    Replicas,
    agree_options,
    check_options,
    refuse_ignored_options,
    structure_of,
)
from pgregistry.optim._setup import (
    check_instance_holds_stats_groups,
    optimizer_collection,
    optimizer_process_groups,
)
from pgregistry.optim._sharded import ShardedOptimizer
from pgregistry.params import is_expert_param

__all__ = ["build_optimizer", "inner_factory"]

OptimizerName = Literal["adam", "adamw", "sgd"]


def inner_factory(
    optimizer: OptimizerName,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
) -> InnerFactory:
    """The torch.optim update rule named ``optimizer``, as a factory over the tensors to step.

    The factory is an :class:`~pgregistry.optim._flat_step.ElementwiseRule`, so the optimizers step
    their flat main buffer as one tensor (fused on CUDA).

    Args:
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        lr: the learning rate.
        weight_decay: the weight decay.
        betas: Adam's and AdamW's betas.
        eps: Adam's and AdamW's epsilon.
        momentum: SGD's momentum.

    Returns:
        The factory, for the ``inner`` argument of the optimizers.

    Raises:
        TypeError: a number that is none (``None``, a string, a bool), or ``betas`` no pair.
        ValueError: an unknown ``optimizer`` name; a number that is negative, NaN or infinite, a
            beta outside [0, 1); a number the rule does not read (``momentum`` for Adam).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> from pgregistry.optim import MixedPrecisionOptimizer, setup_process_groups_for_optimizer
        >>> groups = setup_process_groups_for_optimizer(build(ParallelLayout(num_ranks=2)))
        >>> params = model.parameters()
        >>> inner = inner_factory("adamw", lr=3e-4, weight_decay=0.1)
        >>> optimizer = MixedPrecisionOptimizer(params, groups, inner=inner)
        >>> optimizer.step()
        >>> model.weight.detach()
        tensor([[-0.0003, -0.0003]])
    """
    options = {
        "optimizer": optimizer,
        "lr": lr,
        "weight_decay": weight_decay,
        "betas": betas,
        "eps": eps,
        "momentum": momentum,
    }
    check_options(options)
    refuse_ignored_options(optimizer, options, inner_factory.__kwdefaults__ or {})
    if optimizer in ("adam", "adamw"):
        adam = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
        return ElementwiseRule(
            adam, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
    if optimizer == "sgd":
        return ElementwiseRule(
            torch.optim.SGD, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        )
    raise ValueError(
        f"unknown optimizer {optimizer!r}; use 'adam', 'adamw', 'sgd' or pass a factory"
    )


def build_optimizer(
    model: nn.Module | Sequence[nn.Module],
    pg_collection: ProcessGroupCollection | None = None,
    *,
    optimizer: OptimizerName | InnerFactory = "adam",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    mixed_precision: bool = True,
    sharded: bool = False,
    bucket_numel: int | None = None,
    param_name_fn: ParamNameFn | None = None,
) -> ChainedOptimizer:
    """A :class:`~pgregistry.optim.ChainedOptimizer` over the trainable parameters of ``model``.

    Dense parameters go to one child (grads reduced over ``dp_cp``, statistics over ``mp``), routed
    experts (``allreduce=False``) to another (``expt_dp``, ``tp_ep_pp_with_egtp_remat``); a sharded
    build shards each child over its data-parallel group and reduces statistics over
    ``intra_dist_opt``. A child exists when any rank of its statistics group has parameters of its
    kind, so every rank issues the same collectives.

    Args:
        model: the model, or its chunks.
        pg_collection: the collection (default: the one attached to the model, looked up through
            ``.module`` wrappers and the same on every chunk, else the global grid with a fallback
            warning).
        optimizer: the inner update rule, ``"adam"``, ``"adamw"`` or ``"sgd"``
            (:func:`inner_factory`, with ``lr``, ``weight_decay``, ``betas``, ``eps``,
            ``momentum``), or a factory over the tensors to step.
        lr: the learning rate of a named rule.
        weight_decay: its weight decay.
        betas: Adam's and AdamW's betas.
        eps: Adam's and AdamW's epsilon.
        momentum: SGD's momentum.
        mixed_precision: keep float32 main copies and grads (default); ``False`` steps in the
            parameters' dtype.
        sharded: a :class:`~pgregistry.optim.ShardedOptimizer` per child (a distributed optimizer)
            instead of a :class:`~pgregistry.optim.MixedPrecisionOptimizer`.
        bucket_numel: grads all-reduced in buckets of at most this many elements (default: one
            bucket; unsharded children only).
        param_name_fn: names parameters in state dicts and errors (default: the model's parameter
            names), e.g. :func:`pgregistry.experts.global_param_name_fn`.

    Returns:
        The chained optimizer of the one or two children.

    Raises:
        TypeError: an option of the wrong type (``lr=None``, ``sharded='no'``,
            ``bucket_numel=True``, an ``optimizer`` that is neither a name nor a factory), named
            before anything is built;
            ``model`` not a model or model chunks; on every rank of the statistics group, a
            rank holding a parameter that is not floating-point (a complex one: the flat buffers
            hold real grads), named on that rank.
        ValueError: an unclassified expert parameter (named); a collection missing a group the
            optimizer needs (named); a sharded build whose ``intra_dist_opt`` does not hold the
            statistics groups; a model without trainable parameters; an unknown ``optimizer`` name;
            on every rank of the optimizer's instance, options that differ across its ranks (an
            ``lr`` read from each rank's environment: replicas would diverge);
            a number the rule does not read, given (``lr`` with a factory as ``optimizer``: the
            factory's own lr stepped; ``momentum`` for Adam, ``betas`` for SGD);
            a number out of its range (NaN, infinite or negative ``lr``, ``eps``, ``weight_decay``,
            ``momentum``; a beta outside [0, 1); ``bucket_numel`` not positive), named; on every
            rank of the statistics group, float64 parameters under ``mixed_precision=True`` (their
            float32 main copies would round them), named on the ranks holding them.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it):

        >>> import torch
        >>> from pgregistry import ParallelLayout, build, clip_grad_norm_
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])  # replicated over TP: counted once
        >>> optimizer = build_optimizer(model, pg, optimizer="adamw", lr=3e-4, weight_decay=0.1)
        >>> clip_grad_norm_(model, 1.0, pg)
        tensor(5.)
        >>> optimizer.step()
    """
    rule: dict[str, Any] = {
        "lr": lr,
        "weight_decay": weight_decay,
        "betas": betas,
        "eps": eps,
        "momentum": momentum,
    }
    options = {
        "optimizer": optimizer,
        **rule,
        "mixed_precision": mixed_precision,
        "sharded": sharded,
        "bucket_numel": bucket_numel,
        "param_name_fn": param_name_fn,
    }
    check_options(options)
    refuse_ignored_options(optimizer, options, build_optimizer.__kwdefaults__ or {})
    params = normalise_model(model, "build_optimizer")
    collection = optimizer_collection(pg_collection, params, owner="build_optimizer")
    require_classified_experts(params, collection)
    process_groups = optimizer_process_groups(
        collection, params.chunks, use_distributed_optimizer=sharded
    )
    named = [(name, p) for name, p in params.named if p.requires_grad]
    # Over the replicas (dp_cp, expt_dp), then the rest of the grid (mp, the expert model-parallel
    # group): every rank of the instance, before the first collective that depends on the options
    # (a sharded build's).
    agree_options(
        options,
        (
            Replicas(
                process_groups.dp_cp,
                process_groups.mp,
                structure_of([(n, p) for n, p in named if not is_expert_param(p)]),
                "dense",
            ),
            Replicas(
                process_groups.expt_dp,
                process_groups.stats.expert_reduce,
                structure_of([(n, p) for n, p in named if is_expert_param(p)]),
                "expert",
            ),
        ),
    )
    if sharded:
        check_instance_holds_stats_groups(process_groups)
    stats_groups = process_groups.stats
    names = {id(p): name for name, p in named}
    name_fn = param_name_fn or (lambda p: names[id(p)])
    inner = inner_factory(optimizer, **rule) if isinstance(optimizer, str) else optimizer
    main_dtype = torch.float32 if mixed_precision else None
    children: list[FlatOptimizer] = []
    # Refused on every rank of the first child's group, in the all-reduce that decides whether it
    # exists: a rank raising alone would leave the others waiting in the second child's.
    refused = [name for name, p in named if not p.is_floating_point()]
    rounded = [
        name
        for name, p in named
        if main_dtype is not None and torch.promote_types(p.dtype, main_dtype) != main_dtype
    ]
    for expert in (False, True):
        kind = [p for _, p in named if is_expert_param(p) == expert]
        if sharded:
            stats_group = process_groups.intra_dist_opt
        else:
            stats_group = stats_groups.expert_reduce if expert else stats_groups.dense_reduce
        has, anyone_refused, anyone_rounded = any_rank_has_each(
            (bool(kind), bool(refused) and not expert, bool(rounded) and not expert), stats_group
        )
        if anyone_refused:
            here = f"here: {refused}" if refused else "none here"
            raise TypeError(
                "build_optimizer steps floating-point parameters only (its flat buffers hold real "
                f"grads), and a rank of the optimizer holds others ({here}, e.g. complex ones); "
                "keep them out of the optimizer or step them as real views (torch.view_as_real)"
            )
        if anyone_rounded:
            here = f"here: {rounded}" if rounded else "none here"
            raise ValueError(
                "mixed_precision=True keeps float32 main copies, which would round the float64 "
                f"parameters a rank of the optimizer holds ({here}); build with "
                "mixed_precision=False to step them in float64"
            )
        if not has:
            continue
        if sharded:
            children.append(
                ShardedOptimizer(
                    kind,
                    process_groups,
                    inner=inner,
                    expert=expert,
                    main_dtype=main_dtype,
                    param_name_fn=name_fn,
                )
            )
        else:
            children.append(
                MixedPrecisionOptimizer(
                    kind,
                    process_groups,
                    inner=inner,
                    expert=expert,
                    main_dtype=main_dtype,
                    bucket_numel=bucket_numel,
                    param_name_fn=name_fn,
                )
            )
    if not children:
        raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
    return ChainedOptimizer(children)
