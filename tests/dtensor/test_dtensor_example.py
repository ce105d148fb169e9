"""The docs' FSDP2 + EP example (examples/fsdp2_experts.py) on a local 4-rank world, against the float64 norm of
the full grads: the dense layer counted once, each expert's factors once (gathered by torch's own full_tensor)."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist
from fixtures.module_files import module_from_file

from pgregistry.grad_stats import grad_norm
from pgregistry.testing import run_world

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_experts.py"


def _example() -> ModuleType:
    return module_from_file("fsdp2_experts", EXAMPLE)


def _on_rank() -> dict[str, Any]:
    example = _example()
    layout, pg, model = example.build()
    example.backward(model)
    squares = {"dense": 0.0, "experts": 0.0}
    for name, param in model.named_parameters():
        full = param.grad.full_tensor().double()
        per_ep_rank = name in ("experts.lora_a", "experts.lora_b")
        squares["experts" if per_ep_rank else "dense"] += float(full.square().sum())
    return {
        "ep": layout.coords(dist.get_rank())["ep"],
        "squares": squares,
        "norm": float(grad_norm(model, pg)),
        "step": example.train_step(),
    }


def test_fsdp2_experts_example_matches_the_full_grads() -> None:
    results = run_world(4, _on_rank, timeout=60)
    dense = results[0]["squares"]["dense"]
    experts = {out["ep"]: out["squares"]["experts"] for out in results}  # one value per EP rank
    assert sorted(experts) == [0, 1]
    expected = math.sqrt(dense + sum(experts.values()))
    for out in results:
        assert math.isclose(out["squares"]["dense"], dense, rel_tol=1e-12)
        assert math.isclose(out["norm"], expected, rel_tol=1e-5)
        norm, zeros = out["step"]
        assert math.isclose(norm, expected, rel_tol=1e-5)
        assert zeros == results[0]["step"][1]
    assert not math.isclose(expected, math.sqrt(dense + experts[0]), rel_tol=1e-3)  # the EP sum matters
