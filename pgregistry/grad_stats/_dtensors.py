"""DTensor grads in grad statistics: each local piece counted as its placements and roles say.

FSDP2 (``fully_shard``), ``parallelize_module`` and ``distribute_tensor`` leave DTensor grads. A
DTensor's local piece (``to_local()``) is classified per mesh dim it spans, the dim's group matched
to a group of the collection:

* a dim inside the parameter's reduction group (``mp`` for dense, ``tp_ep_pp_with_egtp_remat`` for
  experts: TP, EP, PP): ``Shard`` pieces are distinct and summed there; ``Replicate`` copies are
  counted on the dim's rank 0 only;
* a dim outside it (a data-parallel group: ``dp_cp``, ``expt_dp``, HSDP's ``intra_dp_cp`` /
  ``inter_dist_opt``): ``Shard`` pieces are summed over that group first (one all-reduce per such
  collection field, in field order, by the one reducer,
  :func:`~pgregistry.grad_stats._reductions.reduce_shares`); ``Replicate`` copies are each counted
  by their own replica, as plain grads are;
* ``Partial``: the pending reduction is done first, on a copy of the local tensor, then it counts as
  ``Replicate``.

Axes the DTensor does not span are decided by the roles, as for plain grads: not TP-sharded
(GTP-sharded) is counted on TP (GTP) rank 0; a routed expert (``allreduce=False``) is distinct per
EP rank and summed over the expert group. A placement that contradicts a role is an error naming the
parameter, never a silent default: a routed expert whose grad is ``Replicate`` over a dim spanning
EP is exactly the xorl report (per-expert LoRA factors treated as EP-replicated, norm low by
1/sqrt(ep)). So is a mesh dim that is no group of the collection, one that straddles the reduction
group, a parameter laid out over an expert group without an EP classification, or a routed expert
laid out over a dense group. No collective is ever issued on a DTensor: only on local tensors and
shares, over the collection's groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pgregistry.collection import GroupName, ProcessGroupCollection
from pgregistry.layout import EXPERT_GROUP_KINDS
from pgregistry.params import is_expert_param

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "DTensorGrad",
    "Decision",
    "MeshAxes",
    "classify_dtensor_grad",
    "decision_of",
    "is_dtensor",
    "is_partial",
    "mesh_ranks",
]

_EXPERT_FIELDS: Final = frozenset({*EXPERT_GROUP_KINDS, "intra_expt_dp"})
"""Fields of the expert grid.

A dense parameter's mesh dim must not be one of these only (and vice versa).
"""

_PARTIAL_OPS: Final = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (torch.distributed.tensor imported only if torch has it)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_partial(grad: DTensor) -> bool:
    """Whether ``grad`` has a pending reduction (``Partial``): reading it is collective."""
    from torch.distributed.tensor import Partial

    return any(isinstance(placement, Partial) for placement in grad.placements)


class MeshAxes:
    """The collection's groups by rank set, and the decisions of one statistics call by layout.

    By rank set, so a mesh dim can be named by the collection fields it equals; the decisions are
    cached by layout (mesh, placements, roles), so classifying thousands of grads costs a dictionary
    look-up each."""

    def __init__(
        self, collection: ProcessGroupCollection, reduce_groups: Mapping[bool, ProcessGroup | None]
    ) -> None:
        self.rank = dist.get_rank()
        self.collection = collection
        self.fields: dict[frozenset[int], list[GroupName]] = {}
        self._field_ranks: dict[GroupName, frozenset[int]] = {}
        for name, value in collection.items():
            if name != "hcp" and isinstance(value, ProcessGroup):
                ranks = frozenset(dist.get_process_group_ranks(value))
                self.fields.setdefault(ranks, []).append(name)
                self._field_ranks[name] = ranks
        self.reduce_groups = reduce_groups
        self.reduce_ranks = {
            expert: self.ranks_of(group) for expert, group in reduce_groups.items()
        }
        self.decisions: dict[tuple[Any, ...], Decision] = {}

    def ranks_of(self, group: ProcessGroup | None) -> frozenset[int]:
        """The ranks of ``group`` (``None``: this rank alone)."""
        return frozenset([self.rank] if group is None else dist.get_process_group_ranks(group))

    def field_ranks(self, name: GroupName) -> frozenset[int]:
        """The ranks of the collection's ``name`` group (this rank alone when unset or off)."""
        return self._field_ranks.get(name, frozenset([self.rank]))


@attrs.frozen(slots=True, kw_only=True)
class DTensorGrad:
    """How one DTensor grad enters the statistics on this rank.

    ``piece`` is the grad's local tensor (what clipping scales); ``local`` is what is counted
    (``piece``, or a reduced copy for a ``Partial`` grad), counted on this rank when ``counted``;
    ``outer`` is the collection field it is summed over before the reduction group (``None``: none);
    ``expert`` picks the reduction group (``tp_ep_pp``, else ``mp``).
    """

    piece: torch.Tensor
    local: torch.Tensor
    counted: bool
    outer: GroupName | None
    expert: bool


