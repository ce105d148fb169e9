"""TP ranks cutting one parameter along other dims, or holding it in other dtypes, are refused on every rank.

Other ``partition_dim`` values: a model declared differently on its TP ranks (a hand-set attribute, a layer marked
column-parallel on one rank and row-parallel on another) cuts pieces of one shape along other dims. The save
all-gathered them and joined them along each rank's own dim, storing TP rank 0's join without a word; the load cut
each rank's piece along its own dim and refused with a shape misfit that named no dim (``parameter 'weight' has
shape (2, 4) but the checkpoint holds (4, 2)``). A world of 4 ranks, TP 2 by DP 2: the TP group of ranks 0 and 1
disagrees, that of ranks 2 and 3 does not, and every rank refuses, naming each rank's dim.

Other dtypes (a model cast on some TP ranks only): the all-gather joining float32 and float16 pieces made gloo abort
the process (SIGABRT, ``Received data size doesn't match expected size``) in every save and ``state_by_name``."""

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

WHOLE = torch.arange(8.0).reshape(4, 2)
"""The oracle: the whole weight, whose TP rank ``r`` piece is its ``r``-th half of rows (a 2x2 piece)."""

DIMS = {0: 0, 1: 1, 2: 0, 3: 0}
"""Each world rank's ``partition_dim``: rank 1 alone says its square piece is cut along dim 1."""


def _marked(dims: dict[int, int], scale: float) -> nn.Module:
    """This rank's 2x2 piece of ``WHOLE * scale``, marked TP-sharded along ``dims[rank]``."""
    rank = torch.distributed.get_rank()
    model = nn.Linear(2, 2, bias=False)
    model.weight = nn.Parameter((WHOLE * scale).chunk(2, dim=0)[rank % 2].clone())
    for attr, value in (("tensor_model_parallel", True), ("partition_dim", dims[rank]), ("partition_stride", 1)):
        setattr(model.weight, attr, value)
    attach(model, build(ParallelLayout(num_ranks=4, tp=2)))  # TP groups: ranks 0-1 and 2-3
    return model


def _other_dims(directory: str) -> dict[str, Any]:
    agreeing = {rank: 0 for rank in DIMS}
    out: dict[str, Any] = {}
    for fmt in SAVE:
        out[f"save {fmt}"] = value_error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}-mixed", _marked(DIMS, 1.0)))
        out[f"written {fmt}"] = sorted(p.name for p in Path(directory, f"{fmt}-mixed").glob("*"))
        SAVE[fmt](f"{directory}/{fmt}", _marked(agreeing, 1.0))
        loaded = _marked(DIMS, -1.0)
        out[f"load {fmt}"] = value_error_of(lambda fmt=fmt, loaded=loaded: LOAD[fmt](f"{directory}/{fmt}", loaded))
        out[f"kept {fmt}"] = loaded.weight.tolist()
    model = _marked(DIMS, 1.0)
    out["state_by_name"] = value_error_of(lambda: state_by_name(model))
    return out


def _refusal(owner: str) -> str:
    return (
        f"{owner}: the TP-sharded parameter 'weight' is cut along other dims on the ranks of its TP group "
        "(partition_dim 0 on rank 0, 1 on rank 1): its pieces join into one whole along one dim. Give it the same "
        "partition_dim on every TP rank (the dim its TP pieces are cut along; pgregistry.params.mark_tensor_parallel "
        "sets it)"
    )


def test_tp_ranks_cutting_one_parameter_along_other_dims_are_refused_on_every_rank(tmp_path: Path) -> None:
    outs = run_world(4, _other_dims, str(tmp_path), timeout=60.0)
    for rank, out in enumerate(outs):
        for fmt in SAVE:
            for step, owner in (("save", SAVE[fmt].__name__), ("load", LOAD[fmt].__name__)):
                expected = (
                    _refusal(owner) if rank in (0, 1)
                    else f"{owner}: another rank's model cannot be checkpointed (ranks [0, 1]: see their errors)"
                )
                assert out[f"{step} {fmt}"] == expected, (rank, fmt, step, out)
            assert out[f"written {fmt}"] == [], (rank, fmt, out)
            assert out[f"kept {fmt}"] == (-WHOLE).chunk(2, dim=0)[rank % 2].tolist(), (rank, fmt, out)
        if rank in (0, 1):  # state_by_name is collective over the TP group alone
            assert out["state_by_name"] == _refusal("state_by_name"), (rank, out)
        else:
            assert out["state_by_name"] == "no error", (rank, out)


def _cast_on_rank_1(directory: str) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    collection = build(ParallelLayout(num_ranks=2, tp=2))

    def model(dtype: torch.dtype, scale: float) -> nn.Module:
        built = nn.Linear(2, 2, bias=False)
        built.weight = nn.Parameter((WHOLE * scale).chunk(2, dim=0)[rank].to(dtype))
        for attr, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
            setattr(built.weight, attr, value)
        attach(built, collection)
        return built

    mixed = torch.float16 if rank == 1 else torch.float32
    out: dict[str, Any] = {"state_by_name": value_error_of(lambda: state_by_name(model(mixed, 1.0)))}
    for fmt in SAVE:
        out[f"save {fmt}"] = value_error_of(lambda fmt=fmt: SAVE[fmt](f"{directory}/{fmt}-mixed", model(mixed, 1.0)))
        out[f"written {fmt}"] = sorted(p.name for p in Path(directory, f"{fmt}-mixed").glob("*"))
        SAVE[fmt](f"{directory}/{fmt}", model(torch.float32, 1.0))
        loaded = model(mixed, -1.0)
        out[f"load {fmt}"] = value_error_of(lambda fmt=fmt, loaded=loaded: LOAD[fmt](f"{directory}/{fmt}", loaded))
        out[f"kept {fmt}"] = loaded.weight.tolist()
    return out


def test_tp_ranks_holding_one_parameter_in_other_dtypes_are_refused_on_every_rank_not_an_abort(
    tmp_path: Path,
) -> None:
    for rank, out in enumerate(run_world(2, _cast_on_rank_1, str(tmp_path), timeout=60.0)):
        for owner, key in (
            ("state_by_name", "state_by_name"),
            *((SAVE[fmt].__name__, f"save {fmt}") for fmt in SAVE),
            *((LOAD[fmt].__name__, f"load {fmt}") for fmt in SAVE),
        ):
            assert out[key] == (
                f"{owner}: the TP-sharded parameter 'weight' is held in other dtypes on the ranks of its TP group "
                "(torch.float32 on rank 0, torch.float16 on rank 1): its pieces join into one whole of one dtype. "
                "Cast the model alike on every TP rank"
            ), (rank, key, out)
        for fmt in SAVE:
            assert out[f"written {fmt}"] == [], (rank, fmt, out)
            assert out[f"kept {fmt}"] == (-WHOLE).chunk(2, dim=0)[rank].tolist(), (rank, fmt, out)
