"""``carry_optimizer_state(new, old)``, the arguments swapped, is refused on every rank; nothing is carried.

It loaded the freshly built optimizer's empty state into the one that had stepped: its Adam moments and step
count were gone without a word, and training went on from a cold optimizer (found in the tenth round of hostile
inputs). ``new`` must hold no update-rule state; a ``new`` that stepped on one rank only is refused on both,
neither waiting in the load's agreement."""

from __future__ import annotations

from typing import Any

import torch
from fixtures.errors import value_error_of
from torch import nn

from pgregistry import ParallelLayout, attach, build, build_optimizer
from pgregistry.recovery import carry_optimizer_state
from pgregistry.testing import run_world


def _tensors(state: object) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, in order."""
    if isinstance(state, torch.Tensor):
        return [state.clone()]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in _tensors(item)]
    return []


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) > 0 and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _swapped_then_in_order() -> dict[str, Any]:
    pg = build(ParallelLayout(num_ranks=2))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    attach(model, pg)
    old = build_optimizer(model, pg, optimizer="adam", lr=0.1, mixed_precision=False)
    model(torch.ones(1, 3)).sum().backward()
    old.sync_grads()
    old.step()
    stepped = _tensors(old.state_dict())
    new = build_optimizer(model, pg, optimizer="adam", lr=0.1, mixed_precision=False)
    out: dict[str, Any] = {"swapped": value_error_of(lambda: carry_optimizer_state(new, old))}
    out["old kept"] = _equal(stepped, _tensors(old.state_dict()))
    out["in order"] = value_error_of(lambda: carry_optimizer_state(old, new))
    out["carried"] = _equal(stepped, _tensors(new.state_dict()))
    fresh = build_optimizer(model, pg, optimizer="adam", lr=0.1, mixed_precision=False)
    if torch.distributed.get_rank() == 1:
        fresh.step()  # a replicated step is local: this rank's fresh optimizer alone has stepped
    out["one rank"] = value_error_of(lambda: carry_optimizer_state(old, fresh))
    return out


def test_swapped_arguments_are_refused_on_every_rank_and_the_old_state_kept() -> None:
    for rank, out in enumerate(run_world(2, _swapped_then_in_order, timeout=60.0)):
        assert out["swapped"] == (
            "carry_optimizer_state: new holds update-rule state (of 'weight', ...): it has stepped, "
            "and carrying would overwrite that state with old's. new must be the optimizer build_optimizer has "
            "just built on Recovered.collection, old the one that stepped before the recovery: call "
            "carry_optimizer_state(old, new) with the arguments in that order; nothing was carried"
        ), (rank, out)
        assert out["old kept"], (rank, out)  # Adam's moments and step count, bit for bit
        assert out["in order"] == "no error", (rank, out)
        assert out["carried"], (rank, out)
        held = "(of 'weight', ...): it has stepped" if rank == 1 else "on rank 1"
        assert out["one rank"].startswith(f"carry_optimizer_state: new holds update-rule state {held}")
