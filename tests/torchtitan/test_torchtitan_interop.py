"""pgregistry.interop.torchtitan in a real 8-rank gloo world, the issue's shape (``dp_shard 4 x tp 2, ep 4``):
communicators counted in torch's process-group registry, and bad input refused on every rank.

* torchtitan's own ``build_mesh`` holds several communicators per rank set (the baseline, measured here);
* ``from_parallel_dims`` creates no group (the process-group registry has as many entries after as before), its
  collection holds torchtitan's communicators, and ``registry.build`` of its layout then reuses them;
* ``to_parallel_dims`` on a collection the registry built creates no communicator, under every ``spmd_backend``,
  and its meshes hold exactly one communicator per distinct rank set, each the collection's.

All checks run in one world, so torchtitan is imported once and the world started once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist
from fixtures.errors import value_error_of
from titan_support import communicators, require_torchtitan, use_cpu

require_torchtitan()

from torch.distributed.distributed_c10d import _world  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

from pgregistry import registry  # noqa: E402
from pgregistry.collection import UNSET  # noqa: E402
from pgregistry.interop.torchtitan import SPMD_BACKENDS, from_parallel_dims, to_parallel_dims  # noqa: E402
from pgregistry.layout import ParallelLayout  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

WORLD = 8
DEGREES = {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2, "pp": 1, "ep": 4}


def _new(after: list[tuple[int, ...]], before: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return sorted((Counter(after) - Counter(before)).elements())


def _groups_of(parallel_dims: Any) -> list[Any]:
    """Every group every mesh of ``parallel_dims`` holds (global views, one-dimensional meshes, world)."""
    meshes = [*parallel_dims._global_meshes.values(), *parallel_dims._single_axis_meshes.values()]
    meshes.append(parallel_dims.world_mesh)
    return [mesh.get_group(i) for mesh in meshes for i in range(mesh.ndim)]


def _held(parallel_dims: Any) -> tuple[int, int]:
    """(communicators, distinct rank sets) among the real groups of ``parallel_dims``' meshes."""
    real = [group for group in _groups_of(parallel_dims) if dist.get_backend(group) != "fake"]
    by_id = {id(group): tuple(sorted(dist.get_process_group_ranks(group))) for group in real}
    return len(by_id), len(set(by_id.values()))


def _titan_and_adoption() -> dict[str, Any]:
    titan = ParallelDims(**DEGREES, world_size=WORLD)  # torchtitan's default spmd_backend
    titan.build_mesh()
    # Meshes of this world under a ParallelDims that says 4 ranks (built elsewhere, handed over): refused.
    smaller = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2, world_size=4)
    smaller._single_axis_meshes = titan._single_axis_meshes
    wrong_world = value_error_of(lambda: from_parallel_dims(smaller))
    entries = len(_world.pg_map)
    created = registry.communicators_created()
    collection = from_parallel_dims(titan)
    layout = collection.layout
    assert layout is not None
    from_entries, from_created = len(_world.pg_map) - entries, registry.communicators_created() - created
    titan_groups = {id(group) for group in _groups_of(titan)}
    held = {name: value for name, value in collection.items() if isinstance(value, dist.ProcessGroup)}
    rebuilt = registry.build(layout)
    return {
        "titan": _held(titan),
        "wrong world": wrong_world,
        "from_entries": from_entries,
        "from_created": from_created,
        "build_entries": len(_world.pg_map) - entries,
        "layout": layout,
        "held_are_titans": sorted(name for name, group in held.items() if id(group) not in titan_groups),
        "unset": sorted(name for name, value in collection.items() if value is UNSET),
        "build_created": registry.communicators_created() - created,
        "build_reuses": sorted(name for name, group in held.items() if rebuilt.get(name) is not group),
    }


def _ours(layout: ParallelLayout) -> dict[str, Any]:
    """pgregistry builds the layout on communicators of its own; to_parallel_dims under every backend adds none."""
    registry.destroy()  # forget torchtitan's adopted communicators (they stay torchtitan's)
    before = communicators()
    collection = registry.build(layout)
    built = _new(communicators(), before)
    fields = {id(value) for _, value in collection.items() if isinstance(value, dist.ProcessGroup)}
    out: dict[str, Any] = {"built": built}
    for spmd_backend in SPMD_BACKENDS:
        before = communicators()
        parallel_dims = to_parallel_dims(collection, spmd_backend=spmd_backend, device_type="cpu")
        real = [group for group in _groups_of(parallel_dims) if dist.get_backend(group) != "fake"]
        out[spmd_backend] = {
            "created": _new(communicators(), before),
            "held": _held(parallel_dims),
            "all_the_collections": all(id(group) in fields for group in real),
        }
    # EP = TP: expert FSDP's ranks are dense FSDP's, and FSDP2 needs a second communicator there (the only one made).
    twinned = registry.build(ParallelLayout(num_ranks=WORLD, tp=2, ep=2, expt_tp=1))
    before = communicators()
    to_parallel_dims(twinned, spmd_backend="partial_dtensor", device_type="cpu")
    out["ep = tp"] = (_new(communicators(), before), tuple(dist.get_process_group_ranks(twinned.get("dp_cp"))))
    # EP off: torchtitan's efsdp (tp x dp_shard ranks) is a fake group, no communicator.
    dense_collection = registry.build(ParallelLayout(num_ranks=WORLD, tp=2))
    before = communicators()
    parallel_dims = to_parallel_dims(dense_collection, device_type="cpu")
    efsdp = parallel_dims._single_axis_meshes["efsdp"]
    out["ep off"] = (_new(communicators(), before), efsdp.size(), dist.get_backend(efsdp.get_group()))
    out["bad"] = _bad_input(collection)
    return out


