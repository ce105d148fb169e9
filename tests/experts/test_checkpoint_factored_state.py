"""Optimizer state of a TP-sharded parameter that is not of its shape is refused on every rank, never mixed.

``torch.optim.Adafactor`` keeps a factored ``row_var`` and ``col_var`` (shapes ``(rows, 1)`` and ``(1, cols)``) of
each rank's piece. The checkpoint gathered only state tensors of the piece's shape, so TP rank 0's factors were
stored as the whole's and a load gave them to every TP rank: rank 1's ``row_var`` came back as ``[7.5, 43.5]`` for
its own ``[111.5, 211.5]``, strict loaders and all, without a word. Factors saved at TP 1 were likewise given whole
to each TP 2 piece."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from checkpoint_support import LOAD, SAVE
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import state_by_name
from pgregistry.testing import run_world


def _stepped(tp: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 4x4 weight (its row halves over TP 2) after one Adafactor step."""
    model = nn.Linear(4, 4 // tp, bias=False)
    rank = torch.distributed.get_rank() if tp > 1 else 0
    with torch.no_grad():
        model.weight.copy_(torch.arange(16.0).reshape(4, 4).chunk(tp)[rank])
    if tp > 1:
        for attr, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
            setattr(model.weight, attr, value)
    attach(model, build(ParallelLayout(num_ranks=2, tp=tp)))
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.1)
    model.weight.grad = model.weight.detach() + 1
    optimizer.step()
    return model, optimizer


def _factored(directory: str) -> dict[str, Any]:
    stepped = _stepped(tp=2)
    out: dict[str, Any] = {"state_by_name": value_error_of(lambda: state_by_name(*stepped))}
    for fmt in SAVE:
        out[f"save {fmt}"] = value_error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}", *stepped))
        out[f"written {fmt}"] = sorted(p.name for p in Path(directory, fmt).glob("*"))
        SAVE[fmt](f"{directory}/{fmt}-tp1", *_stepped(tp=1))  # whole factors, right at TP 1
        target = _stepped(tp=2)
        before = [value.clone() for value in target[1].state[target[0].weight].values()]
        out[f"load {fmt}"] = value_error_of(
            lambda fmt=fmt, target=target: LOAD[fmt](f"{directory}/{fmt}-tp1", *target)
        )
        after = list(target[1].state[target[0].weight].values())
        out[f"kept {fmt}"] = len(before) == len(after) and all(map(torch.equal, before, after))
    replicated = _stepped(tp=1)  # build is collective
    if torch.distributed.get_rank() == 0:  # without TP state_by_name is local: one rank calls it
        out["replicated"] = sorted(state_by_name(*replicated)["optimizer"]["weight"])
    return out


def test_factored_state_of_a_tp_sharded_parameter_is_refused_on_every_rank_not_mixed(tmp_path: Path) -> None:
    outs = run_world(2, _factored, str(tmp_path), timeout=60.0)
    for rank, out in enumerate(outs):
        for owner, key in (("state_by_name", "state_by_name"), ("save_rank_files", "save files"),
                           ("save_distributed", "save dcp")):
            assert out[key] == (
                f"{owner}: the optimizer state 'col_var' of the TP-sharded parameter 'weight' has shape "
                "(1, 4), not its piece's (2, 4): pgregistry.checkpoint joins state tensors of the parameter's shape "
                "over TP, and this one (factored state, as Adafactor's) has no whole to join into. Use an optimizer "
                "whose state is elementwise (Adam, SGD), or checkpoint this one with torch.distributed.checkpoint "
                "at the same TP layout"
            ), (rank, key, out)
        for fmt in SAVE:
            assert out[f"written {fmt}"] == [], (rank, fmt, out)
            assert "the state 'col_var' of the TP-sharded parameter 'weight' is stored in shape (1, 4), neither its " \
                "whole's (4, 4) nor 0-d: no piece of it is this rank's" in out[f"load {fmt}"], (rank, fmt, out)
            assert out[f"kept {fmt}"], (rank, fmt, out)  # a refused load changes nothing
    assert outs[0]["replicated"] == ["col_var", "row_var", "step"]  # factors of a whole parameter are kept
