"""The README's Megatron-Core example (examples/megatron_quickstart.py) builds its model on pgregistry's groups.

Its training step needs CUDA (scripts/megatron_parity.py trains one on GPUs); here its ``build_model`` runs in gloo
worlds of 1 and 2 ranks, and the invariance oracle checks the grad norm: with every grad element 1 it is the square
root of the unsharded model's parameter count, which the 1-rank build gives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fixtures.module_files import module_from_file
from megatron_support import require_megatron

require_megatron()

from pgregistry import grad_norm, registry  # noqa: E402
from pgregistry._runtime.resolve import normalise_params  # noqa: E402
from pgregistry.grad_stats._classification import expert_params_without_allreduce  # noqa: E402
from pgregistry.testing import run_world  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_quickstart.py"


def _build_on_rank() -> dict[str, Any]:
    example = module_from_file("megatron_quickstart", EXAMPLE)
    model, pg = example.build_model(dist.get_world_size())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    out = {
        "numel": sum(p.numel() for p in model.parameters()),
        "norm": float(grad_norm(model, pg)),
        "unclassified": expert_params_without_allreduce(normalise_params(model)),
    }
    registry.destroy()
    return out


def test_megatron_quickstart_model_and_grad_norm() -> None:
    whole = run_world(1, _build_on_rank, timeout=60)[0]
    assert math.isclose(whole["norm"], math.sqrt(whole["numel"]), rel_tol=1e-6)  # float32 sums
    for rank, result in enumerate(run_world(2, _build_on_rank, timeout=60)):
        assert result["numel"] < whole["numel"], rank  # the experts are split over the two ranks
        assert math.isclose(result["norm"], math.sqrt(whole["numel"]), rel_tol=1e-6), rank
        assert result["unclassified"] == [], rank
