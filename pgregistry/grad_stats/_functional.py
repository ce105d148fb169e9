"""The functional API: global norm, zero count and clipping of a model's grads on its collection.

Each plain grad is classified by its parameter's roles (:mod:`pgregistry.grad_stats._filters`), each DTensor grad
by its placements and roles (:mod:`pgregistry.grad_stats._dtensors`), then reduced
(:mod:`pgregistry.grad_stats._reductions`): first the DTensor pieces sharded over a data-parallel group, over that
group, then everything over its reduction group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry._classification import require_classified_experts
from pgregistry._resolve import ParamsLike, normalise, resolve
from pgregistry.collection import ProcessGroupCollection
from pgregistry.grad_stats._devices import reduction_device
from pgregistry.grad_stats._dtensors import DTensorGrad, MeshAxes, classify_dtensor_grad, is_dtensor, outer_shares
from pgregistry.grad_stats._filters import STATS_FALLBACK, StatsGroups, is_counted, reduce_group_of, role_verdicts
from pgregistry.grad_stats._reductions import (
    checked_norm_type,
    clip_grads_,
    local_share,
    local_zeros,
    reduce_over_groups,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "ClassifiedGrads",
    "check_expert_classification",
    "classify_grads",
    "classify_named_params",
    "clip_grad_norm_",
    "count_zeros",
    "grad_norm",
    "norm_of_classified",
]


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


@attrs.frozen(slots=True, kw_only=True)
class ClassifiedGrads:
    """Every grad of a call, classified: plain grads (and DTensor pieces summed only over their reduction group)
    by reduction group, and the DTensor pieces summed over a data-parallel group first."""

    by_group: dict[ProcessGroup | None, list[torch.Tensor]]
    summed_first: list[DTensorGrad]
    axes: MeshAxes | None
    local_grads: list[torch.Tensor]


def _classified(
    model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None, owner: str
) -> ClassifiedGrads:
    """The door of the statistics entry points: ``model_or_params`` normalised once, the collection resolved once
    (explicit, else attached to the model, else the global grid with a warning), unclassified expert parameters
    refused however they were passed, sparse grads refused; then :func:`classify_named_params`."""
    params = normalise(model_or_params)
    collection = resolve(pg_collection, params.chunks, owner=owner, fallback=STATS_FALLBACK)
    require_classified_experts(params, collection)
    for name, param in params.named:
        if param.grad is not None and param.grad.layout != torch.strided:
            raise TypeError(
                f"the grad of {name!r} is {param.grad.layout} (e.g. from nn.Embedding(sparse=True)); grad statistics "
                "need dense (torch.strided) grads"
            )
    return classify_named_params(params.named, StatsGroups.from_collection(collection))


def check_expert_classification(
    model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None = None
) -> None:
    """Refuse a parameter of a marked expert module that does not say whether it is replicated across EP.

    Every statistics entry point and the optimizer builder run this check; call it to check a model on its own.
    Only when the EP axis is on (more than one rank): with EP off the question does not arise. ``ValueError``
    naming every such parameter; classify each with :func:`~pgregistry.params.mark_expert` or
    :func:`~pgregistry.params.mark_expert_replicated`.
    """
    params = normalise(model_or_params)
    collection = resolve(pg_collection, params.chunks, owner="check_expert_classification", fallback=("ep",))
    require_classified_experts(params, collection)


def classify_named_params(named: Sequence[tuple[str, torch.Tensor]], groups: StatsGroups) -> ClassifiedGrads:
    """Classify the grads of ``named`` parameters: plain ones by :func:`classify_grads`, DTensor ones by
    :func:`~pgregistry.grad_stats._dtensors.classify_dtensor_grad` (``ValueError`` naming a parameter whose mesh
    or placement disagrees with the collection or its roles).
    Collective only for ``Partial`` DTensor grads."""
    plain: list[torch.Tensor] = []
    distributed: list[tuple[str, torch.Tensor]] = []
    for name, param in named:
        if is_dtensor(param.grad if param.grad is not None else param):
            distributed.append((name, param))
        else:
            plain.append(param)
    by_group = classify_grads(plain, groups)
    local_grads = [param.grad for param in plain if param.grad is not None]
    if not distributed:
        return ClassifiedGrads(by_group=by_group, summed_first=[], axes=None, local_grads=local_grads)
    axes = MeshAxes(groups.collection, {False: groups.dense_reduce, True: groups.expert_reduce})
    summed_first: list[DTensorGrad] = []
    verdicts: dict[tuple[Any, ...], tuple[bool, bool]] = {}
    for name, param in distributed:
        grad = param.grad
        if grad is None:
            continue
        # The roles the TP and GTP verdicts depend on.
        key = (
            getattr(param, "allreduce", None),
            getattr(param, "tensor_model_parallel", None),
            getattr(param, "is_gtp_weight_remat", None),
        )
        if key not in verdicts:
            verdicts[key] = role_verdicts(param, groups)
        entry = classify_dtensor_grad(name, param, cast("DTensor", grad), axes, verdicts[key])
        local_grads.append(entry.piece)
        if entry.outer is not None:
            summed_first.append(entry)
        elif entry.counted:
            by_group[axes.reduce_groups[entry.expert]].append(entry.local)
    return ClassifiedGrads(by_group=by_group, summed_first=summed_first, axes=axes, local_grads=local_grads)


def _statistic(
    classified: ClassifiedGrads,
    local: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    op: Any,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Iterator[torch.Tensor]:
    """Each reduction group's share: its grads' local share, combined with the shares summed over a
    data-parallel group first, reduced over the group."""
    first: dict[ProcessGroup | None, list[torch.Tensor]] = {}
    if classified.axes is not None:
        first = outer_shares(classified.summed_first, classified.axes, local, op)

    def share(group_and_grads: tuple[ProcessGroup | None, Sequence[torch.Tensor]]) -> torch.Tensor:
        group, grads = group_and_grads
        total = local(grads)
        for part in first.get(group, []):
            total = combine(total, part)
        return total

    items = {group: (group, grads) for group, grads in classified.by_group.items()}
    yield from reduce_over_groups(items, share, op)


def norm_of_classified(classified: ClassifiedGrads, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of classified grads (a 0-dim float32 tensor on their device, no host sync)."""
    p = checked_norm_type(norm_type)
    device = reduction_device(classified.local_grads, classified.by_group)
    infinite = math.isinf(p)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    combine = torch.maximum if infinite else torch.add
    total = torch.zeros((), dtype=torch.float32, device=device)
    for share in _statistic(classified, lambda grads: local_share(grads, p, device), op, combine):
        total = combine(total, share)
    return total if infinite else total.pow(1.0 / p)


