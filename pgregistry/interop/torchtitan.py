"""torchtitan interop: its ``ParallelDims`` and a pgregistry collection on one set of communicators.

torchtitan 0.3 builds its meshes by unflattening one world mesh into several views (data loading,
dense, sparse, loss), and every view gets process groups of its own: with ``ParallelDims(dp_shard=4,
tp=2, ep=4)`` on 8 ranks a rank holds 9 communicators for 4 distinct rank sets (``batch``, ``loss``,
``dp`` and ``dp_shard`` are four communicators over the same ranks). This module moves between the
two without a second set:

* :func:`from_parallel_dims` returns a collection holding torchtitan's own communicators (one per
  rank set, the others it holds are left alone) on the :class:`~pgregistry.layout.ParallelLayout`
  torchtitan's sizes describe (its ``layout``), and teaches pgregistry those communicators; it
  creates no group;
* :func:`to_parallel_dims` hands torchtitan a ``ParallelDims`` whose every mesh and submesh is made
  of the collection's communicators (``DeviceMesh.from_group``), one per distinct rank set (expert
  FSDP gets a second one where its ranks are the dense FSDP ranks, which FSDP2 needs);
* :func:`mark_torchtitan_experts` marks torchtitan's routed-expert modules, so grad statistics
  refuse an expert parameter that lost its classification instead of counting it as dense;
* :func:`communicator_ranks` lists the real communicators this process holds, for proving the above.

torchtitan's rank sets are a pgregistry layout in the default order ``tp-cp-ep-dp-pp``: its dense
meshes put TP fastest, then CP, then ``dp_shard``, then ``dp_replicate``, then PP; its expert
parallelism borrows consecutive ranks of ``dp_shard x cp x tp`` (EP fastest in the expert grid) with
expert TP 1, its ``efsdp`` is the rest of the expert data-parallel ranks. With EP off torchtitan
shards the experts over the dense TP axis instead, so the layout's expert TP is then the TP size.
``dp_replicate`` is HSDP's replicate axis: the collection carries it as ``inter_dist_opt``, with
``intra_dp_cp`` / ``intra_expt_dp`` the shard groups (:func:`pgregistry.mesh.with_hsdp_groups`).

Like torchtitan, dims it leaves without communication (size 1, or ``efsdp`` with EP off) get groups
of torch's ``fake`` backend, which are no communicators; ``fsdp``, ``dp_shard`` (``efsdp`` under EP)
and ``loss`` keep a real group even at size 1, as torchtitan keeps them, and that one-rank group is
pgregistry's.

torchtitan is imported inside the functions: ``import pgregistry.interop.torchtitan`` works without
it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, cast

import attrs

from pgregistry._runtime.agreement import check_agreement, require_distributed
from pgregistry._runtime.logger import get_logger
from pgregistry._runtime.resolve import check_usable, require_module
from pgregistry.collection import NOT_MEMBER, UNSET, GroupName, ProcessGroupCollection, group_size
from pgregistry.layout import GROUP_KINDS, ParallelLayout
from pgregistry.mesh import device_type_problem

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


__all__ = [
    "SPMD_BACKENDS",
    "communicator_ranks",
    "from_parallel_dims",
    "mark_torchtitan_experts",
    "to_parallel_dims",
]

_log = get_logger(__name__)

SPMD_BACKENDS: Final = ("spmd_types", "full_dtensor", "partial_dtensor")
"""torchtitan 0.3's ``ParallelismConfig.spmd_backend`` values; each builds another dense mesh."""

_VIEWS: Final[dict[str, tuple[str, ...]]] = {
    "dataloading": ("pp", "batch", "cp", "tp"),
    "dense": ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    "dense_fsdp": ("pp", "dp_replicate", "fsdp", "tp"),  # the dense mesh of partial_dtensor
    "fwdbwd": ("pp", "dp", "cp", "tp"),  # spmd_types only
    "sparse": ("pp", "dp_replicate", "efsdp", "ep"),
}
"""torchtitan's views of the world, slowest dim first.

Each is the world's ranks reshaped to the dims' sizes.
"""

_LOSS: Final = ("batch", "cp")
"""The dataloading dims torchtitan flattens into its ``loss`` mesh."""

_CANNOT: Final = "found what torchtitan cannot run on these groups"
"""What a refusal of the conversion says of the ranks that found a problem."""

_SAME_OPTIONS: Final = (
    "every rank must call it with the same collection layout and options, collectively"
)
"""What a refusal of options that differ across ranks advises."""

_SINGLE_AXIS_SOURCE: Final[dict[str, str]] = {
    "pp": "dataloading",
    "batch": "dataloading",
    "cp": "dataloading",
    "tp": "dataloading",
    "ep": "sparse",
    "efsdp": "sparse",
}
"""The view torchtitan slices each one-dimensional mesh from (``dp_replicate`` and the dense
data-parallel dims come from the dense view, ``dp`` from the forward/backward one, ``loss`` is its
own mesh)."""

