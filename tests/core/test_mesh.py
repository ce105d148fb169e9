"""DeviceMesh adapters in real gloo worlds; membership checked with all-reduces against the layout arithmetic."""

from __future__ import annotations

from typing import Any

from core_support import bits, errors_of, member_mask
from torch.distributed.device_mesh import init_device_mesh

from pgregistry import ParallelLayout, ProcessGroupCollection
from pgregistry import registry as reg
from pgregistry.mesh import from_device_mesh, to_device_mesh, with_hsdp_groups
from pgregistry.testing import run_world

# A (pp, dp, tp) mesh in row-major order is the default layout order (tp fastest, then dp, then pp).
_LAYOUT = ParallelLayout(num_ranks=8, tp=2, pp=2)


def _from_mesh() -> dict[str, Any]:
    built = reg.build(_LAYOUT)
    created = reg.communicators_created()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    collection = from_device_mesh(
        mesh, {"tp": "tp", "dp": ("dp",), "pp": "pp", "tp_dp_cp": ("dp", "tp"), "mp": ("tp", "pp"), "dp_cp": "dp"}
    )
    # Flattenings no layout kind has: dims in another order give the same set (one group), and a new set.
    again = from_device_mesh(mesh, {"tp_cp": ("tp", "dp"), "tp_ep_pp": ("pp", "dp")})
    return {
        "masks": {name: member_mask(collection.get(name)) for name, _ in collection.items() if collection.is_set(name)},
        "unset": [name for name, value in collection.items() if not collection.is_set(name)],
        "mesh_groups": collection.get("tp") is mesh.get_group("tp") and collection.get("dp_cp") is collection.get("dp"),
        "shared_with_build": [collection.get(k) is built.get(k) for k in ("tp_dp_cp", "mp")],
        "same_set_same_group": again.get("tp_cp") is collection.get("tp_dp_cp"),
        "new_set": member_mask(again.get("tp_ep_pp")),
        # Two new sets, the (pp, dp) pairs, one per tp coordinate (the rest existed): one holds this rank.
        "created": reg.communicators_created() - created,
        "errors": errors_of({
            "field": lambda: from_device_mesh(mesh, {"tpp": "tp"}),
            "dim": lambda: from_device_mesh(mesh, {"tp": "cp"}),
            "repeated": lambda: from_device_mesh(mesh, {"mp": ("tp", "tp")}),
            "empty": lambda: from_device_mesh(mesh, {"mp": ()}),
            "hcp": lambda: from_device_mesh(mesh, {"hcp": "tp"}),
            "sub_mesh": lambda: from_device_mesh(mesh["tp"], {"tp": "tp"}),
            "sub_mesh_flat": lambda: from_device_mesh(mesh["dp", "tp"], {"tp_cp": ("dp", "tp")}),
        }),
    }


def test_from_device_mesh_single_and_flattened_dims() -> None:
    results = run_world(8, _from_mesh)
    for rank, out in enumerate(results):
        mine = _LAYOUT.groups_of(rank)
        assert out["masks"] == {
            "tp": bits(mine["tp"]), "dp": bits(mine["dp"]), "pp": bits(mine["pp"]),
            "tp_dp_cp": bits(mine["tp_dp_cp"]), "mp": bits(mine["mp"]), "dp_cp": bits(mine["dp"]),
        }
        assert "cp" in out["unset"] and "ep" in out["unset"] and "tp" not in out["unset"]
        assert out["mesh_groups"]
        assert out["shared_with_build"] == [True, True]
        assert out["same_set_same_group"]
        tp = rank % 2
        assert out["new_set"] == bits(range(tp, 8, 2))  # every rank with this tp coordinate
        assert out["created"] == 1
        errors = out["errors"]
        assert errors["field"].startswith("ValueError: Unknown attribute: 'tpp'; did you mean 'tp'?")
        assert errors["dim"] == (
            "ValueError: field 'tp' maps to mesh dims ('cp',): give one or more distinct names of the mesh's dims "
            "('pp', 'dp', 'tp') ('cp' is not one)"
        )
        assert errors["repeated"].startswith("ValueError: field 'mp' maps to mesh dims ('tp', 'tp')")
        assert errors["empty"].startswith("ValueError: field 'mp' maps to mesh dims ()")
        assert errors["hcp"].startswith("ValueError: 'hcp' holds a list")
        assert errors["sub_mesh"] == "no error"  # a single dim of a sub-mesh is its own group
        assert errors["sub_mesh_flat"] == (
            "ValueError: flattening mesh dims ('dp', 'tp') needs a mesh over the whole world (8 ranks); this one has 4"
        )