def grad_norm(
    params: ParamsLike, pg_collection: ProcessGroupCollection | None = None, *, norm_type: float = 2.0
) -> torch.Tensor:
    """The global ``norm_type``-norm of the grads of ``params`` (a model, its parameters, ...) on its collection.

    Each grad is classified by its parameter's roles (:func:`is_counted`, :func:`reduce_group_of`); a DTensor grad
    (FSDP2, ``parallelize_module``) by its placements over the mesh dims it spans and by the roles elsewhere
    (:mod:`pgregistry.grad_stats._dtensors`). Given a model or model chunks, parameters of a marked expert module
    without an EP classification raise ``ValueError`` first (:func:`check_expert_classification`).
    ``pg_collection=None`` is the collection attached to the model, else the global grid with a warning.
    Collective over the collection's ``mp`` and ``tp_ep_pp_with_egtp_remat`` groups (and the data-parallel groups
    DTensor grads are sharded over). Returns a 0-dim float32 tensor on the grads' device.
    """
    return norm_of_classified(_classified(params, pg_collection, "grad_norm"), norm_type)


def count_zeros(params: ParamsLike, pg_collection: ProcessGroupCollection | None = None) -> int:
    """The global number of zero grad elements of ``params``, each distinct element counted once."""
    classified = _classified(params, pg_collection, "count_zeros")
    device = reduction_device(classified.local_grads, classified.by_group)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for share in _statistic(classified, lambda grads: local_zeros(grads, device), dist.ReduceOp.SUM, torch.add):
        total += share
    return int(total.item())


def clip_grad_norm_(
    params: ParamsLike,
    max_norm: float,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the grads of ``params`` in place to a global norm of ``max_norm``; return the norm before clipping.

    Every grad is scaled, the duplicates too, so replicas stay identical; a DTensor grad through its local tensor.
    A NaN or infinite norm scales nothing (the returned norm says so; skip the step) or, with
    ``error_if_nonfinite``, raises ``RuntimeError`` on every rank (the norm is the same everywhere):
    :func:`~pgregistry.grad_stats.clip_grads_`.
    """
    classified = _classified(params, pg_collection, "clip_grad_norm_")
    total = norm_of_classified(classified, norm_type)
    clip_grads_(classified.local_grads, max_norm, total, error_if_nonfinite=error_if_nonfinite)
    return total
