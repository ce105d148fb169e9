"""``pgregistry.modules``' checkpoint examples, run as they stand on a 2-rank world of two modules.

They are code blocks (they write ``ckpt/...`` under the working directory): each rank changes into
one temporary directory, the test defines the names the examples leave to the reader (this rank's
models, the job's modules and its optimizer, after one Adam step; for the load, a fresh model and
optimizer) and runs ``save_checkpoint``'s block, then ``load_checkpoint``'s, verbatim. Module
``vision`` runs on rank 0 and ``llm`` on rank 1, each with its own grad. The loaded model and
optimizer must hold what was saved: each module's weight after that step and Adam's first moment,
computed here in float64.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from fixtures.docstring_examples import example_code

from pgregistry import ParallelLayout
from pgregistry import modules as mm
from pgregistry.testing import run_world

INIT, LR = (1.0, 2.0), 1e-3
GRADS = {"vision": (3.0, 4.0), "llm": (-5.0, 0.5)}
LAYOUTS = {"vision": ParallelLayout(num_ranks=1), "llm": ParallelLayout(num_ranks=1, rank_offset=1)}


def _job(modules: Any, *, trained: bool) -> tuple[dict[str, Any], Any]:
    """This rank's models (a 2 -> 1 linear layer each) and the job's Adam; ``trained``: one step
    from INIT, the module's grad the input."""
    models = {}
    for name in modules.here():
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        if trained:
            with torch.no_grad():
                model.weight.copy_(torch.tensor([INIT]))
        models[name] = model
    optimizer = mm.build_optimizer(models, modules, optimizer="adam", lr=LR)
    if trained:
        for name, model in models.items():
            model(torch.tensor([GRADS[name]])).sum().backward()
        optimizer.step()
    return models, optimizer


def _saved_then_loaded(directory: str) -> dict[str, dict[str, list[float]]]:
    os.chdir(directory)
    modules = mm.build_modules(LAYOUTS)
    models, optimizer = _job(modules, trained=True)
    names: dict[str, Any] = {
        "save_checkpoint": mm.save_checkpoint,
        "load_checkpoint": mm.load_checkpoint,
        "models_here": models,
        "modules": modules,
        "optimizer": optimizer,
    }
    exec(example_code(mm.save_checkpoint), names)  # noqa: S102 - the example, verbatim
    new_models, new_optimizer = _job(modules, trained=False)
    names.update(models_here=new_models, optimizer=new_optimizer)
    exec(example_code(mm.load_checkpoint), names)  # noqa: S102
    out = {}
    for name, model in new_models.items():
        state = new_optimizer.optimizers[name].param_state()[model.weight]
        out[name] = {
            "weight": model.weight.detach().flatten().tolist(),
            "exp_avg": torch.as_tensor(state["exp_avg"]).flatten().tolist(),
        }
    return out


def test_the_modules_checkpoint_examples_load_what_they_saved(tmp_path: Path) -> None:
    outcomes = run_world(2, _saved_then_loaded, str(tmp_path), timeout=60)
    init = torch.tensor(INIT, dtype=torch.float64)
    for rank, (outcome, name) in enumerate(zip(outcomes, ("vision", "llm"), strict=True)):
        assert list(outcome) == [name], f"rank {rank} runs {list(outcome)}"
        grad = torch.tensor(GRADS[name], dtype=torch.float64)
        expected = {"weight": init - LR * grad / (grad.abs() + 1e-8), "exp_avg": 0.1 * grad}
        for key, value in expected.items():
            got = torch.tensor(outcome[name][key], dtype=torch.float64)
            torch.testing.assert_close(got, value, msg=lambda m, r=rank, n=name, k=key: f"rank {r}, {n}, {k}: {m}")
