"""Every optimizer ``build_optimizer`` returns saves and loads through the same checkpoint functions, bit for bit.

Before, ``save_rank_files(directory, model, build_optimizer(model, pg))`` raised ``AttributeError:
'ChainedOptimizer' object has no attribute 'state'``, although the README presents the two together. The checkpoint
functions now take any :class:`pgregistry.optim.ParamStateOptimizer`: the state of each parameter, whole.

On 4 ranks (EP 2, dense dp 4, expert dp 2) the toy MoE takes two Adam steps with a mixed-precision (bfloat16
parameters, float32 main copies), a full-precision and a sharded optimizer, is saved with
:func:`save_rank_files`, and loaded into a fresh model and optimizer built with other values. The fresh pair must
equal the saved one bit for bit: parameters, the optimizer's own ``state_dict()`` (main copies, ``exp_avg``,
``exp_avg_sq``, ``step``), and the parameters after one more identical step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # imported once here; each forked rank would otherwise import it (~3 s)
import torch.distributed as dist
from toy_moe import ToyMoE, build_stage, set_values, value_of

from pgregistry import attach
from pgregistry.checkpoint import load_rank_files, save_rank_files
from pgregistry.collection import ProcessGroupCollection
from pgregistry.layout import ParallelLayout
from pgregistry.optim import ChainedOptimizer, build_optimizer
from pgregistry.params import mark_expert
from pgregistry.registry import build
from pgregistry.testing import run_world

LAYOUT = ParallelLayout(num_ranks=4, ep=2, expt_tp=1)
CONFIGS = {
    "mixed_precision_bf16": {"dtype": torch.bfloat16, "mixed_precision": True, "sharded": False},
    "full_precision": {"dtype": torch.float32, "mixed_precision": False, "sharded": False},
    "sharded": {"dtype": torch.float32, "mixed_precision": True, "sharded": True},
}


def _stage(pgc: ProcessGroupCollection, dtype: torch.dtype) -> ToyMoE:
    coords = LAYOUT.coords(dist.get_rank())
    model = build_stage(coords["ep"], LAYOUT.ep, 0, 1)
    for param, key in model.catalog:
        if key[1] >= 0:
            mark_expert(param)
    attach(model, pgc)
    return model.to(dtype)


def _step(model: ToyMoE, optimizer: ChainedOptimizer, step: int) -> None:
    for param, key in model.catalog:
        param.main_grad.copy_(value_of(key, param.shape, f"grad{step}"))  # type: ignore[attr-defined]
    optimizer.sync_grads()
    optimizer.step()


def _snapshot(model: ToyMoE, optimizer: ChainedOptimizer) -> dict[str, Any]:
    def copied(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copied(v) for v in value]
        return value

    return {
        "params": [param.detach().clone() for param, _ in model.catalog],
        "optimizer": copied(optimizer.state_dict()),
    }


def _rank(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    pgc = build(LAYOUT)
    options = {"optimizer": "adam", "lr": 0.01, "mixed_precision": config["mixed_precision"],
               "sharded": config["sharded"]}
    model = _stage(pgc, config["dtype"])
    set_values(model)
    model.to(config["dtype"])
    optimizer = build_optimizer(model, pgc, **options)
    for step in range(2):
        _step(model, optimizer, step)
    save_rank_files(directory, model, optimizer)
    dist.barrier()  # every rank's file is written before any rank reads them all
    saved = _snapshot(model, optimizer)

    fresh = _stage(pgc, config["dtype"])  # other values: build_stage's random initialisation
    fresh_optimizer = build_optimizer(fresh, pgc, **options)
    load_rank_files(directory, fresh, fresh_optimizer)
    loaded = _snapshot(fresh, fresh_optimizer)
    _step(model, optimizer, 2)
    _step(fresh, fresh_optimizer, 2)
    return {"saved": saved, "loaded": loaded, "next": [_snapshot(model, optimizer), _snapshot(fresh, fresh_optimizer)]}


def _assert_identical(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_build_optimizer_result_round_trips_through_rank_files(name: str, tmp_path: Path) -> None:
    for rank, out in enumerate(run_world(LAYOUT.num_ranks, _rank, tmp_path, CONFIGS[name])):
        assert out["saved"]["optimizer"]["children"], rank
        _assert_identical(out["saved"], out["loaded"], f"rank {rank}")
        _assert_identical(out["next"][0], out["next"][1], f"rank {rank} after one more step")
