"""Sharded optimizer shards of a parameter of another size are refused on every rank, not cut from its first elements.

``load_optimizer_shards`` cut each rank's piece by offset from the saved whole and checked only that the piece lay
inside it: the shards of a (6, 2) weight loaded into a (4, 2) one under the same name gave it the saved weight's
first 8 elements (its main copy, so its weights, and its Adam state), without a word, where the other loaders refuse
a parameter of another shape. 2 gloo ranks; the oracle is the weight as it was before the load."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, attach, build
from pgregistry.checkpoint import load_optimizer_shards, save_optimizer_shards
from pgregistry.experts import global_param_name_fn
from pgregistry.optim import build_optimizer
from pgregistry.testing import run_world


def _sharded(rows: int) -> tuple[nn.Module, Any]:
    """A ``(rows, 2)`` weight of ``0, 1, ...`` under a sharded Adam over both ranks."""
    warnings.simplefilter("ignore")  # the fallback warnings of a model without a pipeline
    collection = build(ParallelLayout(num_ranks=2))
    model = nn.Linear(2, rows, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.arange(2.0 * rows).reshape(rows, 2))
    attach(model, collection)
    name_fn = global_param_name_fn(model, pg_collection=collection)
    return model, build_optimizer(model, collection, optimizer="adam", sharded=True, param_name_fn=name_fn)


def _another_size(directory: str) -> dict[str, Any]:
    model, optimizer = _sharded(rows=6)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    save_optimizer_shards(directory, optimizer)
    smaller, its_optimizer = _sharded(rows=4)
    error = value_error_of(lambda: load_optimizer_shards(directory, its_optimizer))
    return {"error": error, "weight": smaller.weight.tolist()}


def test_shards_of_a_parameter_of_another_size_are_refused_on_every_rank(tmp_path: Path) -> None:
    outs = run_world(2, _another_size, str(tmp_path / "ckpt"), timeout=60.0)
    found = "'weight' holds 12 elements in the checkpoint, 8 here (a model of another size?)"
    assert any(found in out["error"] for out in outs), outs  # the ranks holding a piece of it name it
    for rank, out in enumerate(outs):
        assert found in out["error"] or "another rank could not load the optimizer shards" in out["error"], (rank, out)
        assert out["weight"] == torch.arange(8.0).reshape(4, 2).tolist(), (rank, out)  # nothing loaded
