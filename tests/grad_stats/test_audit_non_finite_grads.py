"""The replication audit measures a NaN or an infinity as a value like any other.

Before, the audit measured replication as the spread ``max - min`` over the group, and a NaN (or ``inf - inf``) has no
spread: identical non-finite grads on both data-parallel replicas were listed as a mismatch, "measured unique
(undercount): differs across data-parallel replicas ... are the grads synchronised yet?", sending the reader after a
synchronisation bug where the grads had overflowed alike. Real 2-rank gloo world (data-parallel 2); each grad's truth
is what the test put on each rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pgregistry import ParallelLayout, registry
from pgregistry.audit import audit_grad_replication
from pgregistry.testing import run_world

NAN, INF = float("nan"), float("inf")

# name -> (rank 0's grad, rank 1's grad): replicated ones first, then the ones that differ.
GRADS = {
    "nan_alike": ([NAN, 1.0, 2.0], [NAN, 1.0, 2.0]),
    "inf_alike": ([INF, -INF, 0.0], [INF, -INF, 0.0]),
    "nan_here_only": ([NAN, 1.0, 2.0], [0.0, 1.0, 2.0]),
    "inf_against_minus_inf": ([INF, 1.0, 2.0], [-INF, 1.0, 2.0]),
    "nan_against_inf": ([NAN, 1.0, 2.0], [INF, 1.0, 2.0]),
}


def _audit() -> dict[str, Any]:
    model = nn.Module()
    for name, per_rank in GRADS.items():
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor(per_rank[dist.get_rank()])
        model.register_parameter(name, param)
    report = audit_grad_replication(model, registry.build(ParallelLayout(num_ranks=2)))
    return {"mismatched": sorted({(m.name, m.axis, m.measured) for m in report.mismatches})}


def test_identical_non_finite_grads_are_replicated_and_differing_ones_are_not() -> None:
    for rank, out in enumerate(run_world(2, _audit, timeout=60.0)):
        assert out["mismatched"] == [
            ("inf_against_minus_inf", "dp_cp", "unique"),
            ("nan_against_inf", "dp_cp", "unique"),
            ("nan_here_only", "dp_cp", "unique"),
        ], rank
