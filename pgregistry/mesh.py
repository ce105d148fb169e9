"""Adapters between a :class:`~torch.distributed.device_mesh.DeviceMesh` and a collection.

The collection is a :class:`ProcessGroupCollection`.

Code built on a DeviceMesh (DTensor, FSDP2, torchtitan-style parallel dims) and code built on
collections can then share communicators instead of creating a second set:

* :func:`from_device_mesh` reads a collection off a mesh: a field mapped to one mesh dim gets that
  dim's group; a field mapped to several dims gets one group over the flattened dims, from
  pgregistry's one communicator per rank set, so a rank set it already has (a layout built with
  :func:`~pgregistry.registry.build`, or the same flattening asked for twice) is reused.
* :func:`to_device_mesh` hands back a DeviceMesh for FSDP2 / TP / EP whose dims are the collection's
  own groups (``DeviceMesh.from_group``): dense or expert data parallelism, TP, EP, the 2-D meshes
  torchtitan uses, and HSDP once :func:`with_hsdp_groups` has split the dense and expert
  data-parallel groups. No second grid of communicators exists. A DeviceMesh has no "axis off"
  value, so a field that is ``None`` (a size-1 axis) becomes a dim of the collection's one-rank
  group.

Only public DeviceMesh APIs are used (``mesh``, ``mesh_dim_names``, ``get_group``, ``from_group``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from pgregistry._runtime.integers import plain_int
from pgregistry._runtime.resolve import check_usable
from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, check_field_names
from pgregistry.layout import GROUP_KINDS, ParallelLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_FIELDS", "from_device_mesh", "to_device_mesh", "with_hsdp_groups"]

_HSDP_FIELDS: dict[str, str] = {
    "intra_dp_cp": "dp_cp",
    "intra_expt_dp": "expt_dp",
    "inter_dist_opt": "dp_cp",
}
"""HSDP fields (set by :func:`with_hsdp_groups`) -> the layout's group they split."""

MESH_FIELDS: tuple[str, ...] = (
    *(kind for kind in GROUP_KINDS if kind not in ("embd", "pos_embd")),
    *_HSDP_FIELDS,
)
"""Collection fields :func:`to_device_mesh` can make mesh dims of: every layout group kind that
holds every rank (dense and expert), and the HSDP split of the dense and expert data-parallel
groups."""


