"""torchtitan's own meshes against pgregistry's, for every rank of several shapes (one process, torch's fake
backend standing for any rank: mesh and group construction compute nothing there).

* ``from_parallel_dims``: the layout it returns has, for every one of torchtitan's one-dimensional meshes, the rank
  set torchtitan built (the layout's group kind, or its HSDP split, written out here), and the collection holds a
  communicator with those ranks.
* ``to_parallel_dims``: every mesh torchtitan's code reads (global views, one-dimensional meshes, SPMD meshes, the
  world, multi-dim submeshes) has torchtitan's dim names and rank grid, and is made of the collection's groups.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist
from titan_support import require_torchtitan, use_cpu

require_torchtitan()

from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.interop.torchtitan import from_parallel_dims, to_parallel_dims  # noqa: E402
from pgregistry.mesh import with_hsdp_groups  # noqa: E402

# name: (ParallelDims degrees, spmd_backend); world size = their product.
SHAPES: dict[str, tuple[dict[str, int], str]] = {
    "dp_shard 4 x tp 2, ep 4 (the issue's)": ({"dp_shard": 4, "tp": 2, "ep": 4}, "spmd_types"),
    "dp_shard 8, ep 8": ({"dp_shard": 8, "ep": 8}, "partial_dtensor"),
    "dp_shard 2 x tp 4, ep 2 (EP inside TP)": ({"dp_shard": 2, "tp": 4, "ep": 2}, "full_dtensor"),
    "pp 2 x dp_shard 2 x tp 2, ep 4": ({"pp": 2, "dp_shard": 2, "tp": 2, "ep": 4}, "spmd_types"),
    "hsdp 2 x 2 x tp 2, ep 4": ({"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 4}, "partial_dtensor"),
    "dp_shard 2 x cp 2 x tp 2, ep 8 (EP across CP)": ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 8}, "spmd_types"),
    "dp_shard 4 x tp 2, EP off": ({"dp_shard": 4, "tp": 2, "ep": 1}, "partial_dtensor"),
    "hsdp 2 x 2 x cp 2, ep 2": ({"dp_replicate": 2, "dp_shard": 2, "cp": 2, "ep": 2}, "full_dtensor"),
    "tp 8, ep 8 (one-rank data parallelism)": ({"dp_shard": 1, "tp": 8, "ep": 8}, "spmd_types"),
    "dp_shard 4 x tp 2, ep 2 (EP = TP)": ({"dp_shard": 4, "tp": 2, "ep": 2}, "partial_dtensor"),
}

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

# torchtitan's dims that are one of the layout's group kinds; the HSDP dims split one (see _expected_ranks).
KIND = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "batch": "dp", "dp": "dp", "loss": "dp_cp"}
SPLIT = {"fsdp": "dp_cp", "dp_shard": "dp", "efsdp": "expt_dp"}


@contextmanager
def _fake_rank(rank: int, world: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        registry.destroy()
        dist.destroy_process_group()


def _titan(degrees: dict[str, int], spmd_backend: str) -> ParallelDims:
    full = {name: degrees.get(name, 1) for name in DEGREES}
    parallel_dims = ParallelDims(**full, world_size=_world(degrees), spmd_backend=spmd_backend)
    parallel_dims.build_mesh()
    return parallel_dims


def _world(degrees: dict[str, int]) -> int:
    return math.prod(degrees.get(name, 1) for name in DEGREES if name != "ep")


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _expected_ranks(layout: Any, dim: str, rank: int, replicas: int) -> tuple[int, ...]:
    """The layout's ranks for torchtitan's ``dim``: its group kind, or for the HSDP dims the block of the split
    kind holding ``rank`` (``replicas`` contiguous blocks; ``dp_replicate``: the ranks at its place in each)."""
    groups = layout.groups_of(rank)
    if dim in KIND:
        return tuple(sorted(groups[KIND[dim]]))
    kind = "dp_cp" if dim == "dp_replicate" else SPLIT[dim]
    group = list(groups[kind])
    block = len(group) // replicas
    place = group.index(rank)
    if dim == "dp_replicate":
        return tuple(sorted(group[place % block :: block]))
    start = place // block * block
    return tuple(sorted(group[start : start + block]))


def _from_report(parallel_dims: ParallelDims, rank: int) -> list[str]:
    """Mismatches between torchtitan's real one-dimensional meshes and from_parallel_dims' layout and collection."""
    collection = from_parallel_dims(parallel_dims)
    layout = collection.layout
    assert layout is not None
    held = {_ranks(value) for name, value in collection.items() if name != "hcp" and _is_group(value)}
    problems = []
    for dim, mesh in parallel_dims.get_all_one_dimensional_meshes().items():
        theirs = _ranks(mesh.get_group())
        ours = _expected_ranks(layout, dim, rank, parallel_dims.dp_replicate)
        if theirs != ours:
            problems.append(f"rank {rank} {dim}: torchtitan {theirs}, layout {ours}")
        # Under HSDP with CP, dp_shard (a split of dp without CP) is no collection field.
        no_field = dim == "dp_shard" and parallel_dims.dp_replicate > 1 and parallel_dims.cp > 1
        if theirs not in held and not no_field:
            problems.append(f"rank {rank} {dim}: no collection field holds {theirs}")
    return problems


def _is_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup)


def _describe(mesh: Any) -> tuple[Any, ...]:
    return (mesh.mesh_dim_names, mesh.mesh.tolist())


def _meshes(parallel_dims: ParallelDims) -> dict[str, Any]:
    """Every mesh torchtitan's code can ask its ParallelDims for, by a name saying how it was asked."""
    meshes: dict[str, Any] = {f"global {name}": mesh for name, mesh in parallel_dims._global_meshes.items()}
    meshes.update({f"one-dim {name}": mesh for name, mesh in parallel_dims._single_axis_meshes.items()})
    meshes.update({f"active {name}": mesh for name, mesh in parallel_dims.get_all_one_dimensional_meshes().items()})
    meshes.update({f"spmd {i}": mesh for i, mesh in enumerate(parallel_dims.spmd_meshes())})
    meshes["world"] = parallel_dims.world_mesh
    for dims in (["dp_replicate", "fsdp"], ["dp_replicate", "dp_shard"], ["dp_replicate", "efsdp"], ["efsdp", "ep"]):
        if all(dim in parallel_dims._single_axis_meshes for dim in dims):
            meshes[f"submesh {dims}"] = parallel_dims.get_optional_mesh(dims, include_singleton_axes=True)
    return meshes


