"""Grad statistics over a process-group collection: duplicate filters, norms, zero counts and clipping.

A global grad statistic must count each distinct piece of the model exactly once. Every rank classifies each of
its local gradients by the parameter's roles (:mod:`pgregistry.params`):

* counted here or a duplicate of a piece another rank counts: a parameter that is not TP-sharded is replicated
  across its TP group (the expert TP group for experts, ``allreduce is False``) and only TP rank 0 counts it; one
  that is not GTP-sharded is likewise counted on GTP-remat rank 0 only; ``shared`` copies are never counted;
* reduced over which group: dense grads over ``mp`` (TP x GTP x PP), expert grads over ``tp_ep_pp``
  (ETP x EP x expert-GTP x PP), so the pieces of one model replica are summed once.

The groups come from the model's collection. ``None`` there is an axis that is off (rank 0 of 1), never "ask
the global grid": reading the global rank for a model whose own grid turned TP or GTP off is how the norm was
undercounted in seed 003. Only an omitted group (:data:`~pgregistry.collection.UNSET`) reaches the global grid,
through :mod:`pgregistry.fallback`, with a :class:`~pgregistry.fallback.ProcessGroupFallbackWarning`.

The reductions issue one all-reduce per distinct group, in an order every rank agrees on, and leave the result
on the grads' device (no host sync), so optimizers can call them every step; see ``docs/design/grad_stats_api.md``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry.collection import UNSET, ProcessGroupCollection, Unset, group_rank, group_size
from pgregistry.fallback import resolve_gtp_remat_group, resolve_process_groups
from pgregistry.params import (
    ParamsLike,
    check_expert_classification,
    is_expert_param,
    model_chunks_of,
    named_parameters_of,
)

__all__ = [
    "CLIP_EPSILON",
    "StatsGroups",
    "backend_device",
    "classify_grads",
    "clip_grad_norm_",
    "clip_grads_",
    "count_zeros",
    "grad_norm",
    "is_counted",
    "norm_of_grads",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_group_of",
    "reduce_over_groups",
    "reduction_device",
    "set_duplicate_filter_groups",
    "zeros_of_grads",
]

CLIP_EPSILON = 1e-6
"""Added to the total norm before dividing, as Megatron-Core does: ``coeff = max_norm / (norm + 1e-6)``."""

GradsByGroup = Mapping[ProcessGroup | None, Sequence[torch.Tensor]]
"""Reduction group (``None``: no reduction) -> already-filtered grads."""

V = TypeVar("V")


@attrs.frozen(slots=True, kw_only=True)
class StatsGroups:
    """The groups grad statistics need, resolved once; each a ProcessGroup or ``None`` (axis off).

    ``tp``/``expt_tp`` and ``gtp_remat``/``expt_gtp_remat`` decide which rank counts a replicated gradient;
    ``dense_reduce`` (the collection's ``mp``) and ``expert_reduce`` (its ``tp_ep_pp``) are what the counted
    gradients are summed over.
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
        :func:`~pgregistry.fallback.resolve_gtp_remat_group`, as the model's layers resolve them. ``mp`` and
        ``tp_ep_pp`` must be set (``ValueError`` naming the field). ``pg_collection=None`` reads every group from
        the global grid, with a fallback warning per group.
        """
        owner = "StatsGroups.from_collection"
        if pg_collection is None:
            found = resolve_process_groups(None, ("tp", "expt_tp", "mp", "tp_ep_pp"), owner=owner)
            tp, expt_tp, mp, tp_ep_pp = found["tp"], found["expt_tp"], found["mp"], found["tp_ep_pp"]
        else:
            for name in ("tp", "mp", "tp_ep_pp"):
                if not pg_collection.is_set(name):
                    raise ValueError(
                        f"grad statistics need the collection's {name!r} group, which is not set; set it (None when "
                        "the axis is off) so a duplicate filter never reads the global grid for it"
                    )
            tp, mp, tp_ep_pp = pg_collection.get("tp"), pg_collection.get("mp"), pg_collection.get("tp_ep_pp")
            expt_tp = pg_collection.get("expt_tp") if pg_collection.is_set("expt_tp") else tp
        return cls(
            tp=tp,
            expt_tp=expt_tp,
            gtp_remat=resolve_gtp_remat_group(pg_collection, False, owner=owner),
            expt_gtp_remat=resolve_gtp_remat_group(pg_collection, True, owner=owner),
            dense_reduce=mp,
            expert_reduce=tp_ep_pp,
        )


# ---------------------------------------------------------------------------------------------------- filters


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
    group = expert_tp_group if expert else tp_group
    if group is UNSET:
        if not use_global_fallback:
            raise ValueError(_omitted_message("expert_tp_group" if expert else "tp_group"))
        field = "expt_tp" if expert else "tp"
        group = resolve_process_groups(None, (field,), owner="param_is_not_tensor_parallel_duplicate")[field]
    return group_rank(group) == 0


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
    group = expert_gtp_group if expert else gtp_group
    if group is UNSET:
        if not use_global_fallback:
            raise ValueError(_omitted_message("expert_gtp_group" if expert else "gtp_group"))
        group = resolve_gtp_remat_group(None, expert, owner="param_is_not_gtp_duplicate")
    return group_rank(group) == 0


def _omitted_message(argument: str) -> str:
    return (
        f"{argument} was not given and use_global_fallback=False; pass the group (None when the axis is off) or "
        "build the filter groups with StatsGroups.from_collection"
    )


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


# ------------------------------------------------------------------------------------------------- reductions


def norm_of_grads(grads_by_group: GradsByGroup, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of already-filtered grads, each group's share summed over its group.

    One all-reduce per distinct group (SUM of ``|g|^p``, MAX for the inf-norm), issued in an order every rank
    agrees on (by the group's ranks); ``None`` and single-rank groups issue none. Every rank of a group must
    pass that group as a key, with an empty list when it holds no grads for it. Returns a 0-dim float32 tensor
    on the grads' device, without a host sync. An empty mapping or empty lists give 0.
    """
    p = _checked_norm_type(norm_type)
    device = _device_of(grads_by_group)
    infinite = math.isinf(p)
    total = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for share in reduce_over_groups(grads_by_group, lambda grads: _local_share(grads, p, device), op):
        total = torch.maximum(total, share) if infinite else total + share
    return total if infinite else total.pow(1.0 / p)


def zeros_of_grads(grads_by_group: GradsByGroup) -> torch.Tensor:
    """The number of zero elements in already-filtered grads, summed over each group (a 0-dim int64 tensor)."""
    device = _device_of(grads_by_group)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for share in reduce_over_groups(grads_by_group, lambda grads: _local_zeros(grads, device), dist.ReduceOp.SUM):
        total += share
    return total


def reduce_over_groups(
    items_by_group: Mapping[ProcessGroup | None, V], local: Callable[[V], torch.Tensor], op: Any
) -> Iterator[torch.Tensor]:
    """Each group's local share ``local(items)``, all-reduced in place with ``op`` over its group.

    One collective per group of more than one rank (none for ``None``), issued in an order every rank agrees on
    (by the group's ranks, then its name): ranks that share two groups must reduce them in the same order. Every
    rank of a group must pass that group as a key. The statistics of :func:`norm_of_grads`,
    :func:`zeros_of_grads` and :mod:`pgregistry.grad_buffer` all reduce through this.
    """
    for group, items in _in_collective_order(items_by_group):
        share = local(items)
        _all_reduce(share, op, group)
        yield share


def _local_zeros(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Zero elements in ``grads`` as a 0-dim int64 tensor: numel minus the L0 norms, one fused call per
    (device, dtype) and no mask the size of the grads (``count_nonzero`` allocates one per tensor on CUDA).
    The L0 norms accumulate in float64, exact up to 2**53 elements."""
    numel = sum(grad.numel() for grad in grads)
    nonzero = torch.zeros((), dtype=torch.float64, device=device)
    for same_kind in _by_kind(grads).values():
        nonzero += torch.stack(torch._foreach_norm(same_kind, 0, dtype=torch.float64)).sum().to(device)
    return numel - nonzero.to(torch.int64)


def clip_grads_(
    grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor | float
) -> torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` where that is below 1.

    The coefficient is clamped at 1 as a tensor, so nothing waits on the device; scaling by exactly 1 leaves a
    grad unchanged. Returns the clamped coefficient (a 0-dim float32 tensor).
    """
    if not max_norm > 0 or math.isinf(max_norm):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    device = grads[0].device if grads else _tensor_device(total_norm)
    norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
    coeff = torch.clamp(max_norm / (norm + CLIP_EPSILON), max=1.0)
    for (grad_device, _), same_kind in _by_kind(grads).items():
        torch._foreach_mul_(same_kind, coeff.to(grad_device))
    return coeff


def _checked_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    return p


def _local_share(grads: Sequence[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """Sum of ``|g|^p`` (max of ``|g|`` for the inf-norm) over ``grads``, as a 0-dim float32 tensor."""
    share = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dtype), same_kind in _by_kind(grads).items():
        # One fused kernel per (device, dtype) instead of a launch per tensor; norms accumulate in float32 at least
        # (float64 grads stay float64 until their share is summed).
        accumulate = torch.promote_types(dtype, torch.float32)
        norms = torch.stack(torch._foreach_norm(same_kind, p, dtype=accumulate))
        part = norms.max() if math.isinf(p) else norms.pow(p).sum()
        part = part.to(device=device, dtype=torch.float32)
        share = torch.maximum(share, part) if math.isinf(p) else share + part
    return share


def _by_kind(grads: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The non-empty ``grads`` by (device, dtype): the unit of one fused ``torch._foreach_*`` call."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if grad.numel():
            by_kind[(grad.device, grad.dtype)].append(grad)
    return by_kind


def _all_reduce(tensor: torch.Tensor, op: Any, group: ProcessGroup | None) -> None:
    # None is an axis that is off: nothing to reduce (and None would mean WORLD to torch.distributed).
    if group is not None and group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _in_collective_order(items_by_group: Mapping[ProcessGroup | None, V]) -> list[tuple[ProcessGroup | None, V]]:
    """Items ordered identically on every rank: ranks that share two groups must reduce them in the same order."""

    def key(item: tuple[ProcessGroup | None, V]) -> tuple[int, tuple[int, ...], str]:
        group = item[0]
        if group is None:
            return (0, (), "")
        return (1, tuple(dist.get_process_group_ranks(group)), str(getattr(group, "group_name", "")))

    return sorted(items_by_group.items(), key=key)


def backend_device(group: ProcessGroup | None) -> torch.device:
    """The device collectives over ``group`` (the default group for ``None``) need: CUDA for NCCL, else CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduction_device(grads: Iterable[torch.Tensor], groups: Iterable[ProcessGroup | None]) -> torch.device:
    """Where statistics of ``grads`` are computed and reduced: the first grad's device; with no grads on this
    rank, the device the first NCCL group among ``groups`` needs (``None`` skipped), else CPU."""
    for grad in grads:
        return grad.device
    for group in groups:
        if group is not None and (device := backend_device(group)).type == "cuda":
            return device
    return torch.device("cpu")


def _device_of(grads_by_group: GradsByGroup) -> torch.device:
    return reduction_device((grad for grads in grads_by_group.values() for grad in grads), grads_by_group)


def _tensor_device(value: torch.Tensor | float) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


# ----------------------------------------------------------------------------------------------- functional API


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


def _checked_params(model_or_params: ParamsLike, pg_collection: ProcessGroupCollection | None) -> list[torch.Tensor]:
    """The parameters of ``model_or_params``; for a model or model chunks, refuse unclassified expert parameters
    first."""
    chunks = model_chunks_of(model_or_params)
    if chunks:
        check_expert_classification(chunks, pg_collection)
    return [param for _, param in named_parameters_of(model_or_params)]


def grad_norm(
    params: ParamsLike, pg_collection: ProcessGroupCollection | None, *, norm_type: float = 2.0
) -> torch.Tensor:
    """The global ``norm_type``-norm of the grads of ``params`` (a model, its parameters, ...) on its collection.

    Each grad is classified by its parameter's roles (:func:`is_counted`, :func:`reduce_group_of`). Given a
    model or model chunks, parameters of a marked expert module without an EP classification raise ``ValueError`` first
    (:func:`~pgregistry.params.check_expert_classification`). Collective over the collection's ``mp`` and
    ``tp_ep_pp`` groups. Returns a 0-dim float32 tensor on the grads' device.
    """
    groups = StatsGroups.from_collection(pg_collection)
    return norm_of_grads(classify_grads(_checked_params(params, pg_collection), groups), norm_type)


def count_zeros(params: ParamsLike, pg_collection: ProcessGroupCollection | None) -> int:
    """The global number of zero grad elements of ``params``, each distinct element counted once."""
    groups = StatsGroups.from_collection(pg_collection)
    return int(zeros_of_grads(classify_grads(_checked_params(params, pg_collection), groups)).item())


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
    groups = StatsGroups.from_collection(pg_collection)
    param_list = _checked_params(params, pg_collection)
    total = norm_of_grads(classify_grads(param_list, groups), norm_type)
    clip_grads_([param.grad for param in param_list if param.grad is not None], max_norm, total)
    return total