def _bad_input(pg: Any) -> dict[str, str]:
    def to(collection: Any = pg, **options: Any) -> Any:
        return lambda: to_parallel_dims(collection, device_type="cpu", **options)

    expert_tp = registry.build(ParallelLayout(num_ranks=WORLD, tp=2, ep=4, expt_tp=2))
    crossed = registry.build(ParallelLayout(num_ranks=WORLD, tp=2, ep=4, expt_tp=1, order="tp-cp-dp-ep-pp"))
    by_hand = type(pg)(**dict(pg.items()))  # the same groups, no layout
    second_half = registry.build(ParallelLayout(num_ranks=WORLD // 2, tp=2, rank_offset=WORLD // 2), name="half")
    return {
        "span": value_error_of(to(second_half)),
        "not built": value_error_of(lambda: from_parallel_dims(ParallelDims(**DEGREES, world_size=WORLD))),
        "expert tp": value_error_of(to(expert_tp)),
        "ep borrows beyond dp_shard": value_error_of(to(pg.evolve(inter_dist_opt=pg.get("dp")))),
        "order": value_error_of(to(crossed)),
        "unset": value_error_of(to(pg.evolve(ep=UNSET))),
        "backend": value_error_of(to(spmd_backend="dtensor")),
        "no layout": value_error_of(to(by_hand)),
    }


def _checks() -> dict[str, Any]:
    use_cpu()
    out = _titan_and_adoption()
    out.update(_ours(out["layout"]))
    return out


def test_torchtitan_interop_communicators_and_bad_input() -> None:
    results = run_world(WORLD, _checks, timeout=60)
    for rank, out in enumerate(results):
        held, rank_sets = out["titan"]
        assert held > rank_sets, out["titan"]  # torchtitan's meshes: several communicators per rank set
        assert out["layout"] == ParallelLayout(num_ranks=WORLD, tp=2, ep=4, expt_tp=1)
        assert (out["from_entries"], out["from_created"]) == (0, 0), rank
        assert out["held_are_titans"] == [] and out["build_reuses"] == [], rank
        # torchtitan has every rank set this layout's groups need; the build adds only this rank's one-rank group.
        assert (out["build_entries"], out["build_created"]) == (1, 1), rank
        assert out["unset"] == [], out["unset"]
        assert len(out["built"]) == len(set(out["built"])), out["built"]  # the registry: one per rank set
        for spmd_backend in SPMD_BACKENDS:
            mine = out[spmd_backend]
            assert mine["created"] == [], (rank, spmd_backend, mine["created"])
            assert mine["held"] == (rank_sets, rank_sets), (rank, spmd_backend, mine["held"])  # one per rank set
            assert mine["all_the_collections"], (rank, spmd_backend)
        created, expert_fsdp = out["ep = tp"]
        assert created == [expert_fsdp], (rank, created)
        assert out["ep off"] == ([], 8, "fake"), (rank, out["ep off"])
    bad = {name: {out["bad"][name] for out in results} for name in results[0]["bad"]}
    bad["parallel dims world size"] = {out["wrong world"] for out in results}
    expected = {
        "span": "needs a layout over the whole world (torchtitan's ParallelDims spans every rank), and layout 'half' "
        f"{ParallelLayout(num_ranks=WORLD // 2, tp=2, rank_offset=WORLD // 2)!r} spans ranks 4-7 of the 8-rank world",
        "not built": "build_mesh",
        "expert tp": "expt_tp=2",
        "ep borrows beyond dp_shard": "ep=4 does not divide dp_shard x cp x tp = 1 x 1 x 2",
        "order": "order 'tp-cp-dp-ep-pp'",
        "unset": "'ep' is UNSET",
        "no layout": "to_parallel_dims needs the collection's layout",
        "backend": "'dtensor'",
        "parallel dims world size": "ParallelDims world_size 4 disagrees with the process group world of 8",
    }
    for name, needle in expected.items():
        assert len(bad[name]) == 1, (name, bad[name])  # the same error on every rank
        (message,) = bad[name]
        assert needle in message, (name, message)