def _to_report(degrees: dict[str, int], spmd_backend: str, theirs: ParallelDims, rank: int) -> list[str]:
    """Mismatches between torchtitan's meshes and to_parallel_dims' on the layout's own collection."""
    layout = from_parallel_dims(theirs).layout
    assert layout is not None
    registry.destroy()  # forget torchtitan's adopted groups: the collection is the registry's own
    collection = registry.build(layout, name="pgregistry")
    replicas = degrees.get("dp_replicate", 1)
    if replicas > 1:
        collection = with_hsdp_groups(collection, replicas)
    ours = to_parallel_dims(collection, spmd_backend=spmd_backend, device_type="cpu")
    problems = []
    want = {name: _describe(mesh) for name, mesh in _meshes(theirs).items()}
    got = {name: _describe(mesh) for name, mesh in _meshes(ours).items()}
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            problems.append(f"rank {rank} {name}: torchtitan {want.get(name)}, ours {got.get(name)}")
    order, titans = list(ours._global_meshes), list(theirs._global_meshes)
    if order != titans:  # get_optional_mesh picks the first global mesh that has the dims asked for
        problems.append(f"rank {rank}: global meshes in the order {order}, torchtitan's {titans}")
    fields = {_ranks(value): value for name, value in collection.items() if name != "hcp" and _is_group(value)}
    # The two dims no collection field holds: efsdp with EP off (torchtitan gives it the fake backend) and dp_shard
    # under HSDP with CP (a split of dp without CP); their groups come from elsewhere (the real-world tests).
    exempt = {"efsdp"} if degrees.get("ep", 1) == 1 else set()
    if replicas > 1 and degrees.get("cp", 1) > 1:
        exempt.add("dp_shard")
    # Where EP = TP the expert FSDP ranks are the dense FSDP ranks, and FSDP2 needs two communicators there.
    twins = degrees.get("ep", 1) == degrees.get("tp", 1) > 1
    single = ours._single_axis_meshes
    dense_fsdp = (single["fsdp"] if "fsdp" in single else single["dp_shard"]).get_group()
    for name, mesh in _meshes(ours).items():
        for index, dim in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(index)
            if dim == "efsdp" and twins:
                if group is dense_fsdp or _ranks(group) != _ranks(dense_fsdp):
                    problems.append(f"rank {rank} {name} efsdp: not a second group over the dense FSDP ranks")
            elif mesh.size(index) > 1 and dim not in exempt and group is not fields.get(_ranks(group)):
                problems.append(f"rank {rank} {name} {dim}: its group over {_ranks(group)} is not the collection's")
    return problems


@functools.cache
def _reports(shape: str) -> dict[str, list[str]]:
    degrees, spmd_backend = SHAPES[shape]
    world = _world(degrees)
    out: dict[str, list[str]] = {"from": [], "to": []}
    for rank in range(world):
        with _fake_rank(rank, world):
            theirs = _titan(degrees, spmd_backend)
            out["from"] += _from_report(theirs, rank)
        with _fake_rank(rank, world):
            out["to"] += _to_report(degrees, spmd_backend, _titan(degrees, spmd_backend), rank)
    return out


@pytest.fixture(autouse=True)
def _cpu() -> None:
    use_cpu()


@pytest.mark.parametrize("shape", SHAPES)
def test_from_parallel_dims_layout_has_torchtitans_rank_sets(shape: str) -> None:
    assert _reports(shape)["from"] == []


@pytest.mark.parametrize("shape", SHAPES)
def test_to_parallel_dims_builds_torchtitans_meshes_from_the_collection(shape: str) -> None:
    assert _reports(shape)["to"] == []
