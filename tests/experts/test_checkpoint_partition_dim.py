"""A TP-sharded parameter's ``partition_dim`` read as torch reads a dim, or refused naming the parameter.

Megatron-Core's ``set_tensor_model_parallel_attributes`` (and a hand-set attribute) checks nothing, and torch
counts a negative dim from the end. The checkpoint gathered pieces cut along ``partition_dim=-1`` into the right
whole, but its load expected the piece's own shape there (no dim matched ``-1``) and refused the rank's own
checkpoint: ``parameter 'weight' has shape (4, 2) but the checkpoint holds (4, 4)``. A dim the piece lacks failed
in torch's ``IndexError`` naming no parameter; ``0.5`` was read as dim 0."""

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

WHOLE = torch.arange(16.0).reshape(4, 4)
"""The oracle: the whole weight, whose rank ``r`` piece is its ``r``-th half of columns."""


def _column_parallel(partition_dim: Any, scale: float) -> nn.Module:
    """A 4x4 weight cut in column halves over TP 2, marked by hand with ``partition_dim``."""
    model = nn.Linear(4, 2, bias=False)
    model.weight = nn.Parameter((WHOLE * scale).chunk(2, dim=1)[torch.distributed.get_rank()].clone())
    for attr, value in (("tensor_model_parallel", True), ("partition_dim", partition_dim), ("partition_stride", 1)):
        setattr(model.weight, attr, value)
    attach(model, build(ParallelLayout(num_ranks=2, tp=2)))
    return model


def _round_trips(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {"stored": state_by_name(_column_parallel(-1, 1.0))["model"]["weight"].tolist()}
    for fmt in SAVE:
        SAVE[fmt](f"{directory}/{fmt}", _column_parallel(-1, 1.0))
        for load_dim in (-1, 1):
            loaded = _column_parallel(load_dim, -1.0)
            out[f"{fmt} {load_dim}"] = value_error_of(
                lambda fmt=fmt, loaded=loaded: LOAD[fmt](f"{directory}/{fmt}", loaded)
            )
            out[f"{fmt} {load_dim} weight"] = loaded.weight.tolist()
        for bad in (2, 0.5):
            out[f"{fmt} bad {bad}"] = value_error_of(
                lambda fmt=fmt, bad=bad: SAVE[fmt](f"{directory}/{fmt}-{bad}", _column_parallel(bad, 1.0))
            )
            out[f"{fmt} bad {bad} written"] = sorted(p.name for p in Path(directory, f"{fmt}-{bad}").glob("*"))
    return out


def test_a_negative_partition_dim_round_trips_and_a_dim_the_piece_lacks_is_refused_by_name(tmp_path: Path) -> None:
    for rank, out in enumerate(run_world(2, _round_trips, str(tmp_path), timeout=60.0)):
        assert out["stored"] == WHOLE.tolist(), (rank, out)  # stored whole, joined along the last dim
        for fmt in SAVE:
            for load_dim in (-1, 1):  # the same dim spelt two ways
                assert out[f"{fmt} {load_dim}"] == "no error", (rank, fmt, out)
                assert out[f"{fmt} {load_dim} weight"] == WHOLE.chunk(2, dim=1)[rank].tolist(), (rank, fmt, out)
            save = "save_rank_files" if fmt == "files" else "save_distributed"
            for bad in (2, 0.5):
                assert out[f"{fmt} bad {bad}"] == (
                    f"{save}: parameter 'weight' is TP-sharded (tensor_model_parallel=True) along "
                    f"partition_dim {bad}, which is no dim of its 2-d piece (4, 2): set partition_dim to the dim "
                    "its TP pieces are cut along, 0 to 1 (pgregistry.params.mark_tensor_parallel sets and checks it)"
                ), (rank, fmt, out)
                assert out[f"{fmt} bad {bad} written"] == [], (rank, fmt, out)