@attrs.frozen(slots=True)
class _Dim:
    index: int
    name: str
    ranks: frozenset[int]
    fields: list[GroupName]
    placement: Any


@attrs.frozen(slots=True)
class Decision:
    """How a DTensor grad is counted on this rank, and what it is summed over first.

    ``counted``, summed over the ``outer`` field first (``None``: no field), after the pending
    reductions over the ``partial`` dims."""

    counted: bool
    outer: GroupName | None
    partial: tuple[_Dim, ...]


def classify_dtensor_grad(
    name: str,
    param: torch.Tensor,
    grad: DTensor,
    axes: MeshAxes,
    verdicts: tuple[bool, bool],
    *,
    expert: bool | None = None,
) -> DTensorGrad:
    """Classify ``grad`` (a DTensor) of ``param`` named ``name``; see the module docstring.

    ``verdicts`` say whether this rank counts the grad as far as TP and GTP go when no mesh dim
    spans that axis (the roles' verdict, or the replication audit's measurement); ``expert``
    overrides the role's routed-expert verdict (the audit's measured truth). Collective only for a
    ``Partial`` grad (one all-reduce of a copy of its local tensor per partial dim, over the
    matching collection group). Raises ``ValueError`` naming ``name`` on a mesh/collection/role
    mismatch.
    """
    expert = is_expert_param(param) if expert is None else expert
    decision = decision_of(name, param, grad, axes, verdicts, expert=expert)
    # What to_local() returns a view of, without the autograd Function call to_local() costs per
    # grad.
    piece = grad._local_tensor
    local = piece
    for dim in decision.partial:
        local = _copy_with_partial_reduced(local, dim, axes)
    return DTensorGrad(
        piece=piece, local=local, counted=decision.counted, outer=decision.outer, expert=expert
    )


def decision_of(
    name: str,
    param: torch.Tensor,
    grad: DTensor,
    axes: MeshAxes,
    verdicts: tuple[bool, bool],
    *,
    expert: bool | None = None,
) -> Decision:
    """How ``grad`` is counted, decided once per (mesh, placements, roles) and kept in ``axes``.

    That is :func:`classify_dtensor_grad` without the pending reduction: never collective."""
    expert = is_expert_param(param) if expert is None else expert
    # Everything a decision depends on, as one flat tuple (built per grad: no intermediate objects).
    key = (
        id(grad.device_mesh),
        grad.placements,
        expert,
        verdicts,
        getattr(param, "tensor_model_parallel", None),
        getattr(param, "is_gtp_weight_remat", None),
        getattr(param, "shared", None),
        hasattr(param, "allreduce"),
    )
    decision = axes.decisions.get(key)
    if decision is None:
        decision = axes.decisions[key] = _decide_dtensor_reduction(
            name, param, grad, axes, verdicts, expert
        )
    return decision


def _decide_dtensor_reduction(
    name: str,
    param: torch.Tensor,
    grad: DTensor,
    axes: MeshAxes,
    verdicts: tuple[bool, bool],
    expert: bool,
) -> Decision:
    from torch.distributed.tensor import Partial, Replicate

    mesh = grad.device_mesh
    dims = []
    for index, placement in enumerate(grad.placements):
        dim_name = mesh.mesh_dim_names[index] if mesh.mesh_dim_names else str(index)
        ranks = frozenset(dist.get_process_group_ranks(mesh.get_group(index)))
        if len(ranks) == 1:
            continue
        fields = axes.fields.get(ranks)
        if not fields:
            raise ValueError(
                f"{name}: its grad's mesh dim {dim_name!r} spans ranks {sorted(ranks)}, "
                "which are no group of the collection the statistics run on; build the "
                "mesh from the collection (pgregistry.mesh.to_device_mesh) so that "
                "every mesh dim is one of its groups"
            )
        dims.append(_Dim(index, dim_name, ranks, fields, placement))
    _check_grid(name, param, expert, dims, axes.field_ranks("expt_dp"))

    reduce_ranks = axes.reduce_ranks[expert]
    counted = not getattr(param, "shared", False)
    outer: list[_Dim] = []
    for dim in dims:
        sharded = _is_shard(dim.placement)
        if not sharded and not isinstance(dim.placement, Replicate | Partial):
            raise ValueError(
                f"{name}: placement {dim.placement!r} on mesh dim {dim.name!r} is not supported"
            )
        if dim.ranks <= reduce_ranks:
            counted = counted and (sharded or mesh.get_local_rank(dim.index) == 0)
        elif dim.ranks & reduce_ranks == {axes.rank}:
            if sharded:
                outer.append(dim)
        else:
            raise ValueError(
                f"{name}: mesh dim {dim.name!r} (the collection's {dim.fields[0]!r}) "
                f"straddles the parameter's {'expert' if expert else 'dense'} "
                "reduction group: part of it is model-parallel, part not"
            )
    if len(outer) > 1:
        raise ValueError(
            f"{name}: sharded over {len(outer)} data-parallel mesh dims {[d.name for d in outer]}; "
            "flatten them into one dim that is a group of the collection (dp_cp, expt_dp)"
        )
    spanned = _axes_spanned_by_mesh(name, param, expert, dims, axes)
    for axis, verdict in zip(("tp", "gtp"), verdicts, strict=True):
        if axis not in spanned:
            counted = counted and verdict
    partial = tuple(dim for dim in dims if isinstance(dim.placement, Partial))
    return Decision(counted=counted, outer=outer[0].fields[0] if outer else None, partial=partial)


