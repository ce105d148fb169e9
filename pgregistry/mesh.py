"""Adapters between :class:`~torch.distributed.device_mesh.DeviceMesh` and :class:`ProcessGroupCollection`.

Code built on a DeviceMesh (DTensor, FSDP2, torchtitan-style parallel dims) and code built on collections can
then share communicators instead of creating a second set:

* :func:`from_device_mesh` reads a collection off a mesh: a field mapped to one mesh dim gets that dim's group;
  a field mapped to several dims gets one group over the flattened dims, created through the registry
  (:meth:`~pgregistry.registry.GroupRegistry.group_of_partition`), so a rank set the registry already has (a
  layout built with :func:`~pgregistry.registry.build`, or the same flattening asked for twice) is reused.
* :func:`to_device_mesh` hands back a DeviceMesh view over a layout's dense grid whose dims are the collection's
  own groups (``DeviceMesh.from_group``), so no group is created.

Only public DeviceMesh APIs are used (``mesh``, ``mesh_dim_names``, ``get_group``, ``from_group``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from pgregistry.collection import UNSET, GroupName, ProcessGroupCollection, check_field_names
from pgregistry.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from pgregistry.registry import GroupRegistry

__all__ = ["DENSE_MESH_AXES", "from_device_mesh", "to_device_mesh"]

DENSE_MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "gtp_remat", "tp")
"""Axes of the dense grid :func:`to_device_mesh` can make mesh dims of (each is also a collection field)."""


def from_device_mesh(
    mesh: DeviceMesh,
    axis_names: Mapping[str, str | Sequence[str]],
    *,
    registry: GroupRegistry | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> ProcessGroupCollection:
    """A collection whose fields are groups of ``mesh``: ``{"tp": "tp", "dp_cp": ("dp", "cp")}``.

    A field mapped to one dim name gets ``mesh.get_group(name)``. A field mapped to a tuple of dim names gets a
    group over those dims flattened (the ranks that differ only in them), from ``registry`` (default: the
    process-wide one) with ``backend``/``timeout``; that needs the mesh to span the whole world, and every rank
    of the world to call this with the same arguments. Fields not named stay UNSET. Raises ``ValueError``
    naming an unknown field, an unknown or repeated dim, or ``hcp`` (a list of groups, not one).
    """
    check_field_names(axis_names)
    if "hcp" in axis_names:
        raise ValueError("'hcp' holds a list of hierarchical context-parallel groups; map it outside from_device_mesh")
    dim_names = tuple(mesh.mesh_dim_names or ())
    if not dim_names:
        raise ValueError("from_device_mesh needs a DeviceMesh with mesh_dim_names")
    groups: dict[str, Any] = {}
    for field, spec in axis_names.items():
        dims = (spec,) if isinstance(spec, str) else tuple(spec)
        unknown = [d for d in dims if d not in dim_names]
        if not dims or unknown or len(set(dims)) != len(dims):
            raise ValueError(
                f"field {field!r} maps to mesh dims {dims!r}: give one or more distinct names of the mesh's dims "
                f"{dim_names}" + (f" ({unknown[0]!r} is not one)" if unknown else "")
            )
        if len(dims) == 1:
            groups[field] = mesh.get_group(dims[0])
        else:
            groups[field] = _flattened_group(mesh, dims, registry, backend, timeout)
    return ProcessGroupCollection(**groups)


def _flattened_group(
    mesh: DeviceMesh,
    dims: tuple[str, ...],
    registry: GroupRegistry | None,
    backend: str | None,
    timeout: timedelta | float | None,
) -> ProcessGroup:
    import math

    import torch.distributed as dist

    from pgregistry.registry import default_registry

    ranks = mesh.mesh
    if ranks.numel() != dist.get_world_size():
        raise ValueError(
            f"flattening mesh dims {dims} needs a mesh over the whole world ({dist.get_world_size()} ranks); this "
            f"one has {ranks.numel()}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    flattened = [names.index(d) for d in dims]
    others = [i for i in range(ranks.ndim) if i not in flattened]
    size = math.prod(ranks.shape[i] for i in flattened)
    # Every group of the flattening, one per coordinate of the other dims: the registry creates them in one
    # global order, each rank walking the same list.
    rank_sets = ranks.permute(*others, *flattened).reshape(-1, size).tolist()
    group = (registry or default_registry).group_of_partition(rank_sets, backend=backend, timeout=timeout)
    if group is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh it flattens")
    return group


def to_device_mesh(
    layout: ParallelLayout,
    collection: ProcessGroupCollection,
    axes: Sequence[str],
    device_type: str = "cpu",
) -> DeviceMesh:
    """A DeviceMesh over ``layout``'s dense grid, dims named ``axes`` (slowest first), using ``collection``'s groups.

    ``axes`` are names from :data:`DENSE_MESH_AXES`, each also the collection field that holds that axis's group.
    Axes left out are fixed at this rank's coordinates, so the mesh is this rank's slice of the grid (all of it
    when every axis of size > 1 is named). Creates no group. Raises ``ValueError`` when an axis is unknown or
    repeated, when the collection's field is UNSET or ``None`` (a mesh dim needs a group even for an axis of size
    1: build with ``explicit_singletons=True``), or when its group's ranks are not the layout's.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    axes = tuple(axes)
    if not axes or len(set(axes)) != len(axes) or any(a not in DENSE_MESH_AXES for a in axes):
        raise ValueError(f"axes {axes!r} must be distinct names from {DENSE_MESH_AXES}")
    rank = dist.get_rank()
    mine = layout.groups_of(rank)
    groups = []
    mesh = torch.tensor(rank, dtype=torch.int64)
    for position, axis in enumerate(axes):
        value = collection.get_or(cast(GroupName, axis), UNSET)  # a DENSE_MESH_AXES name, checked above
        if value is UNSET or value is None:
            state = "UNSET" if value is UNSET else "None (axis off)"
            raise ValueError(
                f"axis {axis!r} is {state} in the collection; a DeviceMesh needs a group for every dim, including "
                "axes of size 1: build the collection with explicit_singletons=True"
            )
        expected = mine[axis]
        assert expected is not None  # every dense kind holds every rank
        actual = tuple(dist.get_process_group_ranks(value))
        if actual != expected:
            raise ValueError(
                f"the collection's {axis!r} group holds ranks {list(actual)}, but in this layout rank {rank}'s "
                f"{axis!r} group is {list(expected)}: the collection was built for another layout"
            )
        groups.append(value)
        # Along this axis the grid steps through the axis group; broadcast it over the dims so far.
        steps = torch.tensor(expected, dtype=torch.int64) - rank
        shape = [1] * len(axes)
        shape[position] = len(expected)
        mesh = mesh + steps.reshape(shape)
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=axes)
