"""The README's example (examples/quickstart.py) on eight ranks: its norm is the global norm of the model.

The example's headline claim is ``optimizer.clip_grad_norm`` returning "the global norm of the unsharded model".
Each rank's raw local grads are recorded just before ``sync_grads`` and the norm is recomputed here in float64
from the rules of the layout (TP 2, EP 4, expert TP 1 over 8 ranks), written out by hand:

* dense parameters are averaged over their data-parallel group (``dp_cp``: the ranks with the same TP rank) and
  replicated over TP, so they count once, from TP rank 0;
* expert ``e`` lives on the ranks with ``rank % 4 == e`` (one per expert-data-parallel replica, ``rank // 4``); its
  grad is the sum over those replicas divided by the ``dp_cp`` size (4); with expert TP 1 every expert counts.

Filtering expert grads with the dense TP group (Megatron-LM PR 6470) drops the experts held by TP rank 1 and makes
this test fail, where checking only that every rank agrees did not.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.module_files import module_from_file

from pgregistry.testing import run_world

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
WORLD, TP, EP, DP = 8, 2, 4, 4


def _train_step_recording_grads() -> dict[str, Any]:
    from pgregistry.optim import ChainedOptimizer

    module = module_from_file("quickstart", EXAMPLE)
    recorded: dict[str, list[torch.Tensor]] = {}
    sync_grads = ChainedOptimizer.sync_grads

    def recording(self: ChainedOptimizer) -> None:
        for child in self.chained_optimizers:
            grads = [param.grad if param.grad is not None else param.main_grad for param in child.params]
            recorded["expert" if child.expert else "dense"] = [g.detach().double().clone() for g in grads]
        sync_grads(self)

    ChainedOptimizer.sync_grads = recording  # type: ignore[method-assign]
    try:
        loss, norm = module.train_step()
    finally:
        ChainedOptimizer.sync_grads = sync_grads  # type: ignore[method-assign]
    return {"loss": loss, "norm": norm, "grads": recorded}


def _oracle(grads: list[dict[str, list[torch.Tensor]]]) -> float:
    """The global grad norm from every rank's raw local grads, in float64 (see the module docstring)."""
    total = 0.0
    tp0 = [2 * d for d in range(DP)]  # dense rank = tp + 2 * dp: the dp_cp group of TP rank 0
    for index in range(len(grads[0]["dense"])):
        averaged = sum(grads[r]["dense"][index] for r in tp0) / DP
        total += float((averaged**2).sum())
    for expert in range(EP):
        holders = [r for r in range(WORLD) if r % EP == expert]  # expert rank = ep + 4 * expert-dp
        for index in range(len(grads[0]["expert"])):
            synced = sum(grads[r]["expert"][index] for r in holders) / DP
            total += float((synced**2).sum())
    return math.sqrt(total)


def test_quickstart_norm_is_the_global_norm_of_the_model() -> None:
    results = run_world(WORLD, _train_step_recording_grads)
    oracle = _oracle([result["grads"] for result in results])
    for rank, result in enumerate(results):
        assert math.isfinite(result["loss"])
        assert result["norm"] == pytest.approx(oracle, rel=1e-5), rank
