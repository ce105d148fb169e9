"""``build_optimizer``: refuses what it cannot run on (naming the culprit), splits dense from expert parameters
and gives each child its own groups."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pgregistry
from pgregistry import registry
from pgregistry.collection import FIELD_NAMES, UNSET, ProcessGroupCollection
from pgregistry.fallback import ProcessGroupFallbackWarning
from pgregistry.layout import ParallelLayout
from pgregistry.optim import (
    MixedPrecisionOptimizer,
    ShardedOptimizer,
    build_optimizer,
    setup_process_groups_for_optimizer,
)
from pgregistry.params import is_expert_param, mark_expert, mark_expert_module
from pgregistry.testing import run_world

ALL_OFF = ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES))
OFF = setup_process_groups_for_optimizer(ALL_OFF)


def _moe(classify_lora: bool = True) -> nn.Module:
    model = nn.Module()
    model.dense = nn.Linear(4, 4)
    model.experts = mark_expert_module(nn.Module())
    model.experts.fc = mark_expert(nn.Parameter(torch.zeros(3, 4)))
    model.experts.lora = nn.Parameter(torch.zeros(2, 4))
    if classify_lora:
        mark_expert(model.experts.lora)
    return model


@pytest.mark.parametrize(
    "missing,sharded",
    [("dp", False), ("expt_dp", False), ("mp", False), ("tp_ep_pp", False), ("tp", False), ("intra_dist_opt", True)],
)
def test_refuses_a_collection_without_a_group_it_needs(missing: str, sharded: bool) -> None:
    with pytest.raises(ValueError, match=rf"\b{missing}\b"):
        build_optimizer(_moe(), ALL_OFF.evolve(**{missing: UNSET}), sharded=sharded)


def test_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="optimizer must be one of .* got .lamb."):
        build_optimizer(_moe(), ALL_OFF, optimizer="lamb")  # type: ignore[arg-type]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(frozen, ALL_OFF)


def test_child_refuses_parameters_of_the_other_kind() -> None:
    model = _moe()
    with pytest.raises(ValueError, match=r"param\[2\] is a routed-expert parameter .* expert=False"):
        MixedPrecisionOptimizer(list(model.parameters()), OFF, inner=torch.optim.SGD)


def test_uses_the_attached_collection_without_falling_back() -> None:
    model = _moe()
    pgregistry.attach(model, ALL_OFF)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessGroupFallbackWarning)
        opt = build_optimizer(model, optimizer=functools.partial(torch.optim.SGD, lr=0.5), mixed_precision=False)
    assert [type(c) for c in opt.chained_optimizers] == [MixedPrecisionOptimizer, MixedPrecisionOptimizer]
    assert opt.param_groups[0]["lr"] == 0.5


def _wiring(sharded: bool) -> dict[str, Any]:
    collection = registry.build(ParallelLayout(num_ranks=dist.get_world_size(), tp=2, ep=2, expt_tp=1, cp=1))
    model = _moe()
    model.to(torch.bfloat16)
    opt = build_optimizer(model, collection, sharded=sharded)
    dense, expert = opt.chained_optimizers
    out: dict[str, Any] = {
        "kinds": [(type(c).__name__, c.expert) for c in opt.chained_optimizers],
        "dense_params": [p is model.dense.weight or p is model.dense.bias for p in dense.params],
        "expert_params": [is_expert_param(p) for p in expert.params],
        # Each child counts with its own TP group: the expert child with the collection's expert TP group.
        "dense_tp": dense.stats_groups.tp is collection.get("tp"),
        "expert_tp": expert.stats_groups.expt_tp is collection.get("expt_tp"),
    }
    if sharded:
        assert isinstance(dense, ShardedOptimizer) and isinstance(expert, ShardedOptimizer)
        out["shard_groups"] = (
            dense.shard_group is collection.get("dp_cp"),
            expert.shard_group is collection.get("expt_dp"),
        )
        out["copies_are_experts"] = [is_expert_param(piece.main) for piece in expert._pieces]
    else:
        assert isinstance(dense, MixedPrecisionOptimizer) and isinstance(expert, MixedPrecisionOptimizer)
        out["shard_groups"] = (
            dense.grad_sync_group is collection.get("dp_cp"),
            expert.grad_sync_group is collection.get("expt_dp"),
        )
        out["copies_are_experts"] = [is_expert_param(m) and m.dtype == torch.float32 for m in expert.main_params]
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_splits_dense_and_expert_parameters_and_wires_their_groups(sharded: bool) -> None:
    results = run_world(4, _wiring, sharded)
    # The main copies (of this rank's shard, when sharded) keep allreduce=False; some rank holds each one.
    assert any(out["copies_are_experts"] for out in results)
    for out in results:
        kind = "ShardedOptimizer" if sharded else "MixedPrecisionOptimizer"
        assert out["kinds"] == [(kind, False), (kind, True)]
        assert out["dense_params"] == [True, True]
        assert out["expert_params"] == [True, True]
        assert out["dense_tp"] and out["expert_tp"]
        assert out["shard_groups"] == (True, True)
        assert all(out["copies_are_experts"])


def _unclassified() -> None:
    collection = registry.build(ParallelLayout(num_ranks=2, ep=2))
    build_optimizer(_moe(classify_lora=False), collection)


def test_refuses_an_unclassified_parameter_of_an_expert_module() -> None:
    # xorl's 1/sqrt(ep) undercount: a parameter in an expert module that says neither per-expert nor replicated is
    # an error.
    with pytest.raises(ValueError, match=r"experts\.lora"):
        run_world(2, _unclassified)
