"""Megatron-LM PR 6470: expert grads must be deduplicated over the expert TP group, not the dense one.

TP = EP = world W, ETP 1; each rank holds one replicated dense 1-element parameter and one distinct 1-element
expert parameter. Oracle (the unsharded model has 1 + W elements): all grads 1 -> norm sqrt(1 + W); all grads 0 ->
zero count 1 + W. Filtering expert params through the dense TP group (the bug) gives sqrt(2) and 2, and
so does a mixed-precision copy that drops ``allreduce=False``; both counterfactuals are computed here to prove the
test can fail.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pgregistry import ProcessGroupCollection, registry
from pgregistry.grad_stats import (
    count_zeros,
    grad_norm,
    norm_of_grads,
    param_is_not_tensor_parallel_duplicate,
    zeros_of_grads,
)
from pgregistry.layout import ParallelLayout
from pgregistry.params import copy_param_roles
from pgregistry.testing import run_world
from pgregistry.testing._toy_models import dense_and_expert


def _main_copy(param: torch.nn.Parameter, *, keep_roles: bool) -> torch.nn.Parameter:
    main = torch.nn.Parameter(param.detach().to(torch.float32))
    return copy_param_roles(param, main) if keep_roles else main


def _on_rank(world: int) -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=world, tp=world, ep=world, expt_tp=1))
    model = dense_and_expert()
    dense, expert = model.dense, model.experts.weight
    # Mixed-precision main params: fp32 copies with the roles copied, and copies that lost them.
    mains = [_main_copy(p, keep_roles=True) for p in (dense, expert)]
    lost = [_main_copy(p, keep_roles=False) for p in (dense, expert)]
    out: dict[str, Any] = {}
    for fill, key in ((1.0, "ones"), (0.0, "zeros")):
        for param in (dense, expert, *mains, *lost):
            param.grad = torch.full_like(param, fill)
        # Counterfactual: the bug's filter, expert params passed through the dense TP group.
        dense_tp_for_experts = ProcessGroupCollection(tp=collection.tp, expt_tp=collection.tp)
        dense_tp_only = [
            p.grad for p in (dense, expert) if param_is_not_tensor_parallel_duplicate(p, dense_tp_for_experts)
        ]
        reduce_group = collection.mp  # = tp_ep_pp here: the whole world
        out[key] = {
            "model": (grad_norm([dense, expert], collection).item(), count_zeros([dense, expert], collection)),
            "main": (grad_norm(mains, collection).item(), count_zeros(mains, collection)),
            "lost_roles": (grad_norm(lost, collection).item(), count_zeros(lost, collection)),
            "dense_tp_only": (
                norm_of_grads({reduce_group: dense_tp_only}).item(),
                int(zeros_of_grads({reduce_group: dense_tp_only}).item()),
            ),
        }
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_expert_grads_count_once_per_expert_tp_group(world: int) -> None:
    results = run_world(world, _on_rank, world)
    exact_norm, exact_zeros = math.sqrt(1 + world), 1 + world
    buggy_norm, buggy_zeros = math.sqrt(2), 2
    for rank, got in enumerate(results):
        for path in ("model", "main"):
            assert got["ones"][path][0] == pytest.approx(exact_norm, rel=1e-6), (rank, path)
            assert got["zeros"][path][1] == exact_zeros, (rank, path)
        # Both defects reproduce the bug's numbers: this test would catch either.
        for path in ("dense_tp_only", "lost_roles"):
            assert got["ones"][path][0] == pytest.approx(buggy_norm, rel=1e-6), (rank, path)
            assert got["zeros"][path][1] == buggy_zeros, (rank, path)
            assert got["ones"][path][0] != pytest.approx(exact_norm, rel=1e-3)