_DENSE_AXES: Final[dict[str, tuple[str, ...]]] = {
    "spmd_types": ("dp", "cp", "tp"),
    "full_dtensor": ("dp_replicate", "dp_shard", "cp", "tp"),
    "partial_dtensor": ("dp_replicate", "fsdp", "tp"),
}
"""Per backend, the dense axes torchtitan's SPMD meshes are activated from."""

_SPARSE_AXES: Final = ("dp_replicate", "efsdp", "ep")


@attrs.frozen(slots=True)
class _Sizes:
    """torchtitan's parallel degrees (``ParallelDims``'s fields) and their dims' sizes."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int

    def dim_sizes(self) -> dict[str, int]:
        """Every dim torchtitan builds -> its size."""
        shard = self.dp_shard * self.cp
        return {
            "pp": self.pp,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "batch": self.dp_replicate * self.dp_shard,
            "dp": self.dp_replicate * self.dp_shard,
            "fsdp": shard,
            "efsdp": shard * self.tp // self.ep,
            "loss": self.dp_replicate * shard,
        }

    def layout(self) -> ParallelLayout:
        """The pgregistry layout with torchtitan's rank sets (see the module docstring)."""
        return ParallelLayout(
            num_ranks=self.world_size,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            ep=self.ep,
            expt_tp=1 if self.ep > 1 else self.tp,
        )

    def partition(self, dim: str) -> torch.Tensor:
        """Every group of ``dim`` as torchtitan builds it, ``[groups, ranks]``.

        ``loss`` is batch x cp flattened.
        """
        import torch

        sizes = self.dim_sizes()
        view, dims = ("dataloading", _LOSS) if dim == "loss" else _view_with(dim)
        names = _VIEWS[view]
        grid = torch.arange(self.world_size).reshape([sizes[name] for name in names])
        inner = [names.index(d) for d in dims]
        outer = [i for i in range(len(names)) if i not in inner]
        return grid.permute(*outer, *inner).reshape(-1, math.prod(sizes[d] for d in dims))


def _view_with(dim: str) -> tuple[str, tuple[str, ...]]:
    for view, names in _VIEWS.items():
        if dim in names:
            return view, (dim,)
    raise AssertionError(f"no view has dim {dim!r}")


_KIND_OF: Final[dict[str, GroupName]] = {
    "pp": "pp",
    "cp": "cp",
    "tp": "tp",
    "ep": "ep",
    "batch": "dp",
    "dp": "dp",
    "loss": "dp_cp",
}
"""torchtitan dims that are a layout group kind, which the collection field of the same name
holds."""


def _field_of(dim: str, sizes: _Sizes) -> GroupName | None:
    """The collection field holding ``dim``'s ranks; ``None`` for ``dp_shard`` under HSDP with CP.

    No field holds that one (the replicate split of ``dp``, without CP)."""
    hsdp = sizes.dp_replicate > 1
    fields: dict[str, GroupName | None] = {
        **_KIND_OF,
        "fsdp": "intra_dp_cp" if hsdp else "dp_cp",
        "efsdp": "intra_expt_dp" if hsdp else "expt_dp",
        "dp_replicate": "inter_dist_opt",
        "dp_shard": ("intra_dp_cp" if sizes.cp == 1 else None) if hsdp else "dp",
    }
    return fields[dim]


_SPLIT_OF: Final[dict[str, str]] = {
    "fsdp": "dp_cp",
    "dp_shard": "dp",
    "efsdp": "expt_dp",
    "dp_replicate": "dp_cp",
}
"""torchtitan dims that split a layout kind for HSDP: its ``dp_replicate`` contiguous blocks
(``dp_replicate``: the ranks at the same place in each block)."""


