"""Megatron-LM PR 6470 through an optimizer: expert grads counted with the dense TP group when the optimizer's
main copies lose ``allreduce=False``.

Layout TP = EP = W, ETP = 1; each rank holds one replicated dense bf16 scalar and one distinct expert bf16 scalar.
Truth: norm sqrt(1 + W) with every grad 1, zero count 1 + W with every grad 0, through ``build_optimizer`` for the
mixed-precision and the sharded optimizer. The counterfactual makes the optimizer's role copy drop
``allreduce=False`` (the bug) in the same run and must give sqrt(2) and 2, so the test can fail.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pgregistry.optim._mixed_precision
import pgregistry.optim._sharded
from pgregistry import registry
from pgregistry.layout import ParallelLayout
from pgregistry.optim import build_optimizer
from pgregistry.params import copy_param_roles, is_expert_param
from pgregistry.testing._toy_models import dense_and_expert


def _copy_roles_dropping_allreduce(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The buggy main copy: every role but ``allreduce``."""
    copy_param_roles(src, dst)
    if hasattr(dst, "allreduce"):
        del dst.allreduce
    return dst


def _stats(collection: Any, sharded: bool) -> dict[str, Any]:
    model = dense_and_expert()
    opt = build_optimizer(model, collection, sharded=sharded)
    for param in model.parameters():
        param.main_grad.fill_(1.0)
    opt.sync_grads()
    norm = float(opt.get_grad_norm())
    for param in model.parameters():
        param.main_grad.zero_()
    opt.sync_grads()
    zeros = int(opt.count_zeros())
    expert_child = next(child for child in opt.chained_optimizers if child.expert)
    copies = expert_child.main_params if not sharded else [piece.main for piece in expert_child._pieces]
    return {"norm": norm, "zeros": zeros, "main_copies_are_experts": [is_expert_param(m) for m in copies]}


def _on_rank() -> dict[str, Any]:
    world = dist.get_world_size()
    collection = registry.build(ParallelLayout(num_ranks=world, tp=world, ep=world, expt_tp=1))
    out = {kind: _stats(collection, kind == "sharded") for kind in ("mixed_precision", "sharded")}
    # The bug, reproduced in this process: main copies without allreduce=False.
    pgregistry.optim._mixed_precision.copy_param_roles = _copy_roles_dropping_allreduce  # type: ignore[attr-defined]
    pgregistry.optim._sharded.copy_param_roles = _copy_roles_dropping_allreduce  # type: ignore[attr-defined]
    for kind in ("mixed_precision", "sharded"):
        out[f"{kind}_bug"] = _stats(collection, kind == "sharded")
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_expert_grads_counted_once_per_expert_tp_group_through_the_optimizers(world: int) -> None:
    from pgregistry.testing import run_world

    for rank, result in enumerate(run_world(world, _on_rank)):
        for kind in ("mixed_precision", "sharded"):
            fixed, bug = result[kind], result[f"{kind}_bug"]
            where = f"W={world} rank {rank} {kind}"
            assert fixed["norm"] == pytest.approx(math.sqrt(1 + world), rel=1e-6), where
            assert fixed["zeros"] == 1 + world, where
            assert fixed["main_copies_are_experts"] == [True], where
            # The counterfactual proves the test can fail: copies without the role give sqrt(2) and 2.
            assert bug["norm"] == pytest.approx(math.sqrt(2), rel=1e-6), where
            assert bug["zeros"] == 2, where
            assert bug["main_copies_are_experts"] == [False], where