def mesh_ranks(tensor: torch.Tensor, rank: int) -> frozenset[int]:
    """The ranks of ``tensor``'s mesh if it is a DTensor; ``{rank}`` for a plain tensor."""
    if not is_dtensor(tensor):
        return frozenset([rank])
    return frozenset(tensor.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]


def _check_grid(
    name: str, param: torch.Tensor, expert: bool, dims: Sequence[_Dim], expert_dp: frozenset[int]
) -> None:
    """Refuse a parameter laid out over a group of the wrong grid.

    A parameter laid out over an expert-grid group must say how it stands to EP; an expert must not
    be laid out over a dense-grid group, unless the group lies inside its expert data-parallel
    group: HSDP's replicate group ``inter_dist_opt`` serves both grids (as in Megatron-Core), and
    there it crosses no EP or expert-TP rank."""
    for dim in dims:
        only_expert = all(field in _EXPERT_FIELDS for field in dim.fields)
        only_dense = not any(field in _EXPERT_FIELDS for field in dim.fields)
        if only_expert and not hasattr(param, "allreduce"):
            raise ValueError(
                f"{name}: its grad is laid out over mesh dim {dim.name!r}, the "
                f"collection's expert group {dim.fields[0]!r}, but the parameter "
                "carries no EP classification; mark it with mark_expert (distinct per "
                "EP rank) or mark_expert_replicated (replicated across EP): counting "
                "it as replicated would make the norm low by 1/sqrt(ep) when it is not"
            )
        if only_dense and expert and not dim.ranks <= expert_dp:
            raise ValueError(
                f"{name}: a routed expert (allreduce=False) laid out over mesh dim "
                f"{dim.name!r}, the collection's dense group {dim.fields[0]!r}; "
                "lay experts out over the expert groups (expt_dp, ep, expt_tp)"
            )


def _axes_spanned_by_mesh(
    name: str, param: torch.Tensor, expert: bool, dims: Sequence[_Dim], axes: MeshAxes
) -> set[str]:
    """The axes among tp, gtp and ep that some mesh dim spans.

    Refuse a ``Replicate`` placement over one of them for a parameter whose role says it is distinct
    there (for EP: a routed expert, whose dims spanning EP all lie in its reduction group, so
    ``Replicate`` there would count one copy)."""
    claims: dict[str, tuple[GroupName, bool]] = {
        "tp": ("expt_tp" if expert else "tp", bool(getattr(param, "tensor_model_parallel", False))),
        "gtp": (
            "expt_gtp_remat" if expert else "gtp_remat",
            bool(getattr(param, "is_gtp_weight_remat", False)),
        ),
        "ep": ("ep", expert),
    }
    spanned: set[str] = set()
    for axis, (field, distinct) in claims.items():
        ranks = axes.field_ranks(field)
        over = [dim for dim in dims if len(dim.ranks & ranks) > 1]
        if not over:
            continue
        spanned.add(axis)
        if distinct and not any(_is_shard(dim.placement) for dim in over):
            raise ValueError(
                f"{name}: marked distinct per {axis.upper()} rank, but its grad is "
                f"{over[0].placement!r} over mesh dim {over[0].name!r}, which spans "
                f"{axis.upper()}; the placement would count one copy where each rank holds "
                f"a different piece (norm low by 1/sqrt({len(over[0].ranks & ranks)})). "
                "Give the DTensor a Shard placement there, or fix the role"
            )
    return spanned


def _is_shard(placement: Any) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"


def _copy_with_partial_reduced(local: torch.Tensor, dim: _Dim, axes: MeshAxes) -> torch.Tensor:
    """``local`` with the pending ``Partial`` reduction over ``dim`` done.

    Done on a copy: the grad is untouched.
    """
    op = dim.placement.reduce_op
    if op not in _PARTIAL_OPS:
        raise ValueError(f"Partial({op!r}) grads are not supported")
    reduced = local.detach().clone()
    dist.all_reduce(
        reduced,
        op=getattr(dist.ReduceOp, _PARTIAL_OPS[op]),
        group=axes.collection.get(dim.fields[0]),
    )
    return reduced / len(dim.ranks) if op == "avg" else reduced