def _layout_partition(layout: ParallelLayout, dp_replicate: int, dim: str) -> torch.Tensor:
    """Every group of ``dim`` by pgregistry's rank arithmetic: a layout kind, or its HSDP split."""
    if dim in _KIND_OF:
        return layout.groups_tensor(_KIND_OF[dim])
    groups = layout.groups_tensor(_SPLIT_OF[dim])
    blocks = groups.reshape(-1, dp_replicate, groups.shape[1] // dp_replicate)
    if dim == "dp_replicate":
        return blocks.transpose(1, 2).reshape(-1, dp_replicate)
    return blocks.reshape(-1, groups.shape[1] // dp_replicate)


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return {frozenset(row) for row in a.tolist()} == {frozenset(row) for row in b.tolist()}


def _row_of(partition: torch.Tensor, rank: int) -> tuple[int, ...]:
    return tuple(sorted(partition[(partition == rank).any(dim=1)][0].tolist()))


# ----------------------------------------------------------------------------------------- problems


# --------------------------------------------------------------------------------- to_parallel_dims


def to_parallel_dims(
    collection: ProcessGroupCollection,
    *,
    spmd_backend: str = "spmd_types",
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> Any:
    """A torchtitan ``ParallelDims`` for ``collection``'s layout whose meshes are its communicators.

    Every mesh torchtitan's code asks for (``get_mesh`` / ``get_optional_mesh`` of one or several
    dims, the dense and sparse meshes, ``loss``, ``batch``, ``get_all_one_dimensional_meshes``,
    ``spmd_meshes``, ``world_mesh``) is built with ``DeviceMesh.from_group`` from the collection's
    groups: ``tp``, ``cp``, ``pp``, ``ep``; ``dp`` for ``batch`` / ``dp`` (and ``dp_shard`` without
    HSDP); ``dp_cp`` for ``loss`` and ``fsdp``; ``expt_dp`` for ``efsdp``; under HSDP
    (``collection.inter_dist_opt`` set, as :func:`pgregistry.mesh.with_hsdp_groups` sets it)
    ``inter_dist_opt`` for ``dp_replicate``, ``intra_dp_cp`` / ``intra_expt_dp`` for ``fsdp`` /
    ``efsdp``. So the meshes hold one communicator per distinct rank set, with one exception: where
    the expert FSDP ranks are the dense FSDP ranks (EP = TP), ``efsdp`` gets a second communicator
    over them, created by this call, because FSDP2 cannot shard one block's dense and expert
    parameters on two meshes over one communicator. The world, the one-rank group of a size-1 dim
    torchtitan keeps real, and ``dp_shard`` under HSDP with CP (no field holds it) are pgregistry's
    communicators of those rank sets. Dims torchtitan leaves to the ``fake`` backend get fake
    groups. Collective over the world.

    Args:
        collection: a collection built by :func:`pgregistry.registry.build` over the whole world.
        spmd_backend: torchtitan's SPMD backend (``SPMD_BACKENDS``).
        device_type: the meshes' device type (default: torchtitan's own,
            ``torchtitan.distributed.parallel_dims.device_type``, "cuda" when it finds no
            accelerator).
        backend: the backend of the groups pgregistry does not have yet (default: the world's).
        timeout: their timeout, a ``timedelta`` or seconds (default: the world's).

    Returns:
        torchtitan's ``ParallelDims``, its meshes built.

    Raises:
        ValueError: on every rank, naming the culprit, before any group or mesh is made: options
            that differ across ranks (``spmd_backend``, ``device_type``, ``backend``, ``timeout``,
            the layout: each named, with which ranks asked for what); a layout torchtitan cannot
            express (expert TP other than 1 under EP, GTP remat, EP not dividing ``dp_shard x cp x
            tp``, an order giving other rank sets); a layout over part of the world; a collection
            field missing or holding other ranks than torchtitan's; a collection without a layout
            (assembled by hand); a ``device_type`` that is no torch device type (``"gpu"``).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), on the
        CPU; torchtitan's parallelize functions take the result (``parallelize_qwen3(model,
        parallel_dims, job_config)``):

        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> parallel_dims = to_parallel_dims(pg, device_type="cpu")
        >>> parallel_dims.tp, parallel_dims.get_mesh("tp").get_group() is pg.get("tp")
        (2, True)
    """
    from torchtitan.distributed import parallel_dims as titan_parallel_dims

    require_distributed("to_parallel_dims")
    if not isinstance(collection, ProcessGroupCollection):
        check_usable(collection, "to_parallel_dims")  # the TypeError naming what it got
    # Registers torch's "fake" backend.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    layout = collection.layout
    device = device_type if device_type is not None else titan_parallel_dims.device_type
    # Every option that shapes the meshes or their communicators must be the same on every rank:
    # ranks asking for different SPMD backends build different meshes (different groups, in a
    # different order) and wait on each other. Every fault is found before the agreement and raised
    # through it: a rank raising alone (outside a span, say) would leave the others waiting in a
    # collective.
    options = {
        "layout": repr(layout),
        "spmd_backend": repr(spmd_backend),
        "device_type": repr(device),
        "backend": repr(backend),
        "timeout": repr(timeout),
    }
    problems = _usable_problems(collection)
    device_problem = device_type_problem(device)
    if device_problem is not None:
        problems.append(device_problem)
    if not problems:
        assert layout is not None  # a collection without one is a problem above
        sizes, problems = _sizes_of_layout(layout, collection, spmd_backend)
        if not problems:
            problems = _layout_problems(layout, sizes) + _collection_problems(
                collection, sizes, spmd_backend
            )
    check_agreement(
        "to_parallel_dims",
        options,
        "; ".join(problems) or None,
        failed=_CANNOT,
        advice=_SAME_OPTIONS,
    )
    parallel_dims = titan_parallel_dims.ParallelDims(
        dp_replicate=sizes.dp_replicate,
        dp_shard=sizes.dp_shard,
        cp=sizes.cp,
        tp=sizes.tp,
        pp=sizes.pp,
        ep=sizes.ep,
        world_size=sizes.world_size,
        spmd_backend=spmd_backend,
    )
    found = _GroupSource(sizes, collection, spmd_backend, backend, timeout)
    groups = {dim: found.group(dim, _is_real(parallel_dims, dim)) for dim in _dims_of(spmd_backend)}
    _install_meshes(parallel_dims, groups, found.world(), spmd_backend, device)
    _log.debug("to_parallel_dims", layout=repr(layout), spmd_backend=spmd_backend)
    return parallel_dims


def _usable_problems(collection: ProcessGroupCollection) -> list[str]:
    """What makes ``collection`` unusable here.

    A layout over part of the world, destroyed groups, or no layout.
    """
    import torch.distributed as dist

    layout = collection.layout
    if layout is not None and layout.rank_range() != (0, dist.get_world_size()):
        first, stop = layout.rank_range()
        return [
            "to_parallel_dims needs a layout over the whole world (torchtitan's "
            f"ParallelDims spans every rank), and {collection.describe()} spans "
            f"ranks {first}-{stop - 1} of the {dist.get_world_size()}-rank world"
        ]
    try:
        check_usable(collection, "to_parallel_dims")
    except ValueError as exc:
        return [str(exc)]
    if layout is None:
        return [
            "to_parallel_dims needs the collection's layout (torchtitan's sizes), and "
            "this collection was assembled by hand; build it with pgregistry.build(layout)"
        ]
    return []


def _views_of(spmd_backend: str) -> tuple[str, ...]:
    """The views torchtitan builds under ``spmd_backend``."""
    dense = "dense_fsdp" if spmd_backend == "partial_dtensor" else "dense"
    return ("dataloading", dense, "sparse") + (("fwdbwd",) if spmd_backend == "spmd_types" else ())


def _dims_of(spmd_backend: str) -> tuple[str, ...]:
    """The dims torchtitan builds under ``spmd_backend``, in one order (all ranks walk it alike)."""
    dims = dict.fromkeys(dim for view in _views_of(spmd_backend) for dim in _VIEWS[view])
    return (*dims, "loss")


def _is_real(parallel_dims: Any, dim: str) -> bool:
    """Whether torchtitan gives ``dim`` a real backend.

    Its own rule; ``loss`` is flattened, always real.
    """
    size = _sizes_of_titan(parallel_dims).dim_sizes()[dim]
    return dim == "loss" or bool(parallel_dims._mesh_exist(dim, size))


def _sizes_of_layout(
    layout: ParallelLayout, collection: ProcessGroupCollection, spmd_backend: str
) -> tuple[_Sizes, list[str]]:
    """torchtitan's degrees for ``layout``, and what makes the layout one torchtitan cannot run.

    ``dp_replicate`` is the size of ``collection.inter_dist_opt``, 1 when unset or off."""
    replicate = collection.get_or("inter_dist_opt", None)
    dp_replicate = group_size(replicate) if replicate is not None else 1
    problems: list[str] = []
    if spmd_backend not in SPMD_BACKENDS:
        problems.append(f"spmd_backend {spmd_backend!r} is none of torchtitan's {SPMD_BACKENDS}")
    if layout.gtp_remat != 1 or layout.expt_gtp_remat != 1:
        problems.append(
            f"torchtitan has no GTP-remat axis (layout gtp_remat={layout.gtp_remat}, "
            f"expt_gtp_remat={layout.expt_gtp_remat})"
        )
    if layout.ep > 1 and layout.expt_tp != 1:
        problems.append(
            f"layout expt_tp={layout.expt_tp} with ep={layout.ep}: "
            "torchtitan shards experts over EP only (expert TP 1)"
        )
    if layout.ep == 1 and layout.expt_tp != layout.tp:
        problems.append(
            f"layout expt_tp={layout.expt_tp} with ep=1: torchtitan shards "
            f"experts over the dense TP axis (expt_tp = tp = {layout.tp})"
        )
    if layout.dp % dp_replicate:
        problems.append(
            f"dp_replicate {dp_replicate} (inter_dist_opt's "
            f"size) does not divide the layout's dp {layout.dp}"
        )
        dp_replicate = 1
    sizes = _Sizes(
        world_size=layout.num_ranks,
        dp_replicate=dp_replicate,
        dp_shard=layout.dp // dp_replicate,
        cp=layout.cp,
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
    )
    borrowed = sizes.dp_shard * sizes.cp * sizes.tp
    if borrowed % sizes.ep:
        problems.append(
            f"layout ep={layout.ep} does not divide dp_shard x cp x tp = {sizes.dp_shard} x "
            f"{sizes.cp} x {sizes.tp} = {borrowed}, the ranks torchtitan's EP borrows from"
        )
    return sizes, problems


def _layout_problems(layout: ParallelLayout, sizes: _Sizes) -> list[str]:
    """Dims whose groups in ``layout`` are not torchtitan's (an order other than the default, say).

    The same on every rank, as whole partitions are compared."""
    problems = []
    for dim in sizes.dim_sizes():
        if dim == "efsdp" and sizes.ep == 1:
            continue  # torchtitan gives it the fake backend and never communicates over it
        ours = _layout_partition(layout, sizes.dp_replicate, dim)
        if not _same_partition(ours, sizes.partition(dim)):
            problems.append(
                f"layout order {layout.order!r} gives torchtitan's {dim!r} dim the "
                f"groups {ours.tolist()[:4]}..., torchtitan builds "
                f"{sizes.partition(dim).tolist()[:4]}...; use the order 'tp-cp-ep-dp-pp'"
            )
    return problems


def _collection_problems(
    collection: ProcessGroupCollection, sizes: _Sizes, spmd_backend: str
) -> list[str]:
    """torchtitan's dims of several ranks whose collection field is UNSET or ``None`` on this rank.

    A collection's groups hold its layout's ranks, which the layout problems above compare with
    torchtitan's."""
    dim_sizes = sizes.dim_sizes()
    problems = []
    for dim in _dims_of(spmd_backend):
        field = _field_of(dim, sizes)
        if field is None or dim_sizes[dim] == 1 or (dim == "efsdp" and sizes.ep == 1):
            continue
        value = collection.get_or(field, UNSET)
        if value is UNSET or value is None:
            state = "UNSET" if value is UNSET else "None (axis off)"
            problems.append(
                f"torchtitan's {dim!r} dim has {dim_sizes[dim]} "
                f"ranks but the collection's {field!r} is {state}"
            )
    return problems


class _GroupSource:
    """Where each dim's group comes from: a field, pgregistry's communicators or a fake group.

    The collection's field, pgregistry's communicators (world, one-rank groups, a rank set no field
    holds) or a fake group. Every rank asks for the same dims in the same order, so the collective
    creations line up."""

    def __init__(
        self,
        sizes: _Sizes,
        collection: ProcessGroupCollection,
        spmd_backend: str,
        backend: str | None,
        timeout: timedelta | float | None,
    ) -> None:
        from pgregistry._runtime.group_cache import GroupOptions

        self.sizes = sizes
        self.collection = collection
        # The dense dim FSDP2 shards over with one communicator of this collection: under the
        # DTensor backends with CP it flattens dp_shard x cp into a group of its own instead.
        self.dense_fsdp = (
            "fsdp" if spmd_backend == "partial_dtensor" else ("dp_shard" if sizes.cp == 1 else None)
        )
        self.options = GroupOptions.of(backend, timeout)
        self.fakes: dict[tuple[int, ...], ProcessGroup] = {}

    def world(self) -> ProcessGroup:
        from pgregistry._runtime.group_cache import CACHE

        group = CACHE.partition_group([range(self.sizes.world_size)], self.options)
        assert group is not None  # every rank is in the world
        return group

    def group(self, dim: str, real: bool) -> ProcessGroup:
        import torch.distributed as dist

        partition = self.sizes.partition(dim)
        if not real:
            return self._fake_group(_row_of(partition, dist.get_rank()))
        field = _field_of(dim, self.sizes)
        if dim == "efsdp" and self.sizes.ep > 1 and self._same_as_dense_fsdp(partition):
            return self._expert_fsdp_twin(partition)
        if partition.shape[1] == 1 or field is None:
            from pgregistry._runtime.group_cache import CACHE

            group = CACHE.partition_group(partition.tolist(), self.options)
            assert group is not None  # the partition covers every rank
            return group
        return cast("ProcessGroup", self.collection.get(field))

    def _same_as_dense_fsdp(self, partition: torch.Tensor) -> bool:
        return self.dense_fsdp is not None and _same_partition(
            partition, self.sizes.partition(self.dense_fsdp)
        )

    def _expert_fsdp_twin(self, partition: torch.Tensor) -> ProcessGroup:
        """A second communicator over the expert FSDP ranks, when they are the dense FSDP ranks.

        That is when EP = TP.

        FSDP2 (torch 2.13) groups the parameters of one ``fully_shard`` call by their shard
        communicator and requires one mesh of theirs per communicator; torchtitan shards a block's
        dense and expert parameters in one call on two meshes (``fsdp`` / ``dp_shard`` and
        ``efsdp``), so the two must be different communicators even over the same ranks. Each call
        creates them afresh, as pgregistry creates its own communicators.
        """
        from pgregistry._runtime.group_cache import CACHE

        group = CACHE.twin_partition_group(partition.tolist(), self.options)
        assert group is not None  # the partition covers every rank
        return group

    def _fake_group(self, ranks: tuple[int, ...]) -> ProcessGroup:
        """A group of torch's ``fake`` backend (no communicator), one per rank set.

        torchtitan gives such groups to the dims it never communicates over. Created by its members
        only, in the same dim order on every rank."""
        import torch.distributed as dist

        if ranks not in self.fakes:
            group = dist.new_group(list(ranks), backend="fake", use_local_synchronization=True)
            assert group is not None and not isinstance(group, int)  # this rank is a member
            self.fakes[ranks] = group
        return self.fakes[ranks]


def _install_meshes(
    parallel_dims: Any,
    groups: Mapping[str, ProcessGroup],
    world: ProcessGroup,
    spmd_backend: str,
    device_type: str,
) -> None:
    """Fill the caches torchtitan's ``build_mesh`` fills with meshes made of ``groups``.

    The caches are ``_world_mesh``, ``_global_meshes``, ``_single_axis_meshes`` and
    ``_spmd_meshes``; torchtitan's own size check and SPMD-mesh selection then run on them. Slicing
    a mesh reuses its groups, so no group is created here."""
    from torch.distributed.device_mesh import DeviceMesh

    sizes = _sizes_of_titan(parallel_dims)
    views = {name: _view_mesh(name, groups, sizes, device_type) for name in _views_of(spmd_backend)}
    loss = DeviceMesh.from_group(groups["loss"], device_type, mesh_dim_names=("loss_mesh",))
    dense = views["dense_fsdp" if spmd_backend == "partial_dtensor" else "dense"]
    global_meshes: dict[str, DeviceMesh] = {
        "dataloading": views["dataloading"],
        "loss": loss,
        "dense": dense,
        "sparse": views["sparse"],
    }
    if spmd_backend == "spmd_types":
        global_meshes["spmd_dense_for_fwdbwd"] = views["fwdbwd"]["dp", "cp", "tp"]
        if sizes.ep > 1:
            global_meshes["spmd_sparse_for_fwdbwd"] = views["sparse"][_SPARSE_AXES]
    single = {dim: views[view][dim] for dim, view in _SINGLE_AXIS_SOURCE.items()}
    single.update(loss=loss, dp_replicate=dense["dp_replicate"])
    if spmd_backend == "spmd_types":
        single["dp"] = global_meshes["spmd_dense_for_fwdbwd"]["dp"]
    for dim in ("dp_shard", "fsdp"):
        if dim in (dense.mesh_dim_names or ()):
            single[dim] = dense[dim]
    parallel_dims._world_mesh = DeviceMesh.from_group(world, device_type, mesh_dim_names=("world",))
    parallel_dims._global_meshes = global_meshes
    parallel_dims._single_axis_meshes = single
    parallel_dims._validate_meshes()
    activated = (
        parallel_dims.get_activated_mesh(list(axes))
        for axes in (_DENSE_AXES[spmd_backend], _SPARSE_AXES)
    )
    parallel_dims._spmd_meshes = [mesh for mesh in activated if mesh is not None]


def _view_mesh(
    view: str, groups: Mapping[str, ProcessGroup], sizes: _Sizes, device_type: str
) -> DeviceMesh:
    """One of torchtitan's views as a mesh over the whole world, its dims made of ``groups``.

    The same rank map as every other view, so meshes sliced from different views concatenate, as
    FSDP2 does with a TP mesh."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    names = _VIEWS[view]
    dim_sizes = sizes.dim_sizes()
    grid = torch.arange(sizes.world_size).reshape([dim_sizes[name] for name in names])
    return DeviceMesh.from_group(
        [groups[name] for name in names], device_type, mesh=grid, mesh_dim_names=names
    )


def _sizes_of_titan(parallel_dims: Any) -> _Sizes:
    return _Sizes(
        world_size=int(parallel_dims.world_size),
        dp_replicate=int(parallel_dims.dp_replicate),
        dp_shard=int(parallel_dims.dp_shard),
        cp=int(parallel_dims.cp),
        tp=int(parallel_dims.tp),
        pp=int(parallel_dims.pp),
        ep=int(parallel_dims.ep),
    )


# ------------------------------------------------------------------------------- from_parallel_dims


_HSDP_FIELDS: Final[dict[GroupName, str]] = {
    "inter_dist_opt": "dp_replicate",
    "intra_dp_cp": "fsdp",
    "intra_expt_dp": "efsdp",
}
"""HSDP fields -> the torchtitan dim with their ranks (set when ``dp_replicate`` > 1)."""

_NOT_BUILT: Final[dict[str, None]] = {"hcp": None, "dp_cp_ag": None, "expt_dp_ag": None}
"""Fields ``registry.build`` leaves ``None`` too.

No hierarchical CP, no second all-gather communicator.
"""


def from_parallel_dims(parallel_dims: Any) -> ProcessGroupCollection:
    """A collection holding torchtitan's communicators, on the layout ``parallel_dims`` describes.

    Each collection field whose ranks torchtitan holds a real communicator for (its one-dimensional
    meshes and the world) gets that communicator, the first of torchtitan's redundant ones in a
    fixed dim order; a field of one rank is ``None`` (axis off); a field no torchtitan mesh holds
    (``mp`` = TP x PP when both are on, say) stays UNSET. Under HSDP (``dp_replicate`` > 1)
    ``inter_dist_opt`` is ``dp_replicate`` and ``intra_dp_cp`` / ``intra_expt_dp`` are ``fsdp`` /
    ``efsdp``. pgregistry adopts every torchtitan communicator (:func:`pgregistry.registry.adopt`),
    so a later ``pgregistry.build(collection.layout)`` reuses them and creates only the rank sets
    torchtitan lacks. Creates no group (so the collection has no one-rank group). Collective over
    the world.

    Args:
        parallel_dims: torchtitan's ``ParallelDims``, after ``parallel_dims.build_mesh()``.

    Returns:
        A :class:`ProcessGroupCollection` whose ``layout`` is the one ``parallel_dims`` describes.

    Raises:
        TypeError: ``parallel_dims`` is not a ``ParallelDims`` (the other ranks raise ``ValueError``
            naming it).
        ValueError: on every rank: the meshes not built; the world size disagreeing; ranks holding
            ``ParallelDims`` of different degrees or SPMD backends (naming them and who holds
            which); a torchtitan mesh holding other ranks than the layout's group (naming the dim
            and both rank lists).

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), on the
        CPU:

        >>> import torchtitan.distributed.parallel_dims as titan
        >>> titan.device_type = "cpu"  # torchtitan's choice on a machine without GPUs is "cuda"
        >>> parallel_dims = titan.ParallelDims(
        ...     dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2
        ... )
        >>> _ = parallel_dims.build_mesh()
        >>> pg = from_parallel_dims(parallel_dims)
        >>> pg.layout.tp, pg.get("tp") is parallel_dims.get_mesh("tp").get_group()  # titan's own
        (2, True)
    """
    import torch.distributed as dist
    from torchtitan.distributed.parallel_dims import ParallelDims

    from pgregistry import registry

    wrong_type = (
        None
        if isinstance(parallel_dims, ParallelDims)
        else (
            "from_parallel_dims expects torchtitan's ParallelDims "
            "(torchtitan.distributed.parallel_dims.ParallelDims, after "
            "parallel_dims.build_mesh()), got "
            f"{type(parallel_dims).__module__}.{type(parallel_dims).__qualname__}; "
            "for a collection of a layout of your own, call pgregistry.build(layout)"
        )
    )
    if wrong_type is not None and not (dist.is_available() and dist.is_initialized()):
        raise TypeError(wrong_type)  # no peer to wait: nothing collective has begun
    require_distributed("from_parallel_dims")
    if wrong_type is not None:
        given = (
            "not a ParallelDims "
            f"({type(parallel_dims).__module__}.{type(parallel_dims).__qualname__})"
        )
        options, problems = {"degrees": given, "spmd_backend": given}, [wrong_type]
    else:
        sizes = _sizes_of_titan(parallel_dims)
        options = {
            "degrees": repr(sizes),
            "spmd_backend": repr(getattr(parallel_dims, "spmd_backend", None)),
        }
        problems = _titan_problems(parallel_dims, sizes)
    try:
        check_agreement(
            "from_parallel_dims",
            options,
            "; ".join(problems) or None,
            failed=_CANNOT,
            advice=(
                "every rank must pass the ParallelDims of one "
                "torchtitan job (the same degrees and SPMD backend)"
            ),
        )
    except ValueError as exc:
        if (
            wrong_type is not None
        ):  # this rank's own fault is a wrong type; the others name it in their error
            raise TypeError(wrong_type) from exc
        raise
    layout = sizes.layout()
    titan = _titan_groups(parallel_dims)
    registry.adopt(titan.values())
    collection = ProcessGroupCollection(layout=layout, **_fields_from(layout, sizes, titan))
    _log.debug("from_parallel_dims", layout=repr(layout), communicators=len(titan))
    return collection


def _titan_problems(parallel_dims: Any, sizes: _Sizes) -> list[str]:
    import torch.distributed as dist

    if not parallel_dims._single_axis_meshes:
        return ["the ParallelDims has no meshes yet; call parallel_dims.build_mesh() first"]
    if sizes.world_size != dist.get_world_size():
        return [
            f"ParallelDims world_size {sizes.world_size} disagrees with the process group world of "
            f"{dist.get_world_size()} ranks"
        ]
    layout = sizes.layout()
    rank = dist.get_rank()
    problems = []
    for dim, mesh in parallel_dims.get_all_one_dimensional_meshes().items():
        expected = _layout_partition(layout, sizes.dp_replicate, dim)
        actual = tuple(sorted(dist.get_process_group_ranks(mesh.get_group())))
        if actual != _row_of(expected, rank):
            problems.append(
                f"torchtitan's {dim!r} mesh of rank {rank} holds ranks {list(actual)}, the layout "
                f"{layout!r} gives {list(_row_of(expected, rank))}"
            )
    return problems


def _titan_groups(parallel_dims: Any) -> dict[str, ProcessGroup]:
    """torchtitan's real communicators on this rank, by dim name, the world first."""
    groups = {"world": parallel_dims.world_mesh.get_group()}
    for dim, mesh in sorted(parallel_dims.get_all_one_dimensional_meshes().items()):
        groups[dim] = mesh.get_group()
    return groups


def _fields_from(
    layout: ParallelLayout, sizes: _Sizes, titan: Mapping[str, ProcessGroup]
) -> dict[str, Any]:
    import torch.distributed as dist

    by_ranks: dict[tuple[int, ...], ProcessGroup] = {}
    for group in titan.values():
        by_ranks.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), group)
    rank = dist.get_rank()
    wanted: dict[str, tuple[int, ...] | None] = {
        kind: layout.groups_of(rank)[kind] for kind in GROUP_KINDS
    }
    wanted["intra_dist_opt"] = tuple(range(layout.num_ranks))
    wanted["inter_dist_opt"] = None
    wanted.update(
        {
            alias: wanted[kind]
            for alias, kind in (("intra_dp_cp", "dp_cp"), ("intra_expt_dp", "expt_dp"))
        }
    )
    if sizes.dp_replicate > 1:
        for hsdp_field, dim in _HSDP_FIELDS.items():
            wanted[hsdp_field] = _row_of(_layout_partition(layout, sizes.dp_replicate, dim), rank)
    fields: dict[str, Any] = dict(_NOT_BUILT)
    for name, ranks in wanted.items():
        if ranks is None:
            fields[name] = None if name == "inter_dist_opt" else NOT_MEMBER
        else:
            fields[name] = None if len(ranks) == 1 else by_ranks.get(tuple(sorted(ranks)), UNSET)
    return fields


