"""Benchmark: communicators per rank, torchtitan's own ``ParallelDims.build_mesh`` against ``to_parallel_dims``.

For each layout, on a real 8-rank gloo world (``pgregistry.testing.run_world``), every rank:

- baseline: torchtitan 0.3's ``ParallelDims(...).build_mesh()``; counted are the real communicators its meshes hold
  (every mesh dim's group, fake-backend ones left out) and the distinct rank sets among them, and the real
  communicators the call added to torch's process-group registry;
- pgregistry: a registry of its own builds the layout's collection (``with_hsdp_groups`` under HSDP), then
  ``to_parallel_dims`` hands torchtitan the same meshes made of it; counted are the communicators the meshes hold,
  their distinct rank sets, the communicators ``registry.build`` created (every group kind of the layout, those
  pgregistry's grad statistics need too) and those ``to_parallel_dims`` created.

Counts come from torch's process-group registry (``pgregistry.interop.torchtitan.communicator_ranks``) and from the
meshes' own groups; a cell reads ``rank 0`` or ``min-max`` over the ranks when they differ. Nothing is timed.

Usage: ``python benchmarks/torchtitan_communicators.py`` (needs torchtitan 0.3: ``make setup``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORLD = 8

# name: (ParallelDims degrees, spmd_backend)
LAYOUTS: list[tuple[str, dict[str, int], str]] = [
    ("dp_shard 4 x tp 2, ep 4", {"dp_shard": 4, "tp": 2, "ep": 4}, "spmd_types"),
    ("dp_shard 4 x tp 2, ep 4", {"dp_shard": 4, "tp": 2, "ep": 4}, "full_dtensor"),
    ("dp_shard 4 x tp 2, ep 4", {"dp_shard": 4, "tp": 2, "ep": 4}, "partial_dtensor"),
    ("dp_shard 8, ep 8", {"dp_shard": 8, "ep": 8}, "spmd_types"),
    ("dp_shard 4 x tp 2, ep 2 (EP = TP)", {"dp_shard": 4, "tp": 2, "ep": 2}, "spmd_types"),
    ("hsdp 2 x dp_shard 2 x tp 2, ep 4", {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 4}, "spmd_types"),
    ("pp 2 x dp_shard 2 x tp 2, ep 4", {"pp": 2, "dp_shard": 2, "tp": 2, "ep": 4}, "spmd_types"),
    ("dp_shard 2 x cp 2 x tp 2, ep 8", {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 8}, "spmd_types"),
    ("dp_shard 4 x tp 2, EP off", {"dp_shard": 4, "tp": 2, "ep": 1}, "spmd_types"),
]


def _new(after: list[tuple[int, ...]], before: list[tuple[int, ...]]) -> int:
    return sum((Counter(after) - Counter(before)).values())


def _held(parallel_dims: Any) -> tuple[int, int]:
    """(real communicators, distinct rank sets) that the meshes of ``parallel_dims`` hold."""
    import torch.distributed as dist

    meshes = [*parallel_dims._global_meshes.values(), *parallel_dims._single_axis_meshes.values()]
    groups = [mesh.get_group(i) for mesh in [*meshes, parallel_dims.world_mesh] for i in range(mesh.ndim)]
    real = {id(g): tuple(sorted(dist.get_process_group_ranks(g))) for g in groups if dist.get_backend(g) != "fake"}
    return len(real), len(set(real.values()))


def _measure(degrees: dict[str, int], spmd_backend: str) -> dict[str, Any]:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  # torchtitan's degree-1 dims use it
    import torchtitan.distributed.parallel_dims as titan_parallel_dims

    from pgregistry import registry
    from pgregistry.interop.torchtitan import (
        communicator_ranks,
        from_parallel_dims,
        to_parallel_dims,
    )
    from pgregistry.mesh import with_hsdp_groups

    titan_parallel_dims.device_type = "cpu"
    full = {name: degrees.get(name, 1) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
    before = communicator_ranks()
    titan = titan_parallel_dims.ParallelDims(**full, world_size=WORLD, spmd_backend=spmd_backend)
    titan.build_mesh()
    out: dict[str, Any] = {"titan created": _new(communicator_ranks(), before)}
    out["titan held"], out["titan sets"] = _held(titan)
    layout = from_parallel_dims(titan).layout
    assert layout is not None
    registry.destroy()  # forget torchtitan's adopted communicators: pgregistry builds its own
    before = communicator_ranks()
    collection = registry.build(layout)
    if full["dp_replicate"] > 1:
        collection = with_hsdp_groups(collection, full["dp_replicate"])
    out["build created"] = _new(communicator_ranks(), before)
    before = communicator_ranks()
    ours = to_parallel_dims(collection, spmd_backend=spmd_backend, device_type="cpu")
    out["to created"] = _new(communicator_ranks(), before)
    out["ours held"], out["ours sets"] = _held(ours)
    return out


def _cell(results: list[dict[str, Any]], key: str) -> str:
    values = [out[key] for out in results]
    low, high = min(values), max(values)
    return f"{values[0]}" if low == high else f"{values[0]} ({low}-{high})"


COLUMNS = [
    ("torchtitan: held", "titan held"),
    ("rank sets", "titan sets"),
    ("created", "titan created"),
    ("pgregistry: held", "ours held"),
    ("rank sets", "ours sets"),
    ("registry.build created", "build created"),
    ("to_parallel_dims created", "to created"),
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help
    from pgregistry.testing import run_world

    titles = " ".join(title for title, _ in COLUMNS)
    header = f"{'layout (8 ranks)':<36} {'spmd_backend':<16} {titles}"
    print("communicators per rank: rank 0's count, (min-max over the 8 ranks) where they differ")
    print(header)
    print("-" * len(header))
    for name, degrees, spmd_backend in LAYOUTS:
        results = run_world(WORLD, _measure, degrees, spmd_backend, timeout=300)
        cells = " ".join(f"{_cell(results, key):>{len(title)}}" for title, key in COLUMNS)
        print(f"{name:<36} {spmd_backend:<16} {cells}", flush=True)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