def from_device_mesh(
    mesh: DeviceMesh,
    field_dims: Mapping[str, str | Sequence[str]],
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> ProcessGroupCollection:
    """A collection whose fields are groups of ``mesh``.

    A field mapped to one dim name gets ``mesh.get_group(name)``. A field mapped to several dim
    names gets a group over those dims flattened (the ranks that differ only in them): pgregistry's
    communicator of that rank set, created with ``backend`` / ``timeout`` when it has none. Fields
    not named stay UNSET; the collection knows no layout.

    Args:
        mesh: a DeviceMesh with ``mesh_dim_names``.
        field_dims: collection field -> one mesh dim name, or several to flatten: ``{"tp": "tp",
            "dp_cp": ("dp", "cp")}``. Flattening needs the mesh to span the whole world, and every
            rank of the world to call this with the same arguments.
        backend: the backend of a flattened group pgregistry does not have yet (default: the
            world's).
        timeout: its timeout, a ``timedelta`` or seconds (default: the world's).

    Returns:
        A :class:`ProcessGroupCollection` holding the named fields' groups.

    Raises:
        TypeError: ``mesh`` no DeviceMesh (a ProcessGroup), ``field_dims`` no mapping, a field
            mapped to no dim name(s) (``None``).
        ValueError: an unknown field, ``hcp`` (a list of groups, not one), a mesh without dim names,
            an unknown or repeated dim, a flattening over a mesh smaller than the world, or this
            rank outside the mesh it flattens.

    Example:
        On every rank of a 4-rank gloo world (as :func:`pgregistry.testing.run_world` starts it;
        ``"cuda"`` for the meshes of an NCCL one):

        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from pgregistry.collection import group_size
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> pg = from_device_mesh(mesh, {"tp": "tp", "dp_cp": "dp"})
        >>> group_size(pg.tp), group_size(pg.dp_cp)
        (2, 2)
    """
    if not hasattr(mesh, "mesh_dim_names") or not hasattr(mesh, "get_group"):
        raise TypeError(
            f"from_device_mesh takes a torch DeviceMesh, got {type(mesh).__name__}: make one with "
            "init_device_mesh(...), or give a group to ProcessGroupCollection directly"
        )
    if not isinstance(field_dims, Mapping):
        raise TypeError(
            "field_dims must be a mapping of collection field -> mesh dim name(s), such as "
            f"{{'tp': 'tp', 'dp_cp': ('dp', 'cp')}}, got {type(field_dims).__name__}"
        )
    check_field_names(field_dims)
    if "hcp" in field_dims:
        raise ValueError(
            "'hcp' holds a list of hierarchical context-parallel "
            "groups; map it outside from_device_mesh"
        )
    dim_names = tuple(mesh.mesh_dim_names or ())
    if not dim_names:
        raise ValueError("from_device_mesh needs a DeviceMesh with mesh_dim_names")
    groups: dict[str, Any] = {}
    for field, spec in field_dims.items():
        if not isinstance(spec, (str, Sequence)) or not all(isinstance(d, str) for d in spec):
            raise TypeError(
                f"field {field!r} maps to {spec!r}: give a mesh dim name, or a sequence of them "
                "to flatten"
            )
        dims = (spec,) if isinstance(spec, str) else tuple(spec)
        unknown = [d for d in dims if d not in dim_names]
        if not dims or unknown or len(set(dims)) != len(dims):
            raise ValueError(
                f"field {field!r} maps to mesh dims {dims!r}: give one or more distinct names of "
                f"the mesh's dims {dim_names}"
                + (f" ({unknown[0]!r} is not one)" if unknown else "")
            )
        if len(dims) == 1:
            groups[field] = mesh.get_group(dims[0])
        else:
            groups[field] = _flat_group(mesh, dims, backend, timeout)
    return ProcessGroupCollection(**groups)


def _flat_group(
    mesh: DeviceMesh, dims: tuple[str, ...], backend: str | None, timeout: timedelta | float | None
) -> ProcessGroup:
    import math

    import torch.distributed as dist

    from pgregistry._runtime.group_cache import CACHE, GroupOptions

    ranks = mesh.mesh
    if ranks.numel() != dist.get_world_size():
        raise ValueError(
            f"flattening mesh dims {dims} needs a mesh over the whole world "
            f"({dist.get_world_size()} ranks); this one has {ranks.numel()}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    flattened = [names.index(d) for d in dims]
    others = [i for i in range(ranks.ndim) if i not in flattened]
    size = math.prod(ranks.shape[i] for i in flattened)
    # Every group of the flattening, one per coordinate of the other dims: the registry creates them
    # in one global order, each rank walking the same list.
    rank_sets = ranks.permute(*others, *flattened).reshape(-1, size).tolist()
    group = CACHE.partition_group(rank_sets, GroupOptions.of(backend, timeout))
    if group is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh it flattens")
    return group


def to_device_mesh(
    pg_collection: ProcessGroupCollection,
    fields: Sequence[str],
    device_type: str = "cpu",
    *,
    dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A DeviceMesh whose dims are ``pg_collection``'s groups ``fields``, slowest first.

    For FSDP2 and DTensor code, so that it runs on the communicators the collection already has: the
    dense data-parallel mesh ``("dp_cp",)``, the expert one ``("expt_dp",)``, the 2-D meshes
    torchtitan builds (``("dp_cp", "tp")``, ``("expt_dp", "ep")``, ``("expt_dp", "ep", "expt_tp")``)
    and HSDP's ``("inter_dist_opt", "intra_dp_cp")`` and expert HSDP's ``("inter_dist_opt",
    "intra_expt_dp")`` (both after :func:`with_hsdp_groups`). A field spanning several axes
    (``dp_cp``) is one flattened dim; a field that is ``None`` (a size-1 axis) is a dim of the
    collection's one-rank group. Fields left out are fixed at this rank's coordinates, so the mesh
    is this rank's slice of the grid. Creates no group.

    Args:
        pg_collection: the collection whose groups become the dims.
        fields: collection fields from :data:`MESH_FIELDS`, one per dim, slowest first.
        device_type: the mesh's device type (``"cpu"``, ``"cuda"``).
        dim_names: the dims' names (default: ``fields``), e.g. torchtitan's ``("dp_shard", "tp")``.

    Returns:
        A DeviceMesh made with ``DeviceMesh.from_group`` over the collection's own groups.

    Raises:
        TypeError: ``pg_collection`` is not a collection; ``fields`` or ``dim_names`` a str (its
            letters are no names: pass a tuple).
        ValueError: ``device_type`` no torch device type (``"gpu"``); the collection is destroyed; a
            field unknown, repeated or UNSET; ``dim_names``
            not one distinct name per field; two dims sharing ranks (``("dp_cp", "cp")``: not a
            grid); or ``inter_dist_opt`` leaving the data-parallel group its shard dim splits.

    Example:
        On every rank of a 4-rank gloo world (as :func:`pgregistry.testing.run_world` starts it;
        ``"cuda"`` for the meshes of an NCCL one):

        >>> import torch
        >>> from torch.distributed.fsdp import fully_shard
        >>> from pgregistry import ParallelLayout, build
        >>> pg = build(ParallelLayout(num_ranks=4, tp=2))
        >>> fsdp_tp = to_device_mesh(pg, ("dp_cp", "tp"), "cpu", dim_names=("dp_shard", "tp"))
        >>> fsdp_tp.mesh.tolist()  # a row per data-parallel rank, the TP pairs across
        [[0, 1], [2, 3]]
        >>> model = fully_shard(torch.nn.Linear(4, 4), mesh=fsdp_tp["dp_shard"])
        >>> model.weight.placements
        (Shard(dim=0),)
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    pg_collection = check_usable(pg_collection, "to_device_mesh")
    for argument, value in (("fields", fields), ("dim_names", dim_names)):
        if isinstance(value, str):  # its letters would be the dims
            raise TypeError(
                f"{argument} must be a sequence of names, one per dim, got the str {value!r}: "
                f"pass ({value!r},)"
            )
    device_problem = device_type_problem(device_type)
    if device_problem is not None:
        raise ValueError(device_problem)
    fields = tuple(fields)
    if not fields or len(set(fields)) != len(fields) or any(f not in MESH_FIELDS for f in fields):
        raise ValueError(f"fields {fields!r} must be distinct names from {MESH_FIELDS}")
    names = tuple(dim_names) if dim_names is not None else fields
    if len(names) != len(fields) or len(set(names)) != len(names):
        raise ValueError(
            f"dim_names {names!r} must be {len(fields)} distinct names, one per field {fields!r}"
        )
    rank = dist.get_rank()
    groups = []
    ranks_of: dict[str, tuple[int, ...]] = {}
    mesh = torch.tensor(rank, dtype=torch.int64)
    for position, field in enumerate(fields):
        group = _mesh_group(pg_collection, cast(GroupName, field))
        actual = tuple(dist.get_process_group_ranks(group))
        ranks_of[field] = actual
        groups.append(group)
        # Along this dim the grid steps through the group's ranks; broadcast it over the dims so
        # far.
        steps = torch.tensor(actual, dtype=torch.int64) - rank
        shape = [1] * len(fields)
        shape[position] = len(actual)
        mesh = mesh + steps.reshape(shape)
    _check_replicas_inside_shards(pg_collection, ranks_of, rank)
    if mesh.unique().numel() != mesh.numel():
        raise ValueError(
            f"the groups of {fields!r} share ranks beyond this one, so they do not form a grid"
        )
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


def device_type_problem(device_type: object) -> str | None:
    """Why ``device_type`` names no torch device type (``"gpu"``, ``"cuda:0"``), else ``None``.

    ``DeviceMesh`` takes any string: a mesh of ``"gpu"`` was made, and failed deep in torch at its
    first DTensor. Only the name is checked: ``"cuda"`` passes on a machine without a GPU.

    Args:
        device_type: what the caller gave as the mesh's device type.

    Returns:
        ``None`` for a torch device type without an index (``"cpu"``, ``"cuda"``), else a message
        naming ``device_type`` and the fix, for the caller's ``ValueError``.

    Example:
        >>> device_type_problem("cuda") is None
        True
        >>> print(device_type_problem("cuda:0"))  # doctest: +NORMALIZE_WHITESPACE
        device_type 'cuda:0' is no torch device type: give one such as 'cuda' or 'cpu'
        (a type, without an index)
    """
    import torch

    if isinstance(device_type, str) and ":" not in device_type:
        try:
            torch.device(device_type)
        except RuntimeError:
            pass
        else:
            return None
    return (
        f"device_type {device_type!r} is no torch device type: give one such as 'cuda' or 'cpu' "
        "(a type, without an index)"
    )


def _mesh_group(pg_collection: ProcessGroupCollection, field: GroupName) -> ProcessGroup:
    """The group of ``field`` for a mesh dim: its group, or the one-rank group if it is ``None``."""
    value = pg_collection.get_or(field, UNSET)
    if value is UNSET:
        raise ValueError(
            f"field {field!r} is UNSET in the collection; a DeviceMesh needs a group for every dim"
        )
    if value is not None:
        return value
    group = pg_collection.one_rank_group
    if group is None:
        raise ValueError(
            f"field {field!r} is None (axis off) and a DeviceMesh has no 'axis off' "
            "value; this collection has no one-rank group to stand for it: build it "
            "with pgregistry.build(layout), or pass one_rank_group= when assembling it"
        )
    return group


def _check_replicas_inside_shards(
    pg_collection: ProcessGroupCollection, ranks_of: Mapping[str, tuple[int, ...]], rank: int
) -> None:
    """Check HSDP's replicate dim stays inside the group its shard dim splits.

    With an order that puts EP slower than DP, ``inter_dist_opt`` crosses EP ranks, and
    ``("inter_dist_opt", "intra_expt_dp")`` would be a grid over other experts' ranks, not over
    expert data parallelism."""
    import torch.distributed as dist

    replicate = ranks_of.get("inter_dist_opt")
    for shard in ("intra_dp_cp", "intra_expt_dp"):
        if replicate is None or shard not in ranks_of:
            continue
        outer_field = cast(GroupName, _HSDP_FIELDS[shard])
        outer_group = pg_collection.get(outer_field)
        outer = (
            tuple(dist.get_process_group_ranks(outer_group)) if outer_group is not None else (rank,)
        )
        if not set(replicate) <= set(outer):
            raise ValueError(
                f"the collection's 'inter_dist_opt' group holds ranks {list(replicate)}, "
                f"outside rank {rank}'s {outer_field!r} group {list(outer)} that "
                f"{shard!r} splits: in this layout's order the {outer_field!r} replicas "
                "are not inter_dist_opt's, so the two dims form no HSDP mesh"
            )


def with_hsdp_groups(
    pg_collection: ProcessGroupCollection,
    replicas: int,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> ProcessGroupCollection:
    """``pg_collection`` with its dense and expert data-parallel groups split for HSDP.

    As in Megatron-Core with several distributed-optimizer instances: ``intra_dp_cp`` becomes the
    dense shard group (a contiguous block of each ``dp_cp`` group), ``intra_expt_dp`` the expert one
    (a contiguous block of each ``expt_dp`` group), and ``inter_dist_opt`` the replicate group (the
    ranks at the same place in each block). One replicate group serves both, as in Megatron-Core
    (its DDP all-reduces dense and expert buckets over the one ``inter_dist_opt``): in the default
    order (any order with EP faster than DP) data parallelism is the slowest axis below PP in both
    grids, so the blocks of either split are the same slices of the world and the ranks at the same
    place in them coincide. The expert HSDP mesh is then ``("inter_dist_opt", "intra_expt_dp")``. An
    order that puts EP slower than DP (``"tp-cp-dp-ep-pp"``) breaks that coincidence: the expert
    shard blocks are still set, but :func:`to_device_mesh` refuses ``("inter_dist_opt",
    "intra_expt_dp")`` there. The groups are pgregistry's communicators of those rank sets (reused
    when it has them).

    Collective over the world: every rank calls it with the same arguments, so a module's collection
    over a span of the world is split by every rank, those outside the span included (they get their
    collection back, still refusing every use).

    Args:
        pg_collection: a collection built by :func:`pgregistry.registry.build` (it needs the
            layout).
        replicas: how many replicas; divides the dense and the expert data-parallel sizes.
        backend: the backend of the groups pgregistry does not have yet (default: the world's).
        timeout: their timeout, a ``timedelta`` or seconds (default: the world's).

    Returns:
        The collection with ``intra_dp_cp``, ``intra_expt_dp`` and ``inter_dist_opt`` set (unchanged
        on a rank outside its span).

    Raises:
        TypeError: ``pg_collection`` is not a collection.
        ValueError: on every rank, arguments that differ across ranks (naming who asked for what); a
            destroyed collection; one assembled by hand (no layout); ``replicas`` not dividing the
            dense or the expert data-parallel size (Megatron-Core requires both).

    Example:
        On every rank of a 4-rank gloo world (as :func:`pgregistry.testing.run_world` starts it;
        ``"cuda"`` for the meshes of an NCCL one):

        >>> from pgregistry import ParallelLayout, build
        >>> pg = with_hsdp_groups(build(ParallelLayout(num_ranks=4)), replicas=2)
        >>> hsdp = to_device_mesh(pg, ("inter_dist_opt", "intra_dp_cp"), "cpu")
        >>> hsdp.mesh.tolist()  # 2 replicas, each sharded over 2 ranks
        [[0, 1], [2, 3]]
    """
    from pgregistry._runtime.agreement import check_agreement, require_distributed
    from pgregistry._runtime.group_cache import CACHE, GroupOptions

    if not isinstance(pg_collection, ProcessGroupCollection):
        check_usable(pg_collection, "with_hsdp_groups")  # the TypeError naming what it got
    require_distributed("with_hsdp_groups")
    replicas = cast(int, plain_int(replicas))  # np.int64(2) is 2, agreed and checked as such
    layout = pg_collection.layout
    # Agreed first, so that every check below raises on every rank alike or on none: a rank outside
    # a span holds the span's layout too, and creates the split's groups with the others.
    check_agreement(
        "with_hsdp_groups",
        {
            "layout": repr(layout),
            "name": repr(pg_collection.name),
            "destroyed": repr(pg_collection.is_destroyed),
            "replicas": repr(replicas),
            "backend": repr(backend),
            "timeout": repr(timeout),
        },
        advice=(
            "every rank of the world must call it with the same collection (a "
            "module's, on the ranks outside its span too) and the same arguments"
        ),
    )
    if pg_collection.is_destroyed:
        check_usable(
            pg_collection, "with_hsdp_groups"
        )  # the ValueError naming the destroyed collection
    if layout is None:
        raise ValueError(
            "with_hsdp_groups needs the collection's layout (every rank "
            "creates every group of the split), and this collection was "
            "assembled by hand; build it with pgregistry.build(layout)"
        )
    dense_shards, dense_replicas = _hsdp_split(layout, "dp_cp", "data-parallel", replicas)
    expert_shards, _ = _hsdp_split(layout, "expt_dp", "expert data-parallel", replicas)
    options = GroupOptions.of(backend, timeout)
    shard = CACHE.partition_group(dense_shards, options)
    expert_shard = CACHE.partition_group(expert_shards, options)
    replicate = CACHE.partition_group(dense_replicas, options)
    if (
        not pg_collection.is_member
    ):  # a rank outside the span: it took part in the creation, and holds no group
        return pg_collection
    return pg_collection.evolve(
        intra_dp_cp=shard, intra_expt_dp=expert_shard, inter_dist_opt=replicate
    )


def _hsdp_split(
    layout: ParallelLayout, kind: str, what: str, replicas: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each ``kind`` group cut into ``replicas`` contiguous shard blocks.

    And the replicate sets across them.
    """
    groups = layout.groups_tensor(kind)
    size = groups.shape[1]
    if (
        not isinstance(replicas, int)
        or isinstance(replicas, bool)
        or replicas < 1
        or size % replicas
    ):
        raise ValueError(
            f"replicas {replicas!r} must be a positive divisor of the {what} size {size}"
        )
    blocks = groups.reshape(-1, replicas, size // replicas)
    return blocks.reshape(-1, size // replicas).tolist(), blocks.transpose(1, 2).reshape(
        -1, replicas
    ).tolist()
