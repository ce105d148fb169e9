"""``with_hsdp_groups`` of a module's collection over a span of the world, in a real 4-rank gloo world.

A module on ranks 2-3 (DP 2) split into 2 HSDP replicas: every rank of the world calls it (it creates the split's
groups, collectively), the module's ranks get the replicate group over ranks 2-3 and one-rank shard groups, which a
real all-reduce over them confirms against the ranks computed here, and the ranks outside the span get their
collection back, still refusing every use. It used to refuse on the ranks outside the span only, leaving the
module's ranks waiting. Arguments that differ across ranks are refused on every rank, naming them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from core_support import errors_of

from pgregistry import registry
from pgregistry.layout import ParallelLayout
from pgregistry.mesh import to_device_mesh, with_hsdp_groups
from pgregistry.testing import run_world

WORLD = 4
MODULE = ParallelLayout(num_ranks=2, rank_offset=2)


def _sum_of_ranks(group: Any) -> float:
    """A real all-reduce of each member's rank + 1, in float64."""
    value = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64)
    dist.all_reduce(value, group=group)
    return float(value)


def _on_rank() -> dict[str, Any]:
    rank = dist.get_rank()
    registry.build(ParallelLayout(num_ranks=2, tp=2), name="first")
    module = registry.build(MODULE, name="module")
    hsdp = with_hsdp_groups(module, 2)
    out: dict[str, Any] = {"member": hsdp.is_member}
    if hsdp.is_member:
        out["replicate"] = dist.get_process_group_ranks(hsdp.get("inter_dist_opt"))
        out["shard"] = [dist.get_process_group_ranks(hsdp.get(f)) for f in ("intra_dp_cp", "intra_expt_dp")]
        out["replicate sum"] = _sum_of_ranks(hsdp.get("inter_dist_opt"))
        mesh = to_device_mesh(hsdp, ("inter_dist_opt", "intra_dp_cp"))
        out["mesh"] = (tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist())
    out["errors"] = errors_of({
        "replicas differ": lambda: with_hsdp_groups(module, 2 if rank else 1),
        "outside use": lambda: hsdp.get("dp") if not hsdp.is_member else None,
    })
    registry.destroy()
    return out


def test_a_span_collection_is_split_by_every_rank_and_held_by_its_own() -> None:
    results = run_world(WORLD, _on_rank, timeout=30)
    for rank, out in enumerate(results):
        first, stop = MODULE.rank_range()
        assert out["member"] is (first <= rank < stop), rank
        if out["member"]:
            # DP 2 over ranks 2-3 in 2 replicas: each replica one rank (shard), the replicate group both ranks.
            assert out["replicate"] == [2, 3] and out["shard"] == [[rank], [rank]], (rank, out)
            assert out["replicate sum"] == float(sum(r + 1 for r in range(first, stop))), rank
            assert out["mesh"] == ((2, 1), [2, 3]), (rank, out["mesh"])  # HSDP's replicate x shard mesh
        else:
            assert out["errors"]["outside use"].startswith(f"ValueError: rank {rank} is not a member of layout"), out
        message = out["errors"]["replicas differ"]
        assert message.startswith("ValueError: ranks disagree on with_hsdp_groups: 'replicas' differs (ranks [0] "
                                  "asked for 1; ranks [1, 2, 3] asked for 2)"), (rank, message)