# ------------------------------------------------------------------------------------------ experts


def mark_torchtitan_experts(model: nn.Module) -> int:
    """Mark every torchtitan routed-expert module in ``model``.

    Each ``GroupedExperts`` (and subclass) module is marked with
    :func:`pgregistry.params.mark_expert_module`, and each of its parameters with
    :func:`pgregistry.params.mark_expert`. Every parameter of a ``GroupedExperts`` is stacked over
    its experts (``w1_EFD``, ``w2_EDF``, ``w3_EFD``; GPT-OSS's biases too), so under EP each rank
    holds different experts. Grad statistics then count each expert once whatever mesh its grad lies
    on, and refuse a parameter of the module that lost its classification, where torchtitan's
    ``_clip_grad_norm_with_ep`` classifies by whether the parameter's mesh has a dim named "ep".
    Shared experts and the router are dense and are not marked.

    Args:
        model: the model (an ``nn.Module``).

    Returns:
        How many expert modules were marked.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (mark one parameter with
            :func:`pgregistry.params.mark_expert`).

    Example:
        >>> import torch
        >>> from torchtitan.models.common.moe import GroupedExperts
        >>> from pgregistry.params import is_expert_param
        >>> experts = GroupedExperts.Config(dim=4, hidden_dim=8, num_experts=2).build()
        >>> model = torch.nn.ModuleDict({"router": torch.nn.Linear(4, 2), "experts": experts})
        >>> mark_torchtitan_experts(model)  # one GroupedExperts module
        1
        >>> [name for name, param in model.named_parameters() if is_expert_param(param)]
        ['experts.w1_EFD', 'experts.w2_EDF', 'experts.w3_EFD']
    """
    require_module(model, "mark_torchtitan_experts")
    from torchtitan.models.common.moe import GroupedExperts

    from pgregistry.params import mark_expert, mark_expert_module

    marked = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            mark_expert_module(module)
            for param in module.parameters(recurse=False):
                mark_expert(param)
            marked += 1
    return marked


# ------------------------------------------------------------------------------------ communicators


def communicator_ranks() -> list[tuple[int, ...]]:
    """The ranks of every real communicator this process holds, one entry per communicator, sorted.

    From torch's process-group registry: the default group included, the ``fake`` backend's groups
    excluded. Two entries with the same ranks are two communicators over one rank set: what
    :func:`to_parallel_dims` avoids.

    Returns:
        One tuple of global ranks per communicator, sorted.

    Example:
        On every rank of a 2-rank world (as :func:`pgregistry.testing.run_world` starts it), on the
        CPU:

        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=2, tp=2))
        >>> _ = to_parallel_dims(pg, device_type="cpu")
        >>> ranks = communicator_ranks()
        >>> (0, 1) in ranks, len(ranks) == len(set(ranks))  # no two over one rank set
        (True, True)
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    return sorted(
        tuple(sorted(dist.get_process_group_ranks(group)))
        for group, (backend, _) in _world.pg_map.items()
        if str(backend) != "fake"
    )