_GRID = ParallelLayout(num_ranks=8, tp=2, cp=2, pp=2)  # dp is 1


def _to_mesh() -> dict[str, Any]:
    collection = reg.build(_GRID)
    created = reg.communicators_created()
    full = to_device_mesh(collection, ("pp", "dp", "cp", "tp"))
    part = to_device_mesh(collection, ("tp", "pp"))
    by_hand = ProcessGroupCollection(**dict(collection.items()))  # the same groups, no one-rank group
    other = reg.build(ParallelLayout(num_ranks=8, tp=4, pp=2))
    return {
        "mesh": full.mesh.tolist(),
        "dim_names": full.mesh_dim_names,
        # dp is one rank: its dim is the build's one-rank group (a DeviceMesh has no "axis off").
        "reused": [
            full.get_group(a) is (collection.get(a) or collection.one_rank_group) for a in ("pp", "dp", "cp", "tp")
        ],
        "masks": [member_mask(full.get_group(a)) for a in ("pp", "dp", "cp", "tp")],
        "local": [full.get_local_rank(a) for a in ("pp", "dp", "cp", "tp")],
        "coordinate": list(full.get_coordinate() or ()),
        "part": part.mesh.tolist(),
        "part_masks": [member_mask(part.get_group(a)) for a in ("tp", "pp")],
        "created": reg.communicators_created() - created,
        "errors": errors_of({
            "off": lambda: to_device_mesh(by_hand, ("dp", "tp")),
            "unset": lambda: to_device_mesh(ProcessGroupCollection(tp=collection.get("tp")), ("cp", "tp")),
            "axis": lambda: to_device_mesh(collection, ("tp", "embd")),
            "overlap": lambda: to_device_mesh(collection, ("dp_cp", "cp")),
            "names": lambda: to_device_mesh(collection, ("cp", "tp"), dim_names=("x", "x")),
            "repeated": lambda: to_device_mesh(collection, ("tp", "tp")),
            "other_layout": lambda: ProcessGroupCollection(layout=_GRID, **dict(other.items())),
        }),
    }


def test_to_device_mesh_reuses_the_collection_groups() -> None:
    results = run_world(8, _to_mesh)
    # The default order: rank = tp + 2*(cp + 2*(dp + 1*pp)).
    expected_mesh = [[[[t + 2 * (c + 2 * (d + p)) for t in range(2)] for c in range(2)] for d in range(1)]
                     for p in range(2)]
    for rank, out in enumerate(results):
        coords = _GRID.coords(rank)
        mine = _GRID.groups_of(rank)
        assert out["mesh"] == expected_mesh
        assert out["dim_names"] == ("pp", "dp", "cp", "tp")
        assert out["reused"] == [True] * 4
        assert out["masks"] == [bits(mine[a]) for a in ("pp", "dp", "cp", "tp")]
        assert out["local"] == [coords[a] for a in ("pp", "dp", "cp", "tp")]
        assert out["coordinate"] == [coords[a] for a in ("pp", "dp", "cp", "tp")]
        # This rank's (tp, pp) slice: its cp coordinate fixed.
        assert out["part"] == [[t + 2 * coords["cp"] + 4 * p for p in range(2)] for t in range(2)]
        assert out["part_masks"] == [bits(mine["tp"]), bits(mine["pp"])]
        assert out["created"] == 0
        errors = out["errors"]
        assert errors["off"].startswith("ValueError: field 'dp' is None (axis off) and a DeviceMesh has no 'axis off'")
        assert "no one-rank group to stand for it" in errors["off"]
        assert errors["unset"].startswith("ValueError: field 'cp' is UNSET in the collection;")
        assert errors["axis"].startswith("ValueError: fields ('tp', 'embd') must be distinct names from")
        assert errors["overlap"] == (
            "ValueError: the groups of ('dp_cp', 'cp') share ranks beyond this one, so they do not form a grid"
        )
        assert errors["names"].startswith("ValueError: dim_names ('x', 'x') must be 2 distinct names")
        assert errors["repeated"].startswith("ValueError: fields ('tp', 'tp') must be distinct names")
        # A collection's groups are held to its layout when it is made: another layout's groups are refused.
        assert errors["other_layout"].startswith("ValueError: field 'tp' holds ranks [")
        assert "the group belongs to another layout" in errors["other_layout"]


