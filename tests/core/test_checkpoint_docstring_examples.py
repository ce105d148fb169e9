"""The checkpoint functions' docstring examples, run as they stand on a 2-rank world.

They are code blocks (they write ``ckpt/...`` under the working directory): each rank changes into
one temporary directory, the test defines the names an example leaves to the reader (a model
attached to its collection and an optimizer that took one Adam step; for a load, a fresh model and
optimizer, on another layout where the example says so) and runs the save example's block, then
the load example's, verbatim. The loaded model and optimizer must hold what was saved: the weight
after that step and Adam's first moment, computed here in float64.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.docstring_examples import example_code

from pgregistry import ParallelLayout, attach, build, build_optimizer, checkpoint
from pgregistry.testing import run_world

INIT, GRAD, LR = (1.0, 2.0), (3.0, 4.0), 1e-3


def _model_and_optimizer(layout: ParallelLayout, name: str, *, trained: bool, **options: Any) -> tuple[Any, Any]:
    """A 2 -> 1 linear model on ``layout`` and its Adam; ``trained``: after one step from INIT."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    if trained:
        with torch.no_grad():
            model.weight.copy_(torch.tensor([INIT]))
    pg = build(layout, name=name)
    attach(model, pg)
    optimizer = build_optimizer(model, pg, optimizer="adam", lr=LR, **options)
    if trained:
        model(torch.tensor([GRAD])).sum().backward()  # the grad is the input
        optimizer.step()
    return model, optimizer


def _saved_then_loaded(directory: str, save: str, load: str | None, sharded: bool) -> dict[str, list[float]]:
    """Run the example of ``save``, then that of ``load`` (``None``: the save example loads too)
    in ``directory``; what the loaded model and optimizer hold."""
    os.chdir(directory)
    options = {"sharded": True} if sharded else {}
    model, optimizer = _model_and_optimizer(ParallelLayout(num_ranks=2), "saved", trained=True, **options)
    other = ParallelLayout(num_ranks=2, tp=2)  # "another layout": the weight replicated over TP
    new_model, new_optimizer = _model_and_optimizer(other, "loaded", trained=False, **options)
    # Where a save example loads too and another example is checked, it loads into others.
    loaded_by_save = (new_model, new_optimizer) if load is None else _model_and_optimizer(
        other, "scratch", trained=False, **options
    )
    names: dict[str, Any] = {name: getattr(checkpoint, name) for name in checkpoint.__all__}
    names.update(
        model=model, optimizer=optimizer, model_on_another_layout=loaded_by_save[0],
        its_optimizer=loaded_by_save[1], optimizer_on_another_layout=new_optimizer,
    )
    exec(example_code(getattr(checkpoint, save)), names)  # noqa: S102 - the example, verbatim
    if load is not None:
        names.update(model=new_model, optimizer=new_optimizer)
        exec(example_code(getattr(checkpoint, load)), names)  # noqa: S102
    state = new_optimizer.param_state()[new_model.weight]
    return {
        "weight": new_model.weight.detach().flatten().tolist(),
        "exp_avg": torch.as_tensor(state["exp_avg"]).flatten().tolist(),
    }


@pytest.mark.parametrize(
    ("save", "load", "sharded"),
    [
        ("save_rank_files", None, False),  # its example saves, then loads on another layout
        ("save_rank_files", "load_rank_files", False),
        ("save_distributed", "load_distributed", False),
        ("save_optimizer_shards", "load_optimizer_shards", True),
    ],
)
def test_the_checkpoint_examples_load_what_they_saved(
    tmp_path: Path, save: str, load: str | None, sharded: bool
) -> None:
    outcomes = run_world(2, _saved_then_loaded, str(tmp_path), save, load, sharded, timeout=60)
    grad, init = torch.tensor(GRAD, dtype=torch.float64), torch.tensor(INIT, dtype=torch.float64)
    expected = {"weight": init - LR * grad / (grad.abs() + 1e-8), "exp_avg": 0.1 * grad}
    for rank, outcome in enumerate(outcomes):
        for key, value in expected.items():
            got = torch.tensor(outcome[key], dtype=torch.float64)
            torch.testing.assert_close(got, value, msg=lambda m, r=rank, k=key: f"rank {r}, {k}: {m}")
