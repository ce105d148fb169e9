"""Sharded optimizer shards of a model under TP are refused on every rank; they were cut from the wrong elements.

A sharded optimizer's pieces are cut by offset from each rank's flattened tensor, which under TP is the rank's own
piece, named alike on every TP rank. Loaded at TP 2, the shards of a TP 1 save gave TP rank 1 the whole weight's
first elements, TP rank 0's rows, as its Adam ``exp_avg`` and main copy (and so its weights), without a word; saved
at TP 2, the two TP ranks' pieces overlapped and the load refused them without naming TP. A weight replicated over
TP loads whole at TP 2; ``save_rank_files`` gathers the TP pieces whole: the controls. 2 gloo ranks; the oracle is
Adam's first moment after one step of a known gradient, in float64."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import (
    load_optimizer_shards,
    load_rank_files,
    save_optimizer_shards,
    save_rank_files,
)
from pgregistry.experts import global_param_name_fn
from pgregistry.optim import build_optimizer
from pgregistry.params import mark_tensor_parallel
from pgregistry.testing import run_world

WHOLE = torch.arange(8.0).reshape(4, 2)
"""The whole weight; at TP 2 rank ``r`` holds its ``r``-th half of rows."""

BETA1 = 0.9


def _sharded(tp: int, *, replicated: bool = False) -> tuple[nn.Module, Any]:
    """The weight (its rows halved over TP 2, unless ``replicated``) under a sharded Adam, named by global names."""
    warnings.simplefilter("ignore")  # the fallback warnings of a model without a pipeline
    rank = torch.distributed.get_rank()
    collection = build(ParallelLayout(num_ranks=2, tp=tp))
    cut = 1 if replicated else tp
    model = nn.Linear(2, 4 // cut, bias=False)
    with torch.no_grad():
        model.weight.copy_(WHOLE.chunk(cut)[rank if cut > 1 else 0])
    if cut > 1:
        mark_tensor_parallel(model.weight, 0)
    attach(model, collection)
    name_fn = global_param_name_fn(model, pg_collection=collection)
    return model, build_optimizer(model, collection, optimizer="adam", sharded=True, param_name_fn=name_fn,
                                  betas=(BETA1, 0.999))


def _stepped_at_tp_1() -> tuple[nn.Module, Any]:
    """One Adam step of the gradient ``WHOLE + 1`` on both replicas (the input is 0: the grad is set by hand)."""
    model, optimizer = _sharded(tp=1)
    model(torch.zeros(1, 2)).sum().backward()
    model.weight.grad.copy_(WHOLE + 1)  # a view of the optimizer's grad buffer
    optimizer.step()
    return model, optimizer


def _under_tp(directory: str) -> dict[str, Any]:
    model, optimizer = _stepped_at_tp_1()
    save_rank_files(f"{directory}/tp1", model)
    save_optimizer_shards(f"{directory}/tp1", optimizer)
    save_rank_files(f"{directory}/control", model, optimizer)
    out: dict[str, Any] = {}
    target, target_optimizer = _sharded(tp=2)
    load_rank_files(f"{directory}/tp1", target)
    before = target.weight.tolist()
    out["load"] = value_error_of(lambda: load_optimizer_shards(f"{directory}/tp1", target_optimizer))
    out["kept"] = target.weight.tolist() == before
    out["empty"] = target_optimizer.param_state()[target.weight].keys() <= {"main_param"}
    replicated, replicated_optimizer = _sharded(tp=2, replicated=True)  # whole on each TP rank: it loads
    load_rank_files(f"{directory}/tp1", replicated)
    load_optimizer_shards(f"{directory}/tp1", replicated_optimizer)
    out["replicated exp_avg"] = replicated_optimizer.param_state()[replicated.weight]["exp_avg"].double().tolist()
    control, control_optimizer = _sharded(tp=2)
    load_rank_files(f"{directory}/control", control, control_optimizer)
    out["control exp_avg"] = control_optimizer.param_state()[control.weight]["exp_avg"].double().tolist()
    at_tp_2 = _sharded(tp=2)
    out["save"] = value_error_of(lambda: save_optimizer_shards(f"{directory}/tp2", at_tp_2[1]))
    out["written"] = sorted(p.name for p in Path(directory, "tp2").glob("*"))
    return out


def _refusal(owner: str, how: str) -> str:
    return (
        f"{owner}: the optimizer holds 'weight' {how} 2 TP ranks, each rank its own under that name; optimizer shards "
        "are cut from whole tensors held by one rank each. Checkpoint a TP model's optimizer with save_rank_files / "
        "load_rank_files (or save_distributed / load_distributed), which join its TP pieces whole"
    )


def test_optimizer_shards_under_tp_are_refused_on_every_rank_not_cut_from_tp_rank_0s_elements(
    tmp_path: Path,
) -> None:
    first_moment = ((1 - BETA1) * (WHOLE.double() + 1)).chunk(2)  # Adam's exp_avg after one step, by TP rank
    for rank, out in enumerate(run_world(2, _under_tp, str(tmp_path), timeout=60.0)):
        assert out["load"] == _refusal("load_optimizer_shards", "sharded over"), (rank, out)
        assert out["kept"] and out["empty"], (rank, out)  # nothing loaded: weights and state as they were
        replicated = torch.tensor(out["replicated exp_avg"], dtype=torch.float64)
        assert torch.allclose(replicated, torch.cat(first_moment)), (rank, out)  # a weight replicated over TP
        control = torch.tensor(out["control exp_avg"], dtype=torch.float64)
        assert torch.allclose(control, first_moment[rank]), (rank, out)  # save_rank_files joins TP pieces right
        assert out["save"] == _refusal("save_optimizer_shards", "on"), (rank, out)
        assert out["written"] == [], (rank, out)