_MOE = ParallelLayout(num_ranks=8, tp=2, ep=2, expt_tp=1)  # dense dp 4, expert dp 4


def _expected_mesh_ranks(rank: int, fixed: tuple[str, ...]) -> list[int]:
    """The ranks that share ``rank``'s coordinates on the ``fixed`` axes (layout coordinates, not groups)."""
    mine = _MOE.coords(rank)
    return [r for r in range(8) if all(_MOE.coords(r)[a] == mine[a] for a in fixed)]


_HSDP_AXES = ("inter_dist_opt", "intra_dp_cp", "tp")


def _expert_and_hsdp_meshes() -> dict[str, Any]:
    collection = reg.build(_MOE)
    hsdp = with_hsdp_groups(collection, 2)
    created = reg.communicators_created()
    meshes = {
        "expert": (to_device_mesh(collection, ("expt_dp", "ep")), ("expt_dp", "ep")),
        "dense_2d": (to_device_mesh(collection, ("dp_cp", "tp"), dim_names=("dp_shard", "tp")), ("dp_cp", "tp")),
        "hsdp": (to_device_mesh(hsdp, _HSDP_AXES), _HSDP_AXES),
    }
    return {
        "ranks": {k: sorted(m.mesh.flatten().tolist()) for k, (m, _) in meshes.items()},
        "shape": {k: tuple(m.mesh.shape) for k, (m, _) in meshes.items()},
        "names": meshes["dense_2d"][0].mesh_dim_names,
        "reused": {
            k: [m.get_group(i) is (hsdp if k == "hsdp" else collection).get(f) for i, f in enumerate(fields)]
            for k, (m, fields) in meshes.items()
        },
        "hsdp_masks": (member_mask(hsdp.get("intra_dp_cp")), member_mask(hsdp.get("inter_dist_opt"))),
        "expert_shard_mask": member_mask(hsdp.get("intra_expt_dp")),
        "created": reg.communicators_created() - created,
        "errors": errors_of({
            "replicas": lambda: with_hsdp_groups(collection, 3),
            # dense dp 8 splits into 4, expert dp 2 (EP 4) does not: Megatron-Core needs both to.
            "expert_replicas": lambda: with_hsdp_groups(reg.build(ParallelLayout(num_ranks=8, ep=4)), 4),
            "no_layout": lambda: with_hsdp_groups(ProcessGroupCollection(**dict(collection.items())), 2),
        }),
    }


def test_expert_2d_and_hsdp_meshes_share_the_collection_groups() -> None:
    results = run_world(8, _expert_and_hsdp_meshes)
    for rank, out in enumerate(results):
        assert out["ranks"]["expert"] == _expected_mesh_ranks(rank, ("expt_tp", "expt_gtp_remat", "pp"))
        assert out["ranks"]["dense_2d"] == _expected_mesh_ranks(rank, ("gtp_remat", "cp", "pp"))
        assert out["ranks"]["hsdp"] == _expected_mesh_ranks(rank, ("gtp_remat", "cp", "pp"))
        assert out["shape"] == {"expert": (4, 2), "dense_2d": (4, 2), "hsdp": (2, 2, 2)}
        assert out["names"] == ("dp_shard", "tp")
        assert all(all(flags) for flags in out["reused"].values())
        # The data-parallel group of rank r is every rank with its tp coordinate; HSDP splits it into
        # contiguous blocks of 2 (shard) and the ranks at the same place in each block (replicate).
        dp_group = list(range(rank % 2, 8, 2))
        position = dp_group.index(rank)
        block = position // 2
        assert out["hsdp_masks"] == (
            bits(dp_group[2 * block: 2 * block + 2]), bits(dp_group[position % 2:: 2])
        )
        # Expert DP of rank r (the ranks at its EP coordinate, r % 2) holds the same ranks as its dense DP group
        # here (EP 2 spans the dense TP ranks): the same blocks of 2.
        assert out["expert_shard_mask"] == bits(dp_group[2 * block: 2 * block + 2])
        assert out["created"] == 0
        assert out["errors"] == {
            "replicas": "ValueError: replicas 3 must be a positive divisor of the data-parallel size 4",
            "expert_replicas": "ValueError: replicas 4 must be a positive divisor of the expert data-parallel size 2",
            "no_layout": (
                "ValueError: with_hsdp_groups needs the collection's layout (every rank creates every group of the "
                "split), and this collection was assembled by hand; build it with pgregistry.build(layout)"
            ),
        }
