"""Optimizer state of a TP-sharded parameter that its TP ranks hold unlike is refused on every rank, never mixed.

A per-parameter value (Adam's 0-d ``step``) is stored once for the whole parameter, as Megatron-Core keeps one
step in its common state. The checkpoint took TP rank 0's: a ``step`` of 2 on TP rank 1 beside 1 on TP rank 0 came
back 1 on both, without a word (Adam's bias correction then differs from the run saved). State held on some TP ranks
only (a piece that had no grad there, an optimizer given on some ranks only) sent the ranks into other collectives
(one gathering a state tensor, the other agreeing on the save's verdict), which waited until the world's timeout.
2 gloo ranks, TP 2; the oracle is what each rank did to its optimizer."""

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


def _stepped(steps: dict[int, int], *, grad_on: tuple[int, ...] = (0, 1)) -> tuple[nn.Module, Any]:
    """Two 2x2 pieces (row halves of 4x2 weights) after ``steps[rank]`` Adam steps; ``b``'s grad on ``grad_on``."""
    rank = torch.distributed.get_rank()
    model = nn.Module()
    model.a, model.b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2, 2))
    for param in model.parameters():
        for attr, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
            setattr(param, attr, value)
    attach(model, build(ParallelLayout(num_ranks=2, tp=2)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps[rank]):
        model.a.grad = torch.full((2, 2), 1.0 + rank)
        model.b.grad = torch.full((2, 2), 3.0 + rank) if rank in grad_on else None
        optimizer.step()
    return model, optimizer


ADVICE = (
    ". pgregistry.checkpoint joins its state into one whole and keeps one value of each per-parameter state (as "
    "Megatron-Core keeps one step), so every TP rank must hold the same state keys and values: step one optimizer "
    "alike on every TP rank (the same parameters and steps, none skipped on some ranks), then save"
)


def _refusal(owner: str, key: str, name: str, each: str) -> str:
    return (
        f"{owner}: the optimizer state {key!r} of the TP-sharded parameter {name!r} differs across the ranks of its "
        f"TP group ({each}){ADVICE}"
    )


def _saves(directory: str, case: str, make: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fmt in SAVE:
        stepped = make()
        out[SAVE[fmt].__name__] = value_error_of(lambda fmt=fmt, s=stepped: SAVE[fmt](f"{directory}/{case}-{fmt}", *s))
        out[f"written {fmt}"] = sorted(p.name for p in Path(directory, f"{case}-{fmt}").glob("*"))
    stepped = make()
    out["state_by_name"] = value_error_of(lambda: state_by_name(*stepped))
    return out


def _steps_unlike(directory: str) -> dict[str, Any]:
    out = _saves(directory, "unlike", lambda: _stepped({0: 1, 1: 2}))
    for fmt in SAVE:  # the control: steps alike on both ranks save and load
        SAVE[fmt](f"{directory}/alike-{fmt}", *_stepped({0: 2, 1: 2}))
        model, optimizer = _stepped({0: 0, 1: 0})
        LOAD[fmt](f"{directory}/alike-{fmt}", model, optimizer)
        out[f"loaded {fmt}"] = {name: float(optimizer.state[p]["step"]) for name, p in model.named_parameters()}
    return out


def test_a_step_count_unlike_across_tp_ranks_is_refused_on_every_rank_not_taken_from_tp_rank_0(
    tmp_path: Path,
) -> None:
    for rank, out in enumerate(run_world(2, _steps_unlike, str(tmp_path), timeout=60.0)):
        each = "rank 0: 1.0 (torch.float32); rank 1: 2.0 (torch.float32)"  # the steps each rank took
        for fmt in SAVE:
            assert out[SAVE[fmt].__name__] == _refusal(SAVE[fmt].__name__, "step", "a", each), (rank, fmt, out)
            assert out[f"written {fmt}"] == [], (rank, fmt, out)
            assert out[f"loaded {fmt}"] == {"a": 2.0, "b": 2.0}, (rank, fmt, out)
        assert out["state_by_name"] == _refusal("state_by_name", "step", "a", each), (rank, out)


def _held_on_some_ranks(directory: str) -> dict[str, Any]:
    no_grad = _saves(directory, "no-grad", lambda: _stepped({0: 1, 1: 1}, grad_on=(0,)))
    out = {f"no grad {key}": value for key, value in no_grad.items()}
    rank = torch.distributed.get_rank()

    def optimizer_on_rank_0() -> tuple[nn.Module, Any]:
        model, optimizer = _stepped({0: 1, 1: 1})
        return model, optimizer if rank == 0 else None

    out.update({f"rank 0 {k}": v for k, v in _saves(directory, "rank-0", optimizer_on_rank_0).items()})
    return out


def test_state_held_on_some_tp_ranks_only_is_refused_on_every_rank_not_left_waiting(tmp_path: Path) -> None:
    for rank, out in enumerate(run_world(2, _held_on_some_ranks, str(tmp_path), timeout=40.0)):
        for owner in (*(save.__name__ for save in SAVE.values()), "state_by_name"):
            assert out[f"no grad {owner}"] == _refusal(
                owner, "exp_avg", "b", "rank 0: a torch.float32 piece; rank 1: none"  # b had no grad on rank 1
            ), (rank, owner, out)
            assert out[f"rank 0 {owner}"] == (
                f"{owner}: the TP-sharded parameter 'a' is updated on some ranks of its TP group only (rank 0: "
                f"updated; rank 1: no optimizer given){ADVICE}"
            ), (rank, owner, out)
        for fmt in SAVE:
            for case in ("no grad", "rank 0"):
                assert out[f"{case} written {fmt}"] == [], (rank, case, fmt, out)
