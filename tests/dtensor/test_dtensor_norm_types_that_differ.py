"""FSDP2 grads (DTensor pieces sharded over the data-parallel field) with a ``norm_type`` that differs across the
ranks they are sharded over: every rank raises naming it, and an agreeing call after it is the float64 oracle.

Reported in docs/reliability.md (hostile inputs, sixth round, left as found): norm types whose rows differ in width
or operation made mismatched collectives. The pieces' block is summed over the field before any reduction group's
row (2 and inf: SUM beside MAX then SUM, a wait or gloo's size mismatch); with the rows of one width only, the
2-norm rank took its own shard's squares for the norm. Now the block has one width and one operation whatever the
norm type and carries the call's arguments, as the rows do. Two gloo ranks, one FSDP2 model sharded over both.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from dtensor_support import backward, dense_model, oracle
from torch.distributed.fsdp import fully_shard

from pgregistry import registry
from pgregistry.grad_stats import grad_norm
from pgregistry.layout import ParallelLayout
from pgregistry.mesh import to_device_mesh
from pgregistry.testing import run_world


def _on_rank(norm_types: dict[int, list[float]]) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """Each call's error (empty when none), then agreeing calls' 2- and inf-norm, and the float64 oracle's."""
    collection = registry.build(ParallelLayout(num_ranks=2))  # dp 2
    model = dense_model()
    expected = oracle(model)
    fully_shard(model, mesh=to_device_mesh(collection, ("dp_cp",)))
    backward(model)
    errors = []
    for norm_type in norm_types[dist.get_rank()]:
        try:
            grad_norm(model, collection, norm_type=norm_type)
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    inf = float(grad_norm(model, collection, norm_type=math.inf))
    after = {"norm": float(grad_norm(model, collection)), "inf": inf}
    return errors, after, expected


def test_norm_types_that_differ_over_an_fsdp_shard_raise_on_every_rank() -> None:
    """Agreeing calls after them are the oracle: the block's one shape changes no number (the inf-norm gathered in
    its peak columns), and no collective was left behind."""
    norm_types = {0: [2.0, math.inf, 1.0], 1: [math.inf, 2.0, 3.0]}
    for rank, (errors, after, expected) in enumerate(run_world(2, _on_rank, norm_types, timeout=30.0)):
        for error in errors:
            assert error.startswith("grad_norm: norm_type differs across the ranks reducing this norm"), (rank, error)
        assert after["norm"] == pytest.approx(expected["norm"], rel=1e-6)
        assert after["inf"] == pytest.approx(expected["inf"], rel=1e-6)
