"""The functional API: global norm, zero count and clipping of a model's grads on its collection.

Each grad is classified by its parameter's roles (:mod:`pgregistry.grad_stats.filters`), then reduced
(:mod:`pgregistry.grad_stats.reductions`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

from pgregistry.collection import ProcessGroupCollection
from pgregistry.grad_stats.filters import StatsGroups, is_counted, reduce_group_of
from pgregistry.grad_stats.reductions import clip_grads_, norm_of_grads, zeros_of_grads
from pgregistry.params import ParamsLike, check_expert_classification, model_chunks_of, named_parameters_of
from pgregistry.resolver import resolve_collection

__all__ = ["classify_grads", "clip_grad_norm_", "count_zeros", "grad_norm"]


def classify_grads(
    params: Iterable[torch.Tensor], groups: StatsGroups
) -> dict[ProcessGroup | None, list[torch.Tensor]]:
    """The counted grads of ``params`` (``.grad``, skipping None) keyed by reduction group.

    Both reduction groups are always keys, empty or not, so every rank issues the same collectives whatever
    parameters it holds (a pipeline stage without experts still joins the expert reduction).
    """
    buckets: dict[ProcessGroup | None, list[torch.Tensor]] = {groups.dense_reduce: [], groups.expert_reduce: []}
    for param in params:
        if param.grad is not None and is_counted(param, groups):
            buckets[reduce_group_of(param, groups)].append(param.grad)
    return buckets


def _resolved(
    model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None, owner: str
) -> tuple[StatsGroups, list[torch.Tensor]]:
    """The statistics groups and the parameters of ``model_or_params``, after refusing unclassified expert
    parameters however they were passed (:func:`~pgregistry.params.check_expert_classification`).

    The collection is resolved once (:func:`~pgregistry.resolver.resolve_collection`): explicit, else attached to
    the model, else the global grid with a warning."""
    chunks = model_chunks_of(model_or_params)
    named = named_parameters_of(model_or_params)  # consumes an iterator, once
    collection = resolve_collection(pg_collection, chunks or None, owner=owner)
    check_expert_classification(chunks or dict(named), collection)
    return StatsGroups.from_collection(collection), [param for _, param in named]


def grad_norm(
    params: ParamsLike, pg_collection: ProcessGroupCollection | None, *, norm_type: float = 2.0
) -> torch.Tensor:
    """The global ``norm_type``-norm of the grads of ``params`` (a model, its parameters, ...) on its collection.

    Each grad is classified by its parameter's roles (:func:`is_counted`, :func:`reduce_group_of`). Parameters of
    a marked expert module without an EP classification raise ``ValueError`` first, whether ``params`` is a
    model, its chunks or its parameters (:func:`~pgregistry.params.check_expert_classification`). An omitted
    collection is the one attached to the model, else the global grid with a warning
    (:func:`~pgregistry.resolver.resolve_collection`). Collective over the collection's ``mp`` and
    ``tp_ep_pp`` groups. Returns a 0-dim float32 tensor on the grads' device.
    """
    groups, param_list = _resolved(params, pg_collection, "grad_norm")
    return norm_of_grads(classify_grads(param_list, groups), norm_type)


def count_zeros(params: ParamsLike, pg_collection: ProcessGroupCollection | None) -> int:
    """The global number of zero grad elements of ``params``, each distinct element counted once."""
    groups, param_list = _resolved(params, pg_collection, "count_zeros")
    return int(zeros_of_grads(classify_grads(param_list, groups)).item())


def clip_grad_norm_(
    params: ParamsLike,
    max_norm: float,
    pg_collection: ProcessGroupCollection | None,
    *,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip the grads of ``params`` in place to a global norm of ``max_norm``; return the norm before clipping.

    Every grad is scaled, the duplicates too, so replicas stay identical.
    """
    groups, param_list = _resolved(params, pg_collection, "clip_grad_norm_")
    total = norm_of_grads(classify_grads(param_list, groups), norm_type)
    clip_grads_([param.grad for param in param_list if param.grad is not None], max_norm, total)
    return total
